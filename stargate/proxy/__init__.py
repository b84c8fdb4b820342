"""The data plane: the OpenAI-compatible proxy."""
