"""The replica's gateway bearer (stargate/control_plane/gateway_credentials.py): the secrets-file
bearer, and OAuth2 client credentials against a fake token endpoint on trio's mock clock (minted,
cached, refreshed before expiry, a failed refresh kept quiet while the token lasts, the endpoint
down at start-up)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import parse_qs, unquote_plus

import httpx
import pytest
import trio
from trio.testing import MockClock

from stargate.control_plane.gateway_credentials import (
    CredentialsError,
    OAuth2ClientCredentials,
    SecretsFileBearer,
    basic_authorization,
)
from stargate.secrets_file import SecretsFile
from tests.fakes.logs import captured_logs

CLIENT_ID = "stargate:replica"  # a colon: RFC 6749 §2.3.1 form-encodes it before Basic
CLIENT_SECRET = "cs-9d/3+f=0a&7c%e1"


class FakeTokenEndpoint:
    """`POST /token` of an OAuth2 provider, as an httpx transport: checks the client's Basic
    credentials and form body, and answers with numbered tokens."""

    def __init__(self, expires_in: object = 600) -> None:
        self.expires_in = expires_in
        self.minted = 0
        self.requests: list[httpx.Request] = []
        self.failure: Callable[[], httpx.Response] | None = None
        self.down = False

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if self.failure is not None:
            return self.failure()
        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        client_id, _, secret = base64.b64decode(encoded).decode().partition(":")
        if (
            scheme != "Basic"
            or unquote_plus(client_id) != CLIENT_ID
            or unquote_plus(secret) != CLIENT_SECRET
        ):
            return httpx.Response(401, json={"error": "invalid_client"})
        form = parse_qs(request.content.decode())
        if form != {"grant_type": ["client_credentials"], "scope": ["llm:check_worker"]}:
            return httpx.Response(400, json={"error": "invalid_request"})
        self.minted += 1
        body = {"access_token": f"at-{self.minted}", "token_type": "Bearer"}
        if self.expires_in is not None:
            body["expires_in"] = self.expires_in  # type: ignore[assignment]
        return httpx.Response(200, json=body)


def _secrets(tmp_path: Path, **values: object) -> SecretsFile:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps(values or {"clientId": CLIENT_ID, "clientSecret": CLIENT_SECRET}))
    return SecretsFile(path)


@pytest.fixture
def endpoint() -> FakeTokenEndpoint:
    return FakeTokenEndpoint()


@pytest.fixture
async def oauth2(
    tmp_path: Path, endpoint: FakeTokenEndpoint
) -> AsyncIterator[OAuth2ClientCredentials]:
    provider = OAuth2ClientCredentials(
        "https://auth.example.test/", _secrets(tmp_path), transport=endpoint.transport()
    )
    yield provider
    await provider.aclose()


def test_basic_credentials_are_form_encoded_first() -> None:
    header = basic_authorization("a:b", "c d+")
    assert header == "Basic " + base64.b64encode(b"a%3Ab:c+d%2B").decode()


async def test_a_token_is_minted_with_basic_auth_and_the_scope(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint
) -> None:
    assert oauth2.token_url == "https://auth.example.test/token"
    assert await oauth2.bearer() == "at-1"
    (request,) = endpoint.requests
    assert request.method == "POST"
    assert str(request.url) == "https://auth.example.test/token"
    assert request.headers["content-type"] == "application/x-www-form-urlencoded"
    assert request.headers["authorization"] == basic_authorization(CLIENT_ID, CLIENT_SECRET)


async def test_the_token_is_cached_then_refreshed_before_it_expires(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint, mock_clock: MockClock
) -> None:
    # 600 s tokens: refresh after min(80% = 480 s, 600 - 60 = 540 s) = 480 s.
    assert await oauth2.bearer() == "at-1"
    mock_clock.jump(479)
    assert await oauth2.bearer() == "at-1"
    assert endpoint.minted == 1
    mock_clock.jump(2)
    assert await oauth2.bearer() == "at-2"  # refreshed, 119 s before the old one expired
    assert endpoint.minted == 2


async def test_the_earlier_of_80_percent_and_60_s_before_expiry_wins(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint, mock_clock: MockClock
) -> None:
    endpoint.expires_in = 3600  # 80% = 2880 s, 60 s before = 3540 s: the earlier wins
    assert await oauth2.bearer() == "at-1"
    mock_clock.jump(2879)
    assert await oauth2.bearer() == "at-1"
    endpoint.expires_in = 200  # 80% = 160 s, 60 s before = 140 s: the earlier wins
    mock_clock.jump(2)
    assert await oauth2.bearer() == "at-2"
    mock_clock.jump(139)
    assert await oauth2.bearer() == "at-2"
    mock_clock.jump(2)
    assert await oauth2.bearer() == "at-3"


async def test_a_failed_refresh_keeps_the_valid_token_and_backs_off(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint, mock_clock: MockClock
) -> None:
    assert await oauth2.bearer() == "at-1"
    mock_clock.jump(500)  # refresh due (480 s), 100 s of life left
    endpoint.down = True
    with captured_logs("debug") as logs:
        assert await oauth2.bearer() == "at-1"
        assert await oauth2.bearer() == "at-1"  # within the back-off: no new request
    assert len(endpoint.requests) == 2
    assert "OAuth2 token refresh failed, still using the current token" in logs.getvalue()
    mock_clock.jump(1.5)  # past the first back-off (1 s)
    assert await oauth2.bearer() == "at-1"
    assert len(endpoint.requests) == 3
    endpoint.down = False
    mock_clock.jump(2.5)  # past the second back-off (2 s)
    assert await oauth2.bearer() == "at-2"


async def test_an_expired_token_is_never_presented(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint, mock_clock: MockClock
) -> None:
    assert await oauth2.bearer() == "at-1"
    endpoint.down = True
    mock_clock.jump(601)
    with pytest.raises(CredentialsError, match="Connection refused"):
        await oauth2.bearer()
    endpoint.down = False
    with pytest.raises(CredentialsError):  # still backing off
        await oauth2.bearer()
    mock_clock.jump(1.5)
    assert await oauth2.bearer() == "at-2"


async def test_concurrent_callers_share_one_token_request(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint
) -> None:
    tokens: list[str] = []

    async def get() -> None:
        tokens.append(await oauth2.bearer())

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(get)
    assert tokens == ["at-1"] * 5
    assert endpoint.minted == 1


async def test_the_start_up_check_fails_clearly_when_the_endpoint_is_down(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint, autojump_clock: MockClock
) -> None:
    endpoint.down = True
    with pytest.raises(CredentialsError) as caught:
        await oauth2.check()
    assert str(caught.value) == (
        "failed to obtain an OAuth2 token from https://auth.example.test/token: "
        "[Errno 111] Connection refused"
    )
    assert len(endpoint.requests) == 3  # retried with back-off, then gave up


async def test_the_start_up_check_rides_out_a_blip(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint, autojump_clock: MockClock
) -> None:
    endpoint.down = True

    async def recover() -> None:
        await trio.sleep(0.2)
        endpoint.down = False

    async with trio.open_nursery() as nursery:
        nursery.start_soon(recover)
        await oauth2.check()
    assert await oauth2.bearer() == "at-1"


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (
            lambda: httpx.Response(401, json={"error": "invalid_client"}),
            "HTTP 401 (invalid_client)",
        ),
        (lambda: httpx.Response(503, text="down for maintenance"), "HTTP 503"),
        (lambda: httpx.Response(200, text="<html>"), "the answer is not JSON"),
        (lambda: httpx.Response(200, json={"token": "x"}), "the answer has no access_token string"),
        (
            lambda: httpx.Response(200, json={"access_token": "x", "expires_in": -5}),
            "expires_in is not a positive number",
        ),
    ],
)
async def test_bad_answers_are_named(
    oauth2: OAuth2ClientCredentials,
    endpoint: FakeTokenEndpoint,
    answer: Callable[[], httpx.Response],
    reason: str,
) -> None:
    endpoint.failure = answer
    with pytest.raises(CredentialsError) as caught:
        await oauth2.bearer()
    assert str(caught.value).endswith(f"/token: {reason}")


async def test_a_missing_expires_in_assumes_five_minutes(
    oauth2: OAuth2ClientCredentials, endpoint: FakeTokenEndpoint, mock_clock: MockClock
) -> None:
    endpoint.expires_in = None
    assert await oauth2.bearer() == "at-1"
    mock_clock.jump(239)  # 300 s: refresh at min(240, 240)
    assert await oauth2.bearer() == "at-1"
    mock_clock.jump(2)
    assert await oauth2.bearer() == "at-2"


async def test_wrong_client_credentials_are_refused_by_the_endpoint(
    tmp_path: Path, endpoint: FakeTokenEndpoint
) -> None:
    secrets = _secrets(tmp_path, clientId=CLIENT_ID, clientSecret="wrong")
    provider = OAuth2ClientCredentials("http://auth.test", secrets, transport=endpoint.transport())
    with pytest.raises(CredentialsError, match="HTTP 401 \\(invalid_client\\)"):
        await provider.bearer()
    await provider.aclose()


async def test_missing_client_credentials_name_the_key(
    tmp_path: Path, endpoint: FakeTokenEndpoint
) -> None:
    secrets = _secrets(tmp_path, clientId=CLIENT_ID)
    provider = OAuth2ClientCredentials("http://auth.test", secrets, transport=endpoint.transport())
    with pytest.raises(CredentialsError, match="has no key clientSecret"):
        await provider.check()
    assert endpoint.requests == []
    await provider.aclose()


async def test_the_secrets_file_bearer_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"nvcfApiToken": "first"}))
    provider = SecretsFileBearer(SecretsFile(path), ("nvcfApiToken",))
    await provider.check()
    assert await provider.bearer() == "first"
    path.write_text(json.dumps({"nvcfApiToken": "second-value"}))
    assert await provider.bearer() == "second-value"
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(CredentialsError, match="has no key authToken"):
        await SecretsFileBearer(SecretsFile(tmp_path / "other.json"), ("authToken",)).check()


async def test_no_credential_is_logged_at_debug(
    tmp_path: Path, endpoint: FakeTokenEndpoint, mock_clock: MockClock
) -> None:
    with captured_logs("debug") as logs:
        logging.getLogger("stargate").debug("debug logging is on")
        provider = OAuth2ClientCredentials(
            "http://auth.test", _secrets(tmp_path), transport=endpoint.transport()
        )
        await provider.check()
        token = await provider.bearer()
        mock_clock.jump(500)
        endpoint.down = True
        await provider.bearer()  # a failed refresh: a WARNING
        endpoint.failure = lambda: httpx.Response(
            400, json={"error": "invalid_grant", "error_description": f"bad {CLIENT_SECRET}"}
        )
        endpoint.down = False
        mock_clock.jump(30)
        await provider.bearer()  # a refused refresh: another WARNING
        await provider.aclose()
    output = logs.getvalue()
    assert "debug logging is on" in output and "WARNING" in output
    for secret in (token, CLIENT_SECRET, CLIENT_ID, basic_authorization(CLIENT_ID, CLIENT_SECRET)):
        assert secret not in output
