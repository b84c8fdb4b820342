"""stargate: an LLM request router replica.

A parity rewrite, on trio, of NVIDIA's Rust Stargate router: inference backends ("Pylons")
register over gRPC, clients send OpenAI-compatible requests, and `/readyz` is gated by a warmup
that promotes early once the set of registered backends is stable.
"""

__version__ = "0.1.0"
