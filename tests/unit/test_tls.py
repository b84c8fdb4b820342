"""The TLS identity (stargate/tls; docs/tls.md): validation of a pair, the reload decisions and
loop on a mock clock, the readiness exception for an expired certificate, and the serving
plumbing's handling of TLS streams. Certificates are made at test time with `trustme`."""

from __future__ import annotations

import datetime
import functools
import logging
import ssl
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client import CollectorRegistry
from trio.testing import MockClock

from stargate import serving
from stargate.asgi import answer_lifespan
from stargate.config import ListenAddress, TlsConfig, WarmupConfig
from stargate.hypercorn_patches import tcp as tcp_patches
from stargate.metrics import ReadinessMetrics, TlsMetrics
from stargate.readiness import Readiness
from stargate.tls import MATERIAL_TYPE, Identity, IdentityError, ServedIdentity, is_expired
from stargate.tls.identity import (
    digest_pair,
    load_identity,
    new_server_context,
    parse_identity,
    should_attempt,
)

BASE_UNIX = 2_000_000_000.0  # the fake wall clock's reading at trio time 0


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _pair(
    ca: trustme.CA, directory: Path, *, not_after: datetime.datetime | None = None
) -> tuple[Path, Path, trustme.LeafCert]:
    not_before = None if not_after is None else not_after - datetime.timedelta(days=1)
    leaf = ca.issue_cert("127.0.0.1", not_before=not_before, not_after=not_after)
    cert, key = directory / "tls.crt", directory / "tls.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    return cert, key, leaf


def _serial(leaf: trustme.LeafCert) -> int:
    return x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).serial_number


def _at(unix: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC)


# ---- validation ---------------------------------------------------------------------------------


def test_a_valid_pair_loads_with_its_not_after_and_serial(ca: trustme.CA, tmp_path: Path) -> None:
    not_after = _at(BASE_UNIX)
    cert, key, leaf = _pair(ca, tmp_path, not_after=not_after)
    identity = load_identity(cert, key)
    assert identity.not_after == BASE_UNIX
    assert identity.serial_number == _serial(leaf)
    assert identity.digest == digest_pair(cert.read_bytes(), key.read_bytes())
    assert "PRIVATE" not in repr(identity)  # a log line or traceback never shows the key


def test_a_key_of_another_certificate_is_refused_naming_the_key_file(
    ca: trustme.CA, tmp_path: Path
) -> None:
    cert, key, _ = _pair(ca, tmp_path)
    key.write_bytes(ca.issue_cert("127.0.0.1").private_key_pem.bytes())
    with pytest.raises(IdentityError) as raised:
        load_identity(cert, key)
    assert raised.value.path == key
    assert f"is not the private key of the certificate in {cert}" in str(raised.value)


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"not pem at all",
        b"-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE-----\n",
    ],
)
def test_garbage_in_the_certificate_file_is_refused_naming_it(
    ca: trustme.CA, tmp_path: Path, garbage: bytes
) -> None:
    cert, key, _ = _pair(ca, tmp_path)
    cert.write_bytes(garbage)
    with pytest.raises(IdentityError) as raised:
        load_identity(cert, key)
    assert raised.value.path == cert
    assert "is not a PEM certificate" in str(raised.value)


def test_garbage_or_an_encrypted_key_is_refused_naming_the_key_file(
    ca: trustme.CA, tmp_path: Path
) -> None:
    cert, key, leaf = _pair(ca, tmp_path)
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nZ2FyYmFnZQ==\n-----END PRIVATE KEY-----\n")
    with pytest.raises(IdentityError, match="is not a PEM private key") as raised:
        load_identity(cert, key)
    assert raised.value.path == key
    private = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), None)
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(IdentityError, match="encrypted private key"):
        load_identity(cert, key)


def test_an_unreadable_file_is_refused_naming_it(ca: trustme.CA, tmp_path: Path) -> None:
    _, key, _ = _pair(ca, tmp_path)
    missing = tmp_path / "missing.crt"
    with pytest.raises(IdentityError, match="cannot be read") as raised:
        load_identity(missing, key)
    assert raised.value.path == missing


def test_an_expired_certificate_is_a_valid_pair_and_expires_strictly_after_not_after(
    ca: trustme.CA, tmp_path: Path
) -> None:
    cert, key, _ = _pair(ca, tmp_path, not_after=_at(BASE_UNIX))
    identity = parse_identity(cert.read_bytes(), key.read_bytes(), cert, key)
    assert not is_expired(identity.not_after, BASE_UNIX - 1)
    assert not is_expired(identity.not_after, BASE_UNIX)  # notAfter is its last valid second
    assert is_expired(identity.not_after, BASE_UNIX + 0.001)


def test_the_server_context_offers_h2_then_http1_on_tls_1_2_or_later() -> None:
    context = new_server_context()
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_COMPRESSION
    assert context.verify_mode == ssl.CERT_NONE  # no client certificates


def test_reload_decisions() -> None:
    served, bad, new = "served", "bad", "new"
    assert not should_attempt(served, served, None)  # unchanged
    assert should_attempt(new, served, None)  # changed
    assert should_attempt(bad, served, None)
    assert not should_attempt(bad, served, bad)  # already rejected: reported once
    assert should_attempt(new, served, bad)  # changed again after a rejection


# ---- start-up -----------------------------------------------------------------------------------


def test_start_up_errors_name_the_flag_and_the_file(ca: trustme.CA, tmp_path: Path) -> None:
    cert, key, _ = _pair(ca, tmp_path)
    cert.write_bytes(b"garbage")
    with pytest.raises(
        serving.StartupError, match=rf"--tls-cert-path {cert}: is not a PEM certificate"
    ):
        ServedIdentity.load(TlsConfig(cert, key))
    with pytest.raises(
        serving.StartupError, match=rf"--tls-key-path {tmp_path / 'nope'}: cannot be read"
    ):
        ServedIdentity.load(TlsConfig(_pair(ca, tmp_path)[0], tmp_path / "nope"))


def test_an_expired_certificate_is_served_at_start_up_with_its_metrics(
    ca: trustme.CA, tmp_path: Path
) -> None:
    cert, key, _ = _pair(ca, tmp_path, not_after=_at(BASE_UNIX))
    registry = CollectorRegistry()
    served: list[Identity] = []
    ServedIdentity.load(
        TlsConfig(cert, key),
        metrics=TlsMetrics.create(registry, "stargate_"),
        on_served=served.append,
        wall_clock=lambda: BASE_UNIX + 10,
    )
    assert [identity.not_after for identity in served] == [BASE_UNIX]
    assert _sample(registry, "tls_certificate_expiry_seconds") == BASE_UNIX
    assert _sample(registry, "tls_reloads_total", result="success") == 0
    assert _sample(registry, "tls_reloads_total", result="rejected") == 0


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(f"stargate_{name}", {"material_type": MATERIAL_TYPE, **labels})


# ---- the reload loop, on a mock clock -----------------------------------------------------------


async def test_the_reload_loop_installs_valid_pairs_and_keeps_the_last_good_one(
    autojump_clock: MockClock, ca: trustme.CA, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "stargate.tls")
    cert, key, first = _pair(ca, tmp_path, not_after=_at(BASE_UNIX + 3600))
    registry = CollectorRegistry()
    served: list[tuple[float, int]] = []
    identity = ServedIdentity.load(
        TlsConfig(cert, key, reload_interval_ms=30_000),
        metrics=TlsMetrics.create(registry, "stargate_"),
        on_served=lambda served_identity: served.append(
            (trio.current_time(), served_identity.serial_number)
        ),
        wall_clock=lambda: BASE_UNIX + trio.current_time(),
    )
    context = identity.context

    async with trio.open_nursery() as nursery:
        nursery.start_soon(identity.run)
        await trio.sleep(65)  # two polls, nothing changed
        assert served == [(0.0, _serial(first))]

        _, _, second = _pair(ca, tmp_path, not_after=_at(BASE_UNIX + 7200))
        await trio.sleep(30)  # the poll at t=90 reloads it
        assert served[-1][1] == _serial(second)
        assert served[-1][0] == pytest.approx(90.0)
        assert identity.context is context  # the live context, shared by the listeners
        assert _sample(registry, "tls_reloads_total", result="success") == 1
        assert _sample(registry, "tls_certificate_expiry_seconds") == BASE_UNIX + 7200

        cert.write_bytes(b"garbage")
        await trio.sleep(30 * 3)  # three polls see the same bad content: rejected once
        assert _sample(registry, "tls_reloads_total", result="rejected") == 1
        assert identity.identity.serial_number == _serial(second)
        assert _sample(registry, "tls_certificate_expiry_seconds") == BASE_UNIX + 7200

        _pair(ca, tmp_path, not_after=_at(BASE_UNIX - 1))  # a valid pair, already expired
        await trio.sleep(30)
        assert _sample(registry, "tls_reloads_total", result="rejected") == 2
        assert identity.identity.serial_number == _serial(second)

        _, _, third = _pair(ca, tmp_path, not_after=_at(BASE_UNIX + 9000))
        await trio.sleep(30)
        assert identity.identity.serial_number == _serial(third)
        assert _sample(registry, "tls_reloads_total", result="success") == 2
        nursery.cancel_scope.cancel()

    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert "--tls-cert-path" in errors[0].getMessage()
    assert "is not a PEM certificate" in errors[0].getMessage()
    assert "expired at" in errors[1].getMessage()
    assert all("PRIVATE KEY" not in r.getMessage() for r in caplog.records)
    assert any(
        r.levelno == logging.INFO and "reloaded TLS identity" in r.getMessage()
        for r in caplog.records
    )


# ---- readiness: the one exception to latched readiness ------------------------------------------


async def test_an_expired_certificate_makes_a_promoted_replica_unready_until_a_valid_one(
    autojump_clock: MockClock,
) -> None:
    registry = CollectorRegistry()
    readiness = Readiness(
        WarmupConfig(warmup_ms=0),
        ReadinessMetrics.create(registry, "stargate_"),
        wall_clock=lambda: BASE_UNIX + trio.current_time(),
    )
    assert readiness.ready and readiness.accepting_work
    readiness.serve_certificate(BASE_UNIX + 100)
    changes: list[tuple[float, bool, bool]] = []

    async def follow() -> None:
        while True:
            changed = readiness.next_change()
            await changed.wait()
            changes.append((trio.current_time(), readiness.ready, readiness.accepting_work))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(readiness.watch_certificate_expiry)
        nursery.start_soon(follow)
        await trio.sleep(99)
        assert readiness.ready and readiness.state().reason is None
        await trio.sleep(2)
        # Expired at notAfter + a millisecond, announced to `next_change` waiters (gRPC health).
        assert changes == [(pytest.approx(100.001), False, False)]
        state = readiness.state()
        assert state.phase == "certificate_expired" and not state.ready
        assert state.reason is not None and "2033-05-18T03:35:00Z" in state.reason
        assert state.promotion is not None  # still promoted: only the certificate is at fault
        assert registry.get_sample_value("stargate_readiness_ready") == 0

        readiness.serve_certificate(BASE_UNIX + 1000)  # a reload with a later certificate
        await trio.sleep(1)
        assert readiness.ready and readiness.accepting_work
        assert registry.get_sample_value("stargate_readiness_ready") == 1
        assert changes[-1][1:] == (True, True)

        readiness.lifecycle.begin_draining()  # draining still wins over everything
        assert readiness.state().phase == "draining" and not readiness.accepting_work
        nursery.cancel_scope.cancel()


def test_without_tls_the_certificate_never_expires() -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=0), wall_clock=lambda: float("inf"))
    assert readiness.ready and not readiness.certificate_expired


# ---- serving -------------------------------------------------------------------------------------


async def test_a_tls_connection_still_names_its_peer(ca: trustme.CA, tmp_path: Path) -> None:
    """The contained-failure log names the peer of a TLS connection too (`tcp_patches.peer`
    looks through `trio.SSLStream` at the socket it wraps)."""
    cert, key, _ = _pair(ca, tmp_path)
    identity = ServedIdentity.load(TlsConfig(cert, key))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    tls = trio.SSLStream(server, identity.context, server_side=True)
    host, client_port = client.socket.getsockname()[:2]
    assert tcp_patches.peer(tls) == f"{host}:{client_port}"
    for resource in (client, server, listeners[0]):
        await resource.aclose()


async def _app(scope: dict[str, object], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_a_listener_serves_tls_and_closes_a_stalled_handshake(
    ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve_asgi(..., ssl_context=...)` serves through Hypercorn's TLS path with our context,
    and a client that connects but never completes its handshake is closed after
    `TLS_HANDSHAKE_TIMEOUT_SECONDS` instead of holding the connection (Hypercorn's own default
    is 60 s)."""
    monkeypatch.setattr(serving, "TLS_HANDSHAKE_TIMEOUT_SECONDS", 0.3)
    cert, key, _ = _pair(ca, tmp_path)
    identity = ServedIdentity.load(TlsConfig(cert, key))
    sock = serving.bind_listener("test", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(
                serving.serve_asgi,
                _app,
                sock,
                serving.hypercorn_config(1.0),
                stop.wait,
                ssl_context=identity.context,
            )
        )
        client_context = ssl.create_default_context()
        ca.configure_trust(client_context)
        stream = trio.SSLStream(
            await trio.open_tcp_stream("127.0.0.1", port),
            client_context,
            server_hostname="127.0.0.1",
            https_compatible=True,  # the server closes without close_notify, as HTTPS may
        )
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\nok\r\n" in answer
        assert stream.selected_alpn_protocol() is None  # no ALPN offered: HTTP/1.1

        stalled = await trio.open_tcp_stream("127.0.0.1", port)
        started = trio.current_time()
        with trio.fail_after(5):
            assert await stalled.receive_some() == b""  # closed by the server
        assert trio.current_time() - started >= 0.3
        await stalled.aclose()
        stop.set()
