"""Worker auth with the replica's own credentials, end to end (docs/worker-auth.md): a real
`stargate serve` at `--log-level debug` against a fake `llm_gateway.LlmGateway` that requires a
bearer from the replica, a Pylon-like registration through the real grpcio client, and the
routing key checked through `ListModels` and `/metrics`.

Covers the bearer from the secrets file (nested `--secrets-json-path`), minted by OAuth2 client
credentials at a fake token endpoint, a rotation of the secrets file (a Kubernetes symlink swap),
TLS to the gateway with `--worker-auth-ca-file`, and the start-up checks (gateway down, unusable
secrets file, token endpoint down: exit 1 with a message). No secret may appear in any log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import trustme

from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from tests.e2e.processes import Ports, StargateProcess, free_port, launch, stop, wait_until
from tests.fakes.gateway import FakeGateway, FakeTokenEndpoint
from tests.fakes.pylon import FakeBackend, PylonStream, registration

GATEWAY_BEARER = "gw-static-bearer-0b7d3e5f91"
ROTATED_BEARER = "gw-rotated-bearer-6a2c8f04d3"
CLIENT_ID = "stargate-replica"
CLIENT_SECRET = "oauth-client-secret-91e7/4b+2d"
WORKER_TOKEN = "pylon-worker-token-5f3a"
ROUTING_KEY = "tenant-blue"
SECRETS = (GATEWAY_BEARER, ROTATED_BEARER, CLIENT_SECRET, WORKER_TOKEN)


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    server = FakeBackend()
    yield server
    server.close()


def _mount(directory: Path, document: dict[str, object]) -> Path:
    """A Secret volume as the kubelet lays it out (`secrets.json` -> `..data/secrets.json`,
    `..data` -> a timestamped directory); returns the path the replica is given."""
    directory.mkdir()
    _rotate(directory, "v1", document)
    (directory / "secrets.json").symlink_to("..data/secrets.json")
    return directory / "secrets.json"


def _rotate(directory: Path, version: str, document: dict[str, object]) -> None:
    """The kubelet's rotation: a new timestamped directory, then an atomic swap of `..data`."""
    (directory / f"..{version}").mkdir()
    (directory / f"..{version}" / "secrets.json").write_text(json.dumps(document))
    (directory / "..data_tmp").symlink_to(f"..{version}")
    os.replace(directory / "..data_tmp", directory / "..data")


class Replica:
    """A `stargate serve` with worker auth, and clients for registration and model listing."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.ports = Ports.pick()
        self.handle: StargateProcess = launch(
            tmp_path / f"replica-{self.ports.grpc}.log",
            "serve",
            "--stargate-id=worker-auth-replica",
            *self.ports.args(),
            "--readiness-warmup-ms=0",
            "--disable-dns-discovery",
            "--shutdown-delay-ms=0",
            "--log-level=debug",
            *extra,
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.ports.grpc}")
        self.discovery_channel = grpc.insecure_channel(f"127.0.0.1:{self.ports.discovery}")
        self.discovery = pb_grpc.StargateModelDiscoveryStub(self.discovery_channel)  # type: ignore[no-untyped-call]

    def wait_serving(self) -> None:
        url = f"http://127.0.0.1:{self.ports.http}/healthz"
        wait_until(lambda: httpx.get(url, timeout=2).status_code == 200, 20, "the replica")

    def register(self, server_id: str, backend: FakeBackend, model: str) -> PylonStream:
        stream = PylonStream(self.channel, token=WORKER_TOKEN)
        stream.exchange(registration(server_id, backend.url, [model]))
        return stream

    def models(self, routing_key: str | None) -> list[str]:
        request = pb.ListModelsRequest()
        if routing_key is not None:
            request.routing_key = routing_key
        return list(self.discovery.ListModels(request, timeout=5).model_ids)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.ports.metrics}/metrics", timeout=5).text

    def exit_code(self, timeout: float = 30) -> int:
        return self.handle.process.wait(timeout=timeout)

    def stop(self) -> str:
        """SIGTERM, wait, and return the whole log (so what is logged on the way out is in it)."""
        self.channel.close()
        self.discovery_channel.close()
        if self.handle.process.poll() is None:
            self.handle.process.send_signal(signal.SIGTERM)
            try:
                self.handle.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stop(self.handle)
        return self.handle.log


def _assert_no_secret(log: str, *extra: str) -> None:
    assert " DEBUG " in log, "the replica did not log at debug level"
    for secret in (*SECRETS, *extra):
        assert secret not in log


def _assert_registered(replica: Replica, model: str) -> None:
    wait_until(lambda: replica.models(ROUTING_KEY) == [model], 10, f"{model} under the key")
    assert replica.models(None) == []  # routed under the gateway's key only
    assert (
        f'stargate_active_inference_servers{{model="{model}",routing_key="{ROUTING_KEY}"}} 1.0'
        in replica.metrics()
    )


def test_the_secrets_file_bearer_registers_a_pylon_and_follows_rotation(
    tmp_path: Path, backend: FakeBackend
) -> None:
    gateway = FakeGateway({GATEWAY_BEARER}, {WORKER_TOKEN: ROUTING_KEY})
    secrets = _mount(tmp_path / "vault", {"nvcf": {"apiToken": GATEWAY_BEARER}})
    replica = Replica(
        tmp_path,
        f"--worker-auth-endpoint=http://127.0.0.1:{gateway.port}",
        f"--secrets-path={secrets}",
        "--secrets-json-path=nvcf.apiToken",
    )
    streams: list[PylonStream] = []
    try:
        replica.wait_serving()
        streams.append(replica.register("wa-static", backend, "static-model"))
        _assert_registered(replica, "static-model")
        assert gateway.seen == [f"Bearer {GATEWAY_BEARER}"]
        # Kubernetes rotates the Secret; the gateway now accepts only the new bearer.
        gateway.bearers = {ROTATED_BEARER}
        _rotate(secrets.parent, "v2", {"nvcf": {"apiToken": ROTATED_BEARER}})
        streams.append(replica.register("wa-rotated", backend, "rotated-model"))
        wait_until(
            lambda: replica.models(ROUTING_KEY) == ["rotated-model", "static-model"],
            10,
            "the second registration",
        )
        assert gateway.seen[-1] == f"Bearer {ROTATED_BEARER}"
        # A rotation caught half-written keeps the last good bearer.
        (secrets.parent / "..v3").mkdir()
        (secrets.parent / "..v3" / "secrets.json").write_text('{"nvcf": {"apiTok')
        (secrets.parent / "..data_tmp").symlink_to("..v3")
        os.replace(secrets.parent / "..data_tmp", secrets.parent / "..data")
        streams.append(replica.register("wa-half", backend, "half-model"))
        assert gateway.seen[-1] == f"Bearer {ROTATED_BEARER}"
    finally:
        for stream in streams:
            stream.cancel()
        log = replica.stop()
        gateway.close()
    assert "keeping the last good value" in log
    _assert_no_secret(log)


def test_an_oauth2_minted_bearer_registers_a_pylon(tmp_path: Path, backend: FakeBackend) -> None:
    gateway = FakeGateway(set(), {WORKER_TOKEN: ROUTING_KEY})
    tokens = FakeTokenEndpoint(CLIENT_ID, CLIENT_SECRET, gateway=gateway)
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"clientId": CLIENT_ID, "clientSecret": CLIENT_SECRET}))
    replica = Replica(
        tmp_path,
        f"--worker-auth-endpoint=127.0.0.1:{gateway.port}",
        f"--secrets-path={secrets}",
        f"--oauth2-provider-host={tokens.url}",
    )
    stream: PylonStream | None = None
    try:
        replica.wait_serving()
        assert tokens.requests == 1  # minted by the start-up check
        assert tokens.forms == [
            {"grant_type": ["client_credentials"], "scope": ["llm:check_worker"]}
        ]
        stream = replica.register("wa-oauth2", backend, "oauth2-model")
        _assert_registered(replica, "oauth2-model")
        assert gateway.seen == [f"Bearer {tokens.tokens[0]}"]
        assert tokens.requests == 1  # cached: a one-hour token is not re-minted
    finally:
        if stream is not None:
            stream.cancel()
        log = replica.stop()
        gateway.close()
        tokens.close()
    _assert_no_secret(log, *tokens.tokens)


def test_tls_to_the_gateway_with_a_ca_file(tmp_path: Path, backend: FakeBackend) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    chain = b"".join(pem.bytes() for pem in cert.cert_chain_pems)
    gateway = FakeGateway(
        {GATEWAY_BEARER},
        {WORKER_TOKEN: ROUTING_KEY},
        tls=(cert.private_key_pem.bytes(), chain),
    )
    ca_file = tmp_path / "gateway-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"authToken": GATEWAY_BEARER}))
    replica = Replica(
        tmp_path,
        f"--worker-auth-endpoint=https://127.0.0.1:{gateway.port}",
        f"--worker-auth-ca-file={ca_file}",
        f"--secrets-path={secrets}",
    )
    stream: PylonStream | None = None
    try:
        replica.wait_serving()
        stream = replica.register("wa-tls", backend, "tls-model")
        _assert_registered(replica, "tls-model")
        assert gateway.seen == [f"Bearer {GATEWAY_BEARER}"]
    finally:
        if stream is not None:
            stream.cancel()
        log = replica.stop()
        gateway.close()
    assert "tls=True" in log
    _assert_no_secret(log)


def test_a_gateway_that_is_down_at_start_up_exits_1(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"authToken": GATEWAY_BEARER}))
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    replica = Replica(tmp_path, f"--worker-auth-endpoint={endpoint}", f"--secrets-path={secrets}")
    assert replica.exit_code() == 1
    log = replica.stop()
    assert f"failed to connect to worker auth endpoint {endpoint}: " in log
    assert "Connection refused" in log
    _assert_no_secret(log)


def test_a_gateway_with_an_unknown_ca_fails_the_start_up_check(tmp_path: Path) -> None:
    cert = trustme.CA().issue_cert("127.0.0.1")
    chain = b"".join(pem.bytes() for pem in cert.cert_chain_pems)
    gateway = FakeGateway(set(), {}, tls=(cert.private_key_pem.bytes(), chain))
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    endpoint = f"https://127.0.0.1:{gateway.port}"
    try:
        replica = Replica(
            tmp_path, f"--worker-auth-endpoint={endpoint}", f"--worker-auth-ca-file={other_ca}"
        )
        assert replica.exit_code() == 1
        log = replica.stop()
    finally:
        gateway.close()
    assert f"failed to connect to worker auth endpoint {endpoint}: " in log
    assert "CERTIFICATE_VERIFY_FAILED" in log


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ("{not json", "is not valid JSON"),
        (json.dumps({"nvcfApiToken": GATEWAY_BEARER}), "has no key authToken"),
        (json.dumps({"authToken": {"value": GATEWAY_BEARER}}), "authToken must be a string"),
    ],
)
def test_an_unusable_secrets_file_exits_1(tmp_path: Path, document: str, expected: str) -> None:
    gateway = FakeGateway({GATEWAY_BEARER}, {})
    secrets = tmp_path / "secrets.json"
    secrets.write_text(document)
    endpoint = f"127.0.0.1:{gateway.port}"
    try:
        replica = Replica(
            tmp_path, f"--worker-auth-endpoint={endpoint}", f"--secrets-path={secrets}"
        )
        assert replica.exit_code() == 1
        log = replica.stop()
    finally:
        gateway.close()
    assert f"cannot authenticate to worker auth endpoint {endpoint}: secrets file {secrets}" in log
    assert expected in log
    _assert_no_secret(log)


def test_a_token_endpoint_that_is_down_at_start_up_exits_1(tmp_path: Path) -> None:
    gateway = FakeGateway(set(), {})
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"clientId": CLIENT_ID, "clientSecret": CLIENT_SECRET}))
    provider = f"http://127.0.0.1:{free_port()}"
    try:
        replica = Replica(
            tmp_path,
            f"--worker-auth-endpoint=127.0.0.1:{gateway.port}",
            f"--secrets-path={secrets}",
            f"--oauth2-provider-host={provider}",
        )
        assert replica.exit_code() == 1
        log = replica.stop()
    finally:
        gateway.close()
    assert f"failed to obtain an OAuth2 token from {provider}/token: " in log
    assert "Connection refused" in log
    _assert_no_secret(log)
