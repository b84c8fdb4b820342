"""Who may register: the authenticators of a registration stream (docs/control-plane.md,
Registration lifecycle, step 1).

An authenticator turns the stream's bearer token (or none) into the stream's routing key, or
refuses it. Three are offered:

* open (the default): everyone, no routing key; the replica logs a warning at start-up;
* a static shared token (`--registration-token-file`), compared in constant time, no routing key;
* the `llm_gateway.LlmGateway/AuthLlmWorker` service (`--worker-auth-endpoint`), which maps a
  worker token to a routing key. The replica presents its own bearer to that gateway and may
  dial it over TLS (docs/worker-auth.md).
"""

from __future__ import annotations

import functools
import hmac
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from stargate.config import ServeConfig
from stargate.control_plane.gateway_credentials import (
    BearerProvider,
    CredentialsError,
    gateway_bearer,
)
from stargate.serving import StartupError

__all__ = [
    "AuthenticationFailed",
    "Authenticator",
    "GatewayEndpoint",
    "OpenAuthenticator",
    "StaticTokenAuthenticator",
    "WorkerAuthUnavailable",
    "WorkerAuthenticator",
    "check_worker_auth",
    "parse_gateway_endpoint",
    "read_token_file",
    "registration_authenticator",
    "system_roots",
]

log = logging.getLogger(__name__)


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


WORKER_AUTH_CONNECT_TIMEOUT = 5.0
WORKER_AUTH_CONNECT_PREFIX = "failed to connect to worker auth endpoint"


class WorkerAuthUnavailable(Exception):
    """The start-up check failed: the gateway cannot be reached, or the replica cannot produce
    its own bearer. The message names the endpoint and the reason, never a secret."""


@dataclass(frozen=True, slots=True)
class GatewayEndpoint:
    """Where and how to dial the worker-auth gateway: a grpcio target and whether to use TLS."""

    target: str
    tls: bool


def parse_gateway_endpoint(endpoint: str, *, ca_file: Path | None = None) -> GatewayEndpoint:
    """`HOST:PORT` or `http://HOST:PORT` dial in plaintext, `https://HOST:PORT` over TLS (a
    missing port is the scheme's, 443 or 80); a CA file turns TLS on for `HOST:PORT` too,
    because giving one means the gateway presents a certificate (`http://` with a CA file is
    refused by `ControlPlaneConfig`; docs/worker-auth.md).

    Raises ValueError for anything else (another scheme, a path, no host)."""
    text = endpoint.strip()
    scheme, separator, rest = text.partition("://")
    if not separator:
        scheme, rest = "", text
    scheme = scheme.lower()
    if scheme not in ("", "http", "https"):
        raise ValueError(f"worker auth endpoint {endpoint!r}: scheme must be http or https")
    authority = rest.removesuffix("/")
    if not authority or "/" in authority or "?" in authority or "#" in authority:
        raise ValueError(
            f"worker auth endpoint {endpoint!r} must be HOST:PORT, http://HOST:PORT or "
            "https://HOST:PORT"
        )
    if authority.startswith("["):  # [v6] or [v6]:port
        closing = authority.find("]")
        host, tail = authority[: closing + 1], authority[closing + 1 :]
        if closing < 0 or (tail and not tail.startswith(":")):
            raise ValueError(f"worker auth endpoint {endpoint!r}: malformed [IPv6] host")
        port = tail[1:]
    elif ":" in authority:
        host, _, port = authority.rpartition(":")
        if ":" in host:
            raise ValueError(f"worker auth endpoint {endpoint!r}: put an IPv6 host in brackets")
    else:
        host, port = authority, ""
    if not host or host == "[]":
        raise ValueError(f"worker auth endpoint {endpoint!r} has no host")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"worker auth endpoint {endpoint!r}: port must be 1 to 65535")
    if not port:
        if scheme == "":
            raise ValueError(f"worker auth endpoint {endpoint!r} needs a port (HOST:PORT)")
        port = "443" if scheme == "https" else "80"
    return GatewayEndpoint(f"{host}:{port}", tls=scheme == "https" or ca_file is not None)


def system_roots() -> bytes | None:
    """The system trust store as one PEM bundle (OpenSSL's default CA file, `SSL_CERT_FILE` if
    set), so an `https://` gateway is verified like any other TLS client on the host (an image
    that adds its internal CA to the store works); None, grpcio's bundled roots, when there is
    no such file."""
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile):
        if candidate:
            try:
                return Path(candidate).read_bytes()
            except OSError:
                continue
    return None


class WorkerAuthenticator:
    """Asks `llm_gateway.LlmGateway/AuthLlmWorker` (a gRPC service) for the routing key.

    Every call carries the replica's own `authorization: Bearer <token>` when `credentials` is
    given (stargate/control_plane/gateway_credentials.py); the channel is TLS for an `https://`
    endpoint (the system trust store) or with `ca_file` (its roots only). grpcio's client is
    blocking, so each call runs in a worker thread; the channel is created once. The response's
    routing key is trimmed; empty means unkeyed. Any failure refuses the stream (UNAUTHENTICATED
    to the Pylon)."""

    def __init__(
        self,
        endpoint: str,
        credentials: BearerProvider | None = None,
        *,
        ca_file: Path | None = None,
        timeout: float = 5.0,
    ) -> None:
        import grpc

        from stargate.protocol import llm_gateway_pb2_grpc

        self.endpoint = endpoint
        self.gateway = parse_gateway_endpoint(endpoint, ca_file=ca_file)
        if self.gateway.tls:
            roots = ca_file.read_bytes() if ca_file is not None else system_roots()
            self._channel: Any = grpc.secure_channel(
                self.gateway.target, grpc.ssl_channel_credentials(root_certificates=roots)
            )
        else:
            self._channel = grpc.insecure_channel(self.gateway.target)
        self._stub: Any = llm_gateway_pb2_grpc.LlmGatewayStub(self._channel)  # type: ignore[no-untyped-call]
        self._credentials = credentials
        self._timeout = timeout

    @property
    def credentials_kind(self) -> str:
        """Where the replica's own bearer comes from: none, secrets-file or oauth2."""
        return "none" if self._credentials is None else self._credentials.kind

    def __repr__(self) -> str:
        return f"WorkerAuthenticator({self.endpoint!r}, tls={self.gateway.tls})"

    async def check(self, connect_timeout: float = WORKER_AUTH_CONNECT_TIMEOUT) -> None:
        """The start-up check: the channel becomes ready within `connect_timeout`, and the
        replica's bearer can be obtained. Raises WorkerAuthUnavailable otherwise."""
        reason = await trio.to_thread.run_sync(
            self._wait_ready, connect_timeout, abandon_on_cancel=True
        )
        if reason is not None:
            raise WorkerAuthUnavailable(f"{WORKER_AUTH_CONNECT_PREFIX} {self.endpoint}: {reason}")
        if self._credentials is not None:
            try:
                await self._credentials.check()
            except CredentialsError as error:
                raise WorkerAuthUnavailable(
                    f"cannot authenticate to worker auth endpoint {self.endpoint}: {error}"
                ) from None

    def _wait_ready(self, timeout: float) -> str | None:
        """None once the channel is ready, else why it is not (from a worker thread)."""
        import grpc

        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
            return None
        except grpc.FutureTimeoutError:
            pass
        # The ready future says only "not ready". A fail-fast call on a channel that is not
        # connected is refused locally with grpcio's last connection error (refused, DNS, TLS
        # handshake), which is the reason worth printing; nothing reaches the gateway.
        probe = self._channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            probe(b"", timeout=1.0, wait_for_ready=False)
        except grpc.RpcError as error:
            code = error.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return str(error.details() or code.name)
        return None  # it connected meanwhile: the gateway answered the probe

    async def authenticate(self, token: str | None) -> str | None:
        import grpc

        from stargate.protocol import llm_gateway_pb2

        metadata: list[tuple[str, str]] = []
        if self._credentials is not None:
            try:
                bearer = await self._credentials.bearer()
            except CredentialsError as error:
                log.warning("worker auth refused a registration: %s", error)
                raise AuthenticationFailed from None
            metadata.append(("authorization", f"Bearer {bearer}"))
        request = llm_gateway_pb2.AuthLlmWorkerRequest(workerToken=token or "")

        def call() -> str:
            response = self._stub.AuthLlmWorker(request, metadata=metadata, timeout=self._timeout)
            return str(response.routingKey)

        try:
            routing_key = await trio.to_thread.run_sync(call, abandon_on_cancel=True)
        except grpc.RpcError as error:
            # The status code only: a gateway's details might echo the token it was given.
            code = getattr(error, "code", lambda: None)()
            name = getattr(code, "name", "UNKNOWN")
            if code in _gateway_trouble():
                log.warning("worker auth gateway %s failed a call: %s", self.endpoint, name)
            else:
                log.debug("worker auth gateway %s refused a token: %s", self.endpoint, name)
            raise AuthenticationFailed from None
        except Exception as error:  # transport failures alike
            raise AuthenticationFailed from error
        return routing_key.strip() or None

    async def aclose(self) -> None:
        self._channel.close()
        if self._credentials is not None:
            await self._credentials.aclose()

    def close(self) -> None:
        self._channel.close()


@functools.cache
def _gateway_trouble() -> frozenset[object]:
    """Codes that mean the gateway, or the replica's own credentials, are at fault rather than
    the Pylon's token: an operator should hear of them."""
    import grpc

    return frozenset(
        {
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.UNIMPLEMENTED,
        }
    )


def registration_authenticator(config: ServeConfig) -> Authenticator:
    """Who may register with this replica: the static token of `--registration-token-file`, else
    the gateway of `--worker-auth-endpoint`, else anyone. A token file or endpoint that cannot be
    used fails start-up (`StartupError`) rather than leaving registration open."""
    control = config.control_plane
    if control.registration_token_file is not None:
        return StaticTokenAuthenticator(read_token_file(control.registration_token_file))
    if control.worker_auth_endpoint is not None:
        try:
            parse_gateway_endpoint(control.worker_auth_endpoint)
            return WorkerAuthenticator(
                control.worker_auth_endpoint,
                gateway_bearer(config),
                ca_file=control.worker_auth_ca_file,
            )
        except (ValueError, OSError) as error:
            raise StartupError(f"invalid worker auth configuration: {error}") from error
    return OpenAuthenticator()


async def check_worker_auth(authenticator: Authenticator) -> WorkerAuthenticator | None:
    """Before serving: the worker-auth gateway answers and the replica's own bearer can be had, so
    a wrong endpoint, CA or secret fails start-up (`StartupError`) at once rather than at the
    first registration (docs/worker-auth.md). Returns the gateway's authenticator once checked,
    None when registration does not use one."""
    if not isinstance(authenticator, WorkerAuthenticator):
        return None
    try:
        await authenticator.check()
    except WorkerAuthUnavailable as error:
        with trio.CancelScope(shield=True):
            await authenticator.aclose()
        raise StartupError(str(error)) from None
    return authenticator
