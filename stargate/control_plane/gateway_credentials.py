"""The replica's own credentials towards the worker-auth gateway: the bearer it puts on every
`llm_gateway.LlmGateway/AuthLlmWorker` call (docs/worker-auth.md, "The replica's credentials").

Two providers, chosen by the flags (`gateway_bearer`):

* `SecretsFileBearer` (`--secrets-path`): the string at `--secrets-json-path` in the secrets file,
  re-read when Kubernetes rotates the file (stargate/secrets_file.py);
* `OAuth2ClientCredentials` (`--oauth2-provider-host` with `--secrets-path`): a token minted by
  the OAuth2 client-credentials grant (RFC 6749 §4.4) at `<host>/token`, scope
  `llm:check_worker`, with the `clientId` / `clientSecret` of the secrets file sent by HTTP Basic
  authentication (§2.3.1). It is cached and refreshed on use once it is old (80% of its
  lifetime, or 60 s before it expires if that comes first); a failed refresh keeps the current,
  still valid token and backs off before trying again, so a token endpoint outage shorter than
  the token's remaining life goes unnoticed by Pylons.

Refreshing on use rather than from a background task keeps the provider free of tasks (nothing to
start or cancel); the price is one token request on the registration that finds the token old.

Tokens, client secrets and response bodies are never logged or put in an error message.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import math
import ssl
from collections.abc import Sequence
from typing import Final, Protocol
from urllib.parse import quote_plus

import httpx
import trio

from stargate.config import ServeConfig
from stargate.secrets_file import SecretsFile, SecretsFileError

__all__ = [
    "CLIENT_ID_KEY",
    "CLIENT_SECRET_KEY",
    "OAUTH2_SCOPE",
    "BearerProvider",
    "CredentialsError",
    "OAuth2ClientCredentials",
    "SecretsFileBearer",
    "basic_authorization",
    "gateway_bearer",
]

log = logging.getLogger(__name__)

OAUTH2_SCOPE: Final = "llm:check_worker"
CLIENT_ID_KEY: Final = "clientId"
CLIENT_SECRET_KEY: Final = "clientSecret"
DEFAULT_EXPIRES_IN: Final = 300.0  # when the token endpoint leaves `expires_in` out
REFRESH_FRACTION: Final = 0.8
REFRESH_MARGIN: Final = 60.0
MIN_BACKOFF: Final = 1.0
MAX_BACKOFF: Final = 30.0
TOKEN_REQUEST_TIMEOUT: Final = 10.0
# The start-up check rides out a blip (a token endpoint restarting) but not an outage.
STARTUP_ATTEMPTS: Final = 3


class CredentialsError(Exception):
    """The replica cannot produce its gateway bearer; the message holds no secret."""


class BearerProvider(Protocol):
    kind: str  # for the start-up log line: where the bearer comes from

    async def bearer(self) -> str:
        """The bearer to present now, or raise CredentialsError."""
        ...

    async def check(self) -> None:
        """The start-up check: raise CredentialsError if no bearer can be obtained."""
        ...

    async def aclose(self) -> None: ...


class SecretsFileBearer:
    """The bearer stored in the secrets file at a dot-separated key path."""

    kind = "secrets-file"

    def __init__(self, secrets: SecretsFile, keys: Sequence[str]) -> None:
        self._secrets = secrets
        self._keys = tuple(keys)

    def __repr__(self) -> str:
        return f"SecretsFileBearer({self._secrets!r}, {'.'.join(self._keys)!r})"

    async def bearer(self) -> str:
        try:
            # A stat (and, after a rotation, a read): file I/O stays off the event loop.
            return await trio.to_thread.run_sync(self._secrets.string, self._keys)
        except SecretsFileError as error:
            raise CredentialsError(str(error)) from None

    async def check(self) -> None:
        await self.bearer()

    async def aclose(self) -> None:
        pass


def basic_authorization(client_id: str, client_secret: str) -> str:
    """The `authorization` header value of RFC 6749 §2.3.1: id and secret form-urlencoded, joined
    by a colon, base64-encoded (plain RFC 7617 would break on a colon in the id)."""
    pair = f"{quote_plus(client_id)}:{quote_plus(client_secret)}"
    return "Basic " + base64.b64encode(pair.encode()).decode("ascii")


class OAuth2ClientCredentials:
    """Bearer tokens minted by the client-credentials grant, cached and refreshed before expiry.

    Times come from trio's clock (tests drive it with `trio.testing.MockClock`). `transport` lets
    tests talk to an in-process fake token endpoint.
    """

    kind = "oauth2"

    def __init__(
        self,
        provider_host: str,
        secrets: SecretsFile,
        *,
        scope: str = OAUTH2_SCOPE,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.token_url = provider_host.rstrip("/") + "/token"
        self._secrets = secrets
        self._scope = scope
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=TOKEN_REQUEST_TIMEOUT,
            follow_redirects=False,
            # No proxy or .netrc from the environment: the request carries the client secret.
            trust_env=False,
            verify=ssl.create_default_context(),  # the system trust store
        )
        self._lock = trio.Lock()  # one token request at a time; the others wait for its token
        self._token: str | None = None
        self._refresh_at = -math.inf
        self._expires_at = -math.inf
        self._failures = 0
        self._retry_at = -math.inf
        self._last_error: CredentialsError | None = None

    def __repr__(self) -> str:
        return f"OAuth2ClientCredentials({self.token_url!r})"

    async def bearer(self) -> str:
        if self._token is not None and trio.current_time() < self._refresh_at:
            return self._token
        async with self._lock:
            now = trio.current_time()
            current = self._token if now < self._expires_at else None
            if current is not None and now < self._refresh_at:
                return current  # minted while this call waited for the lock
            if now < self._retry_at:  # backing off after a failure
                if current is not None:
                    return current
                raise CredentialsError(str(self._last_error))
            try:
                return await self._mint()
            except CredentialsError as error:
                self._failures += 1
                backoff = min(MAX_BACKOFF, MIN_BACKOFF * 2 ** (self._failures - 1))
                now = trio.current_time()
                self._retry_at = now + backoff
                self._last_error = error
                if current is None:
                    raise
                log.warning(
                    "OAuth2 token refresh failed, still using the current token (valid for "
                    "%.0f s more); retrying in %.0f s: %s",
                    self._expires_at - now,
                    backoff,
                    error,
                )
                return current

    async def check(self) -> None:
        """Mint the first token, retrying a few times with backoff; raise if it cannot be had."""
        for attempt in range(STARTUP_ATTEMPTS):
            try:
                await self._mint()
                return
            except CredentialsError:
                if attempt == STARTUP_ATTEMPTS - 1:
                    raise
                await trio.sleep(MIN_BACKOFF * 2**attempt / 2)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _mint(self) -> str:
        """Request a token now; record it and its refresh and expiry times."""
        try:
            client_id, client_secret = await trio.to_thread.run_sync(self._client_credentials)
        except SecretsFileError as error:
            raise CredentialsError(str(error)) from None
        started = trio.current_time()
        try:
            response = await self._client.post(
                self.token_url,
                data={"grant_type": "client_credentials", "scope": self._scope},
                headers={
                    "authorization": basic_authorization(client_id, client_secret),
                    "accept": "application/json",
                },
            )
        except httpx.HTTPError as error:
            raise CredentialsError(self._failure(_transport_reason(error))) from None
        if response.status_code != 200:
            raise CredentialsError(self._failure(_status_reason(response)))
        token, lifetime = self._parse(response)
        self._token = token
        self._expires_at = started + lifetime
        self._refresh_at = started + _refresh_after(lifetime)
        self._failures = 0
        self._retry_at = -math.inf
        self._last_error = None
        log.info("OAuth2 token obtained from %s, expires in %.0f s", self.token_url, lifetime)
        return token

    def _client_credentials(self) -> tuple[str, str]:
        return (
            self._secrets.string((CLIENT_ID_KEY,)),
            self._secrets.string((CLIENT_SECRET_KEY,)),
        )

    def _parse(self, response: httpx.Response) -> tuple[str, float]:
        try:
            body = response.json()
        except ValueError:
            raise CredentialsError(self._failure("the answer is not JSON")) from None
        if not isinstance(body, dict):
            raise CredentialsError(self._failure("the answer is not a JSON object"))
        token = body.get("access_token")
        if not isinstance(token, str) or not token.strip():
            raise CredentialsError(self._failure("the answer has no access_token string"))
        expires_in = body.get("expires_in", DEFAULT_EXPIRES_IN)
        if isinstance(expires_in, str):  # some providers send the number as a string
            with contextlib.suppress(ValueError):
                expires_in = float(expires_in)
        if (
            isinstance(expires_in, bool)
            or not isinstance(expires_in, int | float)
            or not math.isfinite(expires_in)
            or expires_in <= 0
        ):
            raise CredentialsError(self._failure("expires_in is not a positive number"))
        return token.strip(), float(expires_in)

    def _failure(self, reason: str) -> str:
        return f"failed to obtain an OAuth2 token from {self.token_url}: {reason}"


def _refresh_after(lifetime: float) -> float:
    """Seconds after minting to refresh: at 80% of the lifetime or 60 s before expiry, whichever
    comes first, but never in the first half (a short-lived token would be re-minted on every
    call)."""
    return max(min(REFRESH_FRACTION * lifetime, lifetime - REFRESH_MARGIN), lifetime / 2)


def _transport_reason(error: httpx.HTTPError) -> str:
    """httpx's message (it names the failure, never request content), with the operating
    system's reason when it is buried in the cause chain: trio's connect reports "all attempts to
    connect ... failed" with the "Connection refused" inside an exception group."""
    reason = str(error) or type(error).__name__
    pending: list[BaseException] = [error]
    while pending:
        cause = pending.pop()
        if isinstance(cause, OSError) and cause.strerror:
            if cause.strerror not in reason:
                reason += f" ({cause.strerror})"
            break
        if isinstance(cause, BaseExceptionGroup):
            pending.extend(reversed(cause.exceptions))
        link = cause.__cause__ or cause.__context__
        if link is not None:
            pending.append(link)
    return reason


def _status_reason(response: httpx.Response) -> str:
    """The HTTP status, with the OAuth2 `error` code (RFC 6749 §5.2) when there is one; the
    `error_description` and any other body text are left out, in case they echo a credential."""
    reason = f"HTTP {response.status_code}"
    try:
        body = response.json()
    except ValueError:
        return reason
    code = body.get("error") if isinstance(body, dict) else None
    if isinstance(code, str) and code.isascii() and code.replace("_", "").isalnum():
        reason += f" ({code})"
    return reason


def gateway_bearer(config: ServeConfig) -> BearerProvider | None:
    """The bearer the replica presents to the worker-auth gateway (docs/worker-auth.md): minted
    by OAuth2 with `--oauth2-provider-host`, else read from the secrets file; none without one."""
    if config.secrets.path is None:
        return None
    secrets = SecretsFile(config.secrets.path)
    if config.control_plane.oauth2_provider_host is not None:
        return OAuth2ClientCredentials(config.control_plane.oauth2_provider_host, secrets)
    return SecretsFileBearer(secrets, config.secrets.json_keys)
