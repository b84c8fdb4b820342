"""TLS on a real `stargate serve` process (docs/tls.md): certificates made at test time with
`trustme`, clients that trust only the test CA, the real clock.

What is checked: HTTP/1.1 and HTTP/2 (ALPN) on the HTTP listener, gRPC over TLS on both gRPC
listeners, a `stargate pylon --stargate-ca-file` registering over TLS and a request proxied to the
engine it registered; the reload (new connections get the new certificate, an established one
keeps working), the rejection of invalid material (the old identity stays), and readiness after
the served certificate expires. The metrics listener stays plain HTTP throughout.
"""

from __future__ import annotations

import datetime
import http.client
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import trustme
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from tests.e2e.processes import (
    MockBackendProcess,
    Ports,
    StargateProcess,
    launch_mock_backend,
    wait_until,
)

RELOAD_MS = 200
CHAT = {"model": "tls-model", "messages": [{"role": "user", "content": "hi"}]}
HEADERS = {"x-request-id": "tls-1", "x-input-tokens": "10", "x-model": "tls-model"}


@dataclass
class Pki:
    """A test CA and the replica's certificate and key files."""

    ca: trustme.CA
    directory: Path

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def cert_file(self) -> Path:
        return self.directory / "tls.crt"

    @property
    def key_file(self) -> Path:
        return self.directory / "tls.key"

    def issue(self, *, not_after: datetime.datetime | None = None) -> trustme.LeafCert:
        """A new pair for 127.0.0.1 and localhost (a new serial each time), written in place the
        way a Secret update lands: each file replaced whole."""
        not_before = None if not_after is None else not_after - datetime.timedelta(days=1)
        leaf = self.ca.issue_cert(
            "127.0.0.1", "localhost", not_before=not_before, not_after=not_after
        )
        _replace(self.cert_file, b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        _replace(self.key_file, leaf.private_key_pem.bytes())
        return leaf

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


def _replace(path: Path, data: bytes) -> None:
    scratch = path.with_suffix(".new")
    scratch.write_bytes(data)
    os.replace(scratch, path)


def _serial(leaf: trustme.LeafCert) -> int:
    return x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).serial_number


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = trustme.CA()
    pki = Pki(ca, tmp_path)
    ca.cert_pem.write_to_path(str(pki.ca_file))
    return pki


@dataclass
class TlsReplica:
    process: StargateProcess
    ports: Ports
    pki: Pki

    @property
    def base(self) -> str:
        return f"https://127.0.0.1:{self.ports.http}"

    def client(self, *, http2: bool = False) -> httpx.Client:
        return httpx.Client(
            verify=self.pki.client_context(), http2=http2, http1=not http2, timeout=5
        )

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.ports.metrics}/metrics", timeout=5).text

    def metric(self, name: str) -> float | None:
        match = re.search(rf"^{re.escape(name)} (\S+)$", self.metrics(), re.MULTILINE)
        return None if match is None else float(match.group(1))

    def grpc_channel(self, port: int) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials(self.pki.ca_file.read_bytes())
        return grpc.secure_channel(f"127.0.0.1:{port}", credentials)

    def served_serial(self, *, verify: bool = True) -> int:
        """The serial of the certificate a NEW connection to the HTTP listener gets."""
        context = self.pki.client_context()
        if not verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        with (
            socket.create_connection(("127.0.0.1", self.ports.http), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            der = tls.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number


ReplicaStarter = Callable[..., TlsReplica]


@pytest.fixture
def tls_replica(start_stargate: Callable[..., StargateProcess], pki: Pki) -> ReplicaStarter:
    def start(*extra: str, wait_ready: bool = True) -> TlsReplica:
        ports = Ports.pick()
        process = start_stargate(
            "serve",
            "--stargate-id=tls-replica",
            *ports.args(),
            "--readiness-warmup-ms=0",
            "--disable-dns-discovery",
            "--shutdown-delay-ms=0",
            f"--tls-cert-path={pki.cert_file}",
            f"--tls-key-path={pki.key_file}",
            f"--tls-reload-interval-ms={RELOAD_MS}",
            *extra,
        )
        replica = TlsReplica(process, ports, pki)
        wait_until(
            lambda: "listening: http=" in process.log or process.process.poll() is not None,
            15,
            "the replica to listen",
        )
        assert process.process.poll() is None, process.log
        return replica

    return start


@pytest.fixture
def mock_backend() -> Iterator[MockBackendProcess]:
    backend = launch_mock_backend("--model", "tls-model")
    yield backend
    backend.stop()


def _pylon(log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "stargate", "pylon", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def test_http1_http2_grpc_and_a_pylon_over_tls(
    tls_replica: ReplicaStarter, pki: Pki, mock_backend: MockBackendProcess, tmp_path: Path
) -> None:
    pki.issue()
    replica = tls_replica()
    for http2 in (False, True):
        with replica.client(http2=http2) as client:
            response = client.get(f"{replica.base}/healthz")
            assert response.status_code == 200
            assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            ready = client.get(f"{replica.base}/readyz")
            assert ready.status_code == 200 and ready.json()["reason"] is None

    # The HTTP listener speaks only TLS now; the metrics listener stays plain HTTP.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{replica.ports.http}/healthz", timeout=2)
    assert 'stargate_tls_reloads_total{material_type="server_identity",result="success"} 0.0' in (
        replica.metrics()
    )

    # gRPC over TLS (HTTP/2 by ALPN) on both gRPC listeners.
    for port in (replica.ports.grpc, replica.ports.discovery):
        with replica.grpc_channel(port) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING

    # A Pylon that trusts the test CA registers the engine over TLS (seed and discovered
    # replica alike), and a request is proxied to the engine over HTTPS, on both HTTP versions.
    pylon = _pylon(
        tmp_path / "pylon.log",
        f"--upstream={mock_backend.url}",
        f"--stargate=127.0.0.1:{replica.ports.grpc}",
        f"--stargate-ca-file={pki.ca_file}",
        "--min-update-interval-ms=200",
    )
    try:
        with replica.grpc_channel(replica.ports.discovery) as channel:
            discovery = pb_grpc.StargateModelDiscoveryStub(channel)  # type: ignore[no-untyped-call]
            wait_until(
                lambda: (
                    list(
                        discovery.ListModels(
                            pb.ListModelsRequest(model_ids=["tls-model"]), timeout=5
                        ).model_ids
                    )
                    == ["tls-model"]
                ),
                15,
                "the Pylon's registration over TLS",
            )
        for http2 in (False, True):
            with replica.client(http2=http2) as client:
                response = client.post(
                    f"{replica.base}/v1/chat/completions", headers=HEADERS, json=CHAT
                )
                assert response.status_code == 200, response.text
                assert response.json()["object"] == "chat.completion"
    finally:
        pylon.send_signal(signal.SIGTERM)
        assert pylon.wait(timeout=10) == 0
    log = (tmp_path / "pylon.log").read_text()
    assert "registered with replica tls-replica" in log
    assert "Traceback" not in log
    assert "Traceback" not in replica.process.log


def test_reload_swaps_the_certificate_for_new_connections_and_keeps_established_ones(
    tls_replica: ReplicaStarter, pki: Pki
) -> None:
    first = _serial(pki.issue())
    replica = tls_replica()
    assert replica.served_serial() == first
    key_body = pki.key_file.read_text().splitlines()[1]

    # An established HTTP/1.1 keep-alive connection and an established gRPC (HTTP/2) channel.
    established = http.client.HTTPSConnection(
        "127.0.0.1", replica.ports.http, context=pki.client_context(), timeout=5
    )
    established.request("GET", "/healthz")
    assert established.getresponse().read() == b""
    channel = replica.grpc_channel(replica.ports.grpc)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1

    second = _serial(pki.issue())
    assert second != first
    wait_until(
        lambda: (
            replica.metric(
                'stargate_tls_reloads_total{material_type="server_identity",result="success"}'
            )
            == 1.0
        ),
        5,
        "the reload",
    )
    assert replica.served_serial() == second  # a new connection sees the new certificate
    established.request("GET", "/healthz")  # the established one still works, on the old one
    assert established.getresponse().status == 200
    assert established.sock is not None
    old_der = established.sock.getpeercert(binary_form=True)
    assert old_der is not None
    assert x509.load_der_x509_certificate(old_der).serial_number == first
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    expiry = replica.metric(
        'stargate_tls_certificate_expiry_seconds{material_type="server_identity"}'
    )
    print(
        f"\nreload: serial before {first:#x}, after {second:#x}; new connection got "
        f"{replica.served_serial():#x}; established connection still on {first:#x} and "
        f"answering; expiry gauge {expiry}"
    )

    # Invalid material: rejected with an ERROR, once; the last good identity stays served.
    _replace(pki.cert_file, b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    wait_until(
        lambda: (
            replica.metric(
                'stargate_tls_reloads_total{material_type="server_identity",result="rejected"}'
            )
            == 1.0
        ),
        5,
        "the rejection",
    )
    assert replica.served_serial() == second
    with replica.client(http2=True) as client:
        assert client.get(f"{replica.base}/readyz").status_code == 200
    rejection = next(line for line in replica.process.log.splitlines() if "rejected" in line)
    assert " ERROR " in rejection and str(pki.cert_file) in rejection
    assert f"still serving serial {second:#x}" in rejection
    log = replica.process.log
    assert key_body not in log and "PRIVATE KEY" not in log
    assert "Traceback" not in log
    print(f"invalid material: {rejection.split(' ERROR ', 1)[1]}")
    established.close()
    channel.close()


def test_an_expired_certificate_makes_readyz_503_until_a_valid_one_is_reloaded(
    tls_replica: ReplicaStarter, pki: Pki
) -> None:
    not_after = datetime.datetime.now(datetime.UTC).replace(microsecond=0) - datetime.timedelta(
        hours=1
    )
    pki.issue(not_after=not_after)
    replica = tls_replica()
    unverified = httpx.Client(verify=False, timeout=5)  # as the kubelet probes: no verification
    with unverified:
        ready = unverified.get(f"{replica.base}/readyz")
        assert ready.status_code == 503
        body = ready.json()
        assert body["phase"] == "certificate_expired" and body["ready"] is False
        assert (
            "expired" in body["reason"]
            and not_after.strftime("%Y-%m-%dT%H:%M:%S") in (body["reason"])
        )
        assert body["promotion_reason"] == "disabled"  # promoted, and still not ready
        assert unverified.get(f"{replica.base}/healthz").status_code == 200
        assert replica.metric(
            'stargate_tls_certificate_expiry_seconds{material_type="server_identity"}'
        ) == pytest.approx(not_after.timestamp())
        assert replica.metric("stargate_readiness_ready") == 0.0

        later = _serial(pki.issue())
        wait_until(
            lambda: unverified.get(f"{replica.base}/readyz").status_code == 200,
            5,
            "readiness after a reload with a valid certificate",
        )
        assert replica.served_serial() == later
        assert replica.metric("stargate_readiness_ready") == 1.0
    assert "the served TLS certificate is valid again" in replica.process.log


def test_an_invalid_pair_at_start_up_exits_1_naming_the_flag_and_the_file(
    start_stargate: Callable[..., StargateProcess], pki: Pki
) -> None:
    pki.issue()
    other_key = pki.ca.issue_cert("127.0.0.1").private_key_pem.bytes()
    _replace(pki.key_file, other_key)
    replica = start_stargate(
        "serve",
        *Ports.pick().args(),
        f"--tls-cert-path={pki.cert_file}",
        f"--tls-key-path={pki.key_file}",
    )
    assert replica.process.wait(timeout=15) == 1
    assert f"--tls-key-path {pki.key_file}: is not the private key of the certificate" in (
        replica.log
    )
