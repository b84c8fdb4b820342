"""The control plane: gRPC registration, discovery and model listing."""
