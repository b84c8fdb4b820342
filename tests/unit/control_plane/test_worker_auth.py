"""The worker-auth client (stargate/control_plane/auth.py, `WorkerAuthenticator`) against an
in-process grpcio gateway: the endpoint forms, the replica's bearer on every call, TLS with a
CA file, and the start-up check's errors."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from stargate.control_plane.auth import (
    AuthenticationFailed,
    GatewayEndpoint,
    WorkerAuthenticator,
    WorkerAuthUnavailable,
    parse_gateway_endpoint,
)
from stargate.control_plane.gateway_credentials import SecretsFileBearer
from stargate.secrets_file import SecretsFile
from tests.fakes.gateway import FakeGateway
from tests.fakes.logs import captured_logs

GATEWAY_BEARER = "gw-bearer-5e2a7c19d0"
WORKER_TOKEN = "worker-token-a81f"


def _gateway(bearer: str, *, tls: tuple[bytes, bytes] | None = None) -> FakeGateway:
    """A gateway that accepts the one replica bearer and knows one worker (a padded key)."""
    return FakeGateway({bearer}, {WORKER_TOKEN: " tenant-a "}, tls=tls)


@pytest.fixture
def gateway() -> Iterator[FakeGateway]:
    server = _gateway(GATEWAY_BEARER)
    yield server
    server.close()


def _bearer(tmp_path: Path, value: str = GATEWAY_BEARER) -> SecretsFileBearer:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"authToken": value}))
    return SecretsFileBearer(SecretsFile(path), ("authToken",))


@pytest.mark.parametrize(
    ("endpoint", "ca", "expected"),
    [
        ("gateway:9090", False, GatewayEndpoint("gateway:9090", tls=False)),
        (
            "http://api.nvcf.svc.cluster.local:9090",
            False,
            GatewayEndpoint("api.nvcf.svc.cluster.local:9090", tls=False),
        ),
        ("http://gateway:9090/", False, GatewayEndpoint("gateway:9090", tls=False)),
        ("https://gateway:8443", False, GatewayEndpoint("gateway:8443", tls=True)),
        ("HTTPS://gateway", False, GatewayEndpoint("gateway:443", tls=True)),
        ("http://gateway", False, GatewayEndpoint("gateway:80", tls=False)),
        ("gateway:9090", True, GatewayEndpoint("gateway:9090", tls=True)),
        ("http://gateway:9090", True, GatewayEndpoint("gateway:9090", tls=True)),
        ("[::1]:9090", False, GatewayEndpoint("[::1]:9090", tls=False)),
        ("https://[fd00::5]", False, GatewayEndpoint("[fd00::5]:443", tls=True)),
    ],
)
def test_endpoint_forms(endpoint: str, ca: bool, expected: GatewayEndpoint) -> None:
    assert parse_gateway_endpoint(endpoint, ca_file=Path("ca.pem") if ca else None) == expected


@pytest.mark.parametrize(
    "endpoint",
    ["grpc://gateway:1", "gateway", "http://gateway:9090/auth", "::1:9090", "https://:9", "g:x"],
)
def test_bad_endpoints_are_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="worker auth endpoint"):
        parse_gateway_endpoint(endpoint)


async def test_every_call_carries_the_replica_bearer(gateway: FakeGateway, tmp_path: Path) -> None:
    authenticator = WorkerAuthenticator(f"127.0.0.1:{gateway.port}", _bearer(tmp_path))
    try:
        await authenticator.check()
        assert await authenticator.authenticate(WORKER_TOKEN) == "tenant-a"
        with pytest.raises(AuthenticationFailed):
            await authenticator.authenticate("someone-else")
        assert gateway.seen == [f"Bearer {GATEWAY_BEARER}"] * 2
    finally:
        await authenticator.aclose()


async def test_without_credentials_the_gateway_refuses(gateway: FakeGateway) -> None:
    authenticator = WorkerAuthenticator(f"http://127.0.0.1:{gateway.port}")
    try:
        with pytest.raises(AuthenticationFailed):
            await authenticator.authenticate(WORKER_TOKEN)
        assert gateway.seen == [None]
    finally:
        await authenticator.aclose()


async def test_a_rotated_secrets_file_changes_the_next_bearer(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    authenticator = WorkerAuthenticator(f"127.0.0.1:{gateway.port}", _bearer(tmp_path))
    try:
        assert await authenticator.authenticate(WORKER_TOKEN) == "tenant-a"
        gateway.bearers = {"gw-bearer-rotated-77"}
        (tmp_path / "secrets.json").write_text(json.dumps({"authToken": "gw-bearer-rotated-77"}))
        assert await authenticator.authenticate(WORKER_TOKEN) == "tenant-a"
        assert gateway.seen[-1] == "Bearer gw-bearer-rotated-77"
    finally:
        await authenticator.aclose()


async def test_an_unusable_secrets_file_refuses_registrations(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    (tmp_path / "secrets.json").write_text("{}")
    authenticator = WorkerAuthenticator(
        f"127.0.0.1:{gateway.port}",
        SecretsFileBearer(SecretsFile(tmp_path / "secrets.json"), ("authToken",)),
    )
    try:
        with pytest.raises(WorkerAuthUnavailable) as caught:
            await authenticator.check()
        assert str(caught.value) == (
            f"cannot authenticate to worker auth endpoint 127.0.0.1:{gateway.port}: secrets "
            f"file {tmp_path / 'secrets.json'} has no key authToken"
        )
        with pytest.raises(AuthenticationFailed):
            await authenticator.authenticate(WORKER_TOKEN)
        assert gateway.seen == []  # never called without the replica's bearer
    finally:
        await authenticator.aclose()


async def test_a_gateway_that_is_down_fails_the_start_up_check() -> None:
    authenticator = WorkerAuthenticator("127.0.0.1:1")
    try:
        with pytest.raises(WorkerAuthUnavailable) as caught:
            await authenticator.check(connect_timeout=0.5)
        message = str(caught.value)
        assert message.startswith("failed to connect to worker auth endpoint 127.0.0.1:1: ")
        assert "Connection refused" in message
    finally:
        await authenticator.aclose()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


async def test_tls_with_a_ca_file(ca: trustme.CA, tmp_path: Path) -> None:
    cert = ca.issue_cert("127.0.0.1")
    gateway = _gateway(
        GATEWAY_BEARER,
        tls=(cert.private_key_pem.bytes(), b"".join(b.bytes() for b in cert.cert_chain_pems)),
    )
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    authenticator = WorkerAuthenticator(
        f"127.0.0.1:{gateway.port}", _bearer(tmp_path), ca_file=ca_file
    )
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    untrusting = WorkerAuthenticator(f"https://127.0.0.1:{gateway.port}", ca_file=other_ca)
    plaintext = WorkerAuthenticator(f"127.0.0.1:{gateway.port}", _bearer(tmp_path))
    try:
        assert authenticator.gateway.tls
        await authenticator.check()
        assert await authenticator.authenticate(WORKER_TOKEN) == "tenant-a"
        with pytest.raises(WorkerAuthUnavailable) as caught:
            await untrusting.check(connect_timeout=1)
        assert str(caught.value).startswith(
            f"failed to connect to worker auth endpoint https://127.0.0.1:{gateway.port}: "
        )
        assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)
        with pytest.raises(WorkerAuthUnavailable):
            await plaintext.check(connect_timeout=1)
    finally:
        for client in (authenticator, untrusting, plaintext):
            await client.aclose()
        gateway.close()


async def test_nothing_secret_is_logged_at_debug(gateway: FakeGateway, tmp_path: Path) -> None:
    with captured_logs("debug") as logs:
        logging.getLogger("stargate").debug("debug logging is on")
        authenticator = WorkerAuthenticator(f"127.0.0.1:{gateway.port}", _bearer(tmp_path))
        await authenticator.check()
        await authenticator.authenticate(WORKER_TOKEN)
        with pytest.raises(AuthenticationFailed):
            await authenticator.authenticate("stolen-token-3c9e")
        gateway.bearers = {"something-else"}  # the gateway now refuses the replica: a WARNING
        with pytest.raises(AuthenticationFailed):
            await authenticator.authenticate(WORKER_TOKEN)
        await authenticator.aclose()
    output = logs.getvalue()
    assert "debug logging is on" in output
    assert "failed a call: UNAUTHENTICATED" in output
    for secret in (GATEWAY_BEARER, WORKER_TOKEN, "stolen-token-3c9e"):
        assert secret not in output


async def test_https_trusts_the_system_store(
    ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert = ca.issue_cert("127.0.0.1")
    gateway = _gateway(
        GATEWAY_BEARER,
        tls=(cert.private_key_pem.bytes(), b"".join(b.bytes() for b in cert.cert_chain_pems)),
    )
    store = tmp_path / "system-store.pem"
    ca.cert_pem.write_to_path(str(store))
    monkeypatch.setenv("SSL_CERT_FILE", str(store))  # OpenSSL's way to point at the store
    authenticator = WorkerAuthenticator(f"https://127.0.0.1:{gateway.port}", _bearer(tmp_path))
    try:
        await authenticator.check()
        assert await authenticator.authenticate(WORKER_TOKEN) == "tenant-a"
    finally:
        await authenticator.aclose()
        gateway.close()
