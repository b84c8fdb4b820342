"""Who may register: the authenticators of a registration stream (docs/control-plane.md,
Registration lifecycle, step 1).

An authenticator turns the stream's bearer token (or none) into the stream's routing key, or
refuses it. Three are offered:

* open (the default): everyone, no routing key; the replica logs a warning at start-up;
* a static shared token (`--registration-token-file`), compared in constant time, no routing key;
* the `llm_gateway.LlmGateway/AuthLlmWorker` service (`--worker-auth-endpoint`), which maps a
  worker token to a routing key.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any, Protocol

import trio

__all__ = [
    "AuthenticationFailed",
    "Authenticator",
    "OpenAuthenticator",
    "StaticTokenAuthenticator",
    "WorkerAuthenticator",
    "read_token_file",
]


class AuthenticationFailed(Exception):
    """The token is missing or not accepted."""


class Authenticator(Protocol):
    async def authenticate(self, token: str | None) -> str | None:
        """Return the routing key for `token` (None = unkeyed) or raise AuthenticationFailed."""
        ...


class OpenAuthenticator:
    """Accepts every stream, with no routing key."""

    async def authenticate(self, token: str | None) -> str | None:
        return None


def read_token_file(path: Path) -> str:
    """The shared token in `path`, surrounding white space removed; it must not be empty."""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"registration token file {path} is empty")
    return token


class StaticTokenAuthenticator:
    """Accepts streams whose bearer token equals a shared secret."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def __repr__(self) -> str:  # never show the token
        return "StaticTokenAuthenticator(<redacted>)"

    async def authenticate(self, token: str | None) -> str | None:
        if token is None or not hmac.compare_digest(token.encode(), self._token):
            raise AuthenticationFailed
        return None


class WorkerAuthenticator:
    """Asks `llm_gateway.LlmGateway/AuthLlmWorker` (a gRPC service) for the routing key.

    grpcio's client is blocking, so each call runs in a worker thread; the channel is created once.
    The response's routing key is trimmed; empty means unkeyed. Any RPC failure refuses the stream.
    """

    def __init__(
        self, endpoint: str, gateway_token: str | None = None, timeout: float = 5.0
    ) -> None:
        import grpc

        from stargate.protocol import llm_gateway_pb2_grpc

        self._channel: Any = grpc.insecure_channel(endpoint)
        self._stub: Any = llm_gateway_pb2_grpc.LlmGatewayStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = [("authorization", f"Bearer {gateway_token}")] if gateway_token else []
        self._timeout = timeout

    async def authenticate(self, token: str | None) -> str | None:
        from stargate.protocol import llm_gateway_pb2

        request = llm_gateway_pb2.AuthLlmWorkerRequest(workerToken=token or "")

        def call() -> str:
            response = self._stub.AuthLlmWorker(
                request, metadata=self._metadata, timeout=self._timeout
            )
            return str(response.routingKey)

        try:
            routing_key = await trio.to_thread.run_sync(call, abandon_on_cancel=True)
        except Exception as error:  # grpc.RpcError and transport failures alike
            raise AuthenticationFailed from error
        return routing_key.strip() or None

    def close(self) -> None:
        self._channel.close()
