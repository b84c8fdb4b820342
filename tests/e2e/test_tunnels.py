"""QUIC tunnels end to end (docs/tunnels.md): real `stargate serve`, `stargate pylon` and
`stargate mock-backend` processes, real clients (the `openai` package, httpx), in the four
combinations of direct/reverse and raw-quic/http3; and, for what only a peer can provoke (every
reverse-handshake refusal, garbage on a stream), an in-process QUIC client built from
`stargate/tunnel/` driving the real processes' UDP listeners.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from stargate.tunnel.codec import encode_body, encode_headers
from stargate.tunnel.handshake import send_handshake
from stargate.tunnel.quic import connect
from stargate.tunnel.quic.tls import client_configuration, generate_self_signed
from stargate.tunnel.stream import StreamReset
from tests.e2e.fleet import (
    MODEL,
    Fleet,
    Pylon,
    chat,
    routing_view,
    wait_routable,
)
from tests.e2e.processes import Replica, wait_until
from tests.fakes.gateway import FakeGateway

COMBINATIONS = [
    pytest.param("direct", "raw-quic", id="direct-raw-quic"),
    pytest.param("reverse", "raw-quic", id="reverse-raw-quic"),
    pytest.param("direct", "http3", id="direct-http3"),
    pytest.param("reverse", "http3", id="reverse-http3"),
]


def replica_flags(connectivity: str, protocol: str, *extra: str) -> tuple[str, ...]:
    flags = ["--quic-insecure", f"--tunnel-protocol={protocol}"]
    if connectivity == "reverse":
        # Port 0: the bound UDP port goes out in every ack, and the Pylons dial it.
        flags += ["--backend-connectivity=reverse", "--reverse-tunnel-listen-addr=127.0.0.1:0"]
    return (*flags, *extra)


def pylon_flags(connectivity: str, protocol: str, *extra: str) -> tuple[str, ...]:
    flags = [f"--backend-connectivity={connectivity}", f"--tunnel-protocol={protocol}"]
    if connectivity == "reverse":
        flags.append("--quic-insecure")
    return (*flags, "--canary-interval-ms", "0", *extra)


def tunneled(
    fleet: Fleet, connectivity: str, protocol: str, *engine_flags: str
) -> tuple[Replica, Pylon, Any]:
    replica = fleet.replica(*replica_flags(connectivity, protocol))
    engine = fleet.engine(*engine_flags)
    pylon = fleet.pylon(engine.url, replica, *pylon_flags(connectivity, protocol))
    wait_routable(replica, 1)
    return replica, pylon, engine


def sdk(replica: Replica) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{replica.ports.http}/v1", api_key="unused", max_retries=0
    )


@pytest.mark.parametrize(("connectivity", "protocol"), COMBINATIONS)
def test_requests_through_the_tunnel(fleet: Fleet, connectivity: str, protocol: str) -> None:
    """Streams arrive event by event, a plain answer whole, a 3 MiB upload byte for byte, the
    engine's error statuses as they were, and the Pylon measures it all as over HTTP."""
    replica, pylon, engine = tunneled(
        fleet, connectivity, protocol, "--tokens", "8", "--inter-token-ms", "60"
    )
    client = sdk(replica)
    # A stream: the SDK sees each event as the engine produced it, 60 ms apart.
    arrivals: list[float] = []
    text = []
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], stream=True
    )
    for chunk in stream:
        arrivals.append(time.monotonic())
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    assert len(text) == 8
    assert arrivals[-1] - arrivals[0] > 0.3  # not buffered into one burst at the end
    # A plain answer.
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}]
    )
    assert answer.choices[0].message.content
    # A 3 MiB upload reaches the engine whole.
    big = "x" * (3 * 1024 * 1024)
    response = replica.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": big}]},
        timeout=30,
    )
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] >= len(big) // 8
    # The engine's error statuses pass through with their bodies.
    engine.control(fail_next={"count": 1, "status": 400, "body": '{"error":"bad prompt"}'})
    refused = replica.http.post("/v1/chat/completions", json=chat())
    assert refused.status_code == 400
    assert refused.json() == {"error": "bad prompt"}
    # The Pylon measured the requests (docs/pylon-data-path.md): the replica's balancers see it.
    wait_until(
        lambda: routing_view(replica)[pylon.id]["output_tps"] > 0, 5, "measured output throughput"
    )
    transport = "url=quic://" if connectivity == "direct" else "reverse tunnel connected"
    assert transport in replica.process.log


@pytest.mark.parametrize(("connectivity", "protocol"), COMBINATIONS[:2])
def test_a_client_that_leaves_cancels_the_engine_request(
    fleet: Fleet, connectivity: str, protocol: str
) -> None:
    replica, _, engine = tunneled(
        fleet, connectivity, protocol, "--tokens", "200", "--inter-token-ms", "50"
    )
    with (
        httpx.Client(base_url=f"http://127.0.0.1:{replica.ports.http}", timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json=chat()) as response,
    ):
        assert response.status_code == 200
        next(response.iter_raw())  # the first event is through (the engine's role event,
        # which it may send before counting the request as in flight)
        wait_until(
            lambda: httpx.get(engine.url + "/test-control").json()["in_flight"] == 1,
            3,
            "the engine request in flight",
        )
    # The client closed its connection: the replica resets the tunnel stream, the Pylon cancels
    # its engine request.
    wait_until(
        lambda: httpx.get(engine.url + "/test-control").json()["in_flight"] == 0,
        3,
        "the engine request cancelled",
    )


@pytest.mark.parametrize(("connectivity", "protocol"), COMBINATIONS[:2])
def test_a_pylon_lost_and_back(fleet: Fleet, connectivity: str, protocol: str) -> None:
    """Streams on one Pylon finish while another Pylon dies; the dead one's models stop being
    routed at once, and a new Pylon for its engine is routable within a second of the replica
    accepting its tunnel."""
    replica = fleet.replica(*replica_flags(connectivity, protocol))
    engines = [fleet.engine("--tokens", "30", "--inter-token-ms", "50") for _ in range(2)]
    keep = fleet.pylon(engines[0].url, replica, *pylon_flags(connectivity, protocol))
    lose = fleet.pylon(engines[1].url, replica, *pylon_flags(connectivity, protocol))
    wait_routable(replica, 2)
    results: list[tuple[str, int, str]] = []

    def one() -> None:
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{replica.ports.http}/v1/chat/completions",
            json=chat(),
            headers={"x-routing-method": "round-robin"},
            timeout=20,
        ) as response:
            server = response.headers.get("x-inference-server-id", "")
            try:
                body = "".join(response.iter_text())
            except httpx.HTTPError:
                body = "broken"
            results.append((server, response.status_code, body))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: (
            sum(httpx.get(engine.url + "/test-control").json()["in_flight"] for engine in engines)
            == 4
        ),
        5,
        "four streams",
    )
    lose.process.process.send_signal(signal.SIGKILL)
    for thread in threads:
        thread.join()
    kept = [r for r in results if r[0] == keep.id]
    assert kept and all(status == 200 and "[DONE]" in body for _, status, body in kept)
    wait_until(lambda: list(routing_view(replica)) == [keep.id], 5, "the lost Pylon unrouted")
    # A new Pylon for the lost engine: routable within 1 s of the replica accepting its tunnel
    # (reverse: the handshake; direct: the registration, which the replica dials at once).
    back = fleet.pylon(engines[1].url, replica, *pylon_flags(connectivity, protocol))
    accepted = (
        f"reverse tunnel connected: inference_server_id={back.id}"
        if connectivity == "reverse"
        else f"registration admitted: inference_server_id={back.id}"
    )
    wait_until(lambda: back.id in routing_view(replica), 15, "the new Pylon routable")
    routable = time.time()
    assert routable - _logged_at(replica.process.log, accepted) < 1.0


def _logged_at(log: str, text: str) -> float:
    """The wall-clock time of the log line containing `text` (the text formatter's asctime)."""
    line = next(line for line in log.splitlines() if text in line)
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def _nack_replica(fleet: Fleet, tmp_path: Path, gateway: FakeGateway) -> Replica:
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"authToken": "replica-bearer"}))
    return fleet.replica(
        *replica_flags("reverse", "raw-quic"),
        f"--worker-auth-endpoint=127.0.0.1:{gateway.port}",
        f"--secrets-path={secrets}",
    )


def _reverse_port(replica: Replica) -> int:
    match = re.search(r"reverse tunnel listener on UDP port (\d+)", replica.process.log)
    assert match, replica.process.log
    return int(match.group(1))


async def _handshake(port: int, server_id: str, token: str | None) -> tuple[bool, str]:
    async with trio.open_nursery() as nursery:
        configuration = client_configuration(
            insecure=True, trust_pem=None, server_name="stargate", alpn=None
        )
        connection = await connect(nursery, "127.0.0.1", port, configuration, timeout=5)
        try:
            stream = await connection.open_stream()
            return await send_handshake(stream, server_id, token)
        finally:
            connection.close(0, "test done")
            nursery.cancel_scope.cancel()


def test_every_handshake_refusal_in_order(fleet: Fleet, tmp_path: Path) -> None:
    gateway = FakeGateway({"replica-bearer"}, {"token-a": "key-a", "token-b": "key-b"})
    try:
        replica = _nack_replica(fleet, tmp_path, gateway)
        token = tmp_path / "token-a"
        token.write_text("token-a")
        engine = fleet.engine()
        reverse = fleet.pylon(
            engine.url, replica, *pylon_flags("reverse", "raw-quic", "--token-file", str(token))
        )
        direct = fleet.pylon(
            fleet.engine().url,
            replica,
            *pylon_flags("direct", "raw-quic", "--token-file", str(token)),
        )
        wait_routable(replica, 2)
        port = _reverse_port(replica)
        cases = [
            ("", "token-a", "empty inference_server_id"),
            (reverse.id, "no-such-token", "authentication failed"),
            ("nobody", "token-a", "unauthorized inference_server_id"),
            (direct.id, "token-a", "unauthorized inference_server_id"),
            (reverse.id, "token-b", "routing key mismatch"),
            (reverse.id, "token-a", "duplicate connection"),
            # The checks run in order: an empty id is refused before its token is looked at.
            ("", "no-such-token", "empty inference_server_id"),
        ]
        for server_id, token_text, reason in cases:
            assert trio.run(_handshake, port, server_id, token_text) == (False, reason)
        # None of it disturbed the Pylon's tunnel.
        assert routing_view(replica).keys() == {reverse.id, direct.id}
        assert "reverse tunnel handshake rejected" in replica.process.log
    finally:
        gateway.close()


async def _garbage_then_a_request(port: int) -> tuple[str, int]:
    async with trio.open_nursery() as nursery:
        configuration = client_configuration(
            insecure=True, trust_pem=None, server_name="stargate", alpn=None
        )
        connection = await connect(nursery, "127.0.0.1", port, configuration, timeout=5)
        # Not a Cap'n Proto message: that stream is reset...
        bad = await connection.open_stream()
        await bad.send(b"\xff" * 64, end=True)
        outcome = "answered"
        try:
            while await bad.receive():
                pass
        except StreamReset as reset:
            outcome = f"reset {reset.code}"
        # ...a head without x-method too...
        headless = await connection.open_stream()
        await headless.send(encode_headers([(b"x-path", b"/health")]), end=True)
        try:
            while await headless.receive():
                pass
        except StreamReset:
            pass
        # ...and the connection still serves the next request.
        good = await connection.open_stream()
        await good.send(encode_headers([(b"x-method", b"GET"), (b"x-path", b"/health")]), end=False)
        await good.send(encode_body(b""), end=True)
        data = bytearray()
        while chunk := await good.receive():
            data += chunk
        connection.close(0, "test done")
        nursery.cancel_scope.cancel()
    return outcome, len(data)


def test_bad_input_on_a_stream_resets_that_stream_only(fleet: Fleet) -> None:
    replica, pylon, _ = tunneled(fleet, "direct", "raw-quic")
    registered = re.search(r"url=quic://127\.0\.0\.1:(\d+)", replica.process.log)
    assert registered is not None
    port = int(registered.group(1))
    outcome, answered = trio.run(_garbage_then_a_request, port)
    assert outcome == "reset 0"
    assert answered > 0
    assert pylon.id in routing_view(replica)  # the replica's own tunnel was never touched


def test_verified_tls_with_sni_and_an_alpn_mismatch(fleet: Fleet, tmp_path: Path) -> None:
    """A reverse Pylon that trusts the replica's QUIC certificate connects (SNI `stargate` for an
    IP target); one that trusts another certificate never does, nor does one speaking another
    tunnel protocol (ALPN). A direct Pylon presenting its own certificate is dialed by a replica
    that trusts it."""
    cert, key = generate_self_signed()
    other, _ = generate_self_signed()
    paths = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "other")}
    for name, pem in (("cert", cert), ("key", key), ("other", other)):
        paths[name].write_bytes(pem)
    replica = fleet.replica(
        "--backend-connectivity=reverse",
        "--reverse-tunnel-listen-addr=127.0.0.1:0",
        f"--quic-tls-cert-path={paths['cert']}",
        f"--quic-tls-key-path={paths['key']}",
    )

    def pylon(connectivity: str, *flags: str) -> Pylon:
        return fleet.pylon(
            fleet.engine().url,
            replica,
            f"--backend-connectivity={connectivity}",
            "--canary-interval-ms",
            "0",
            *flags,
        )

    good = pylon("reverse", "--tls-cert-path", str(paths["cert"]))
    untrusted = pylon("reverse", "--tls-cert-path", str(paths["other"]))
    wrong_protocol = pylon("reverse", "--tunnel-protocol=http3", "--quic-insecure")
    # Direct, verified: the Pylon serves the same pair, the replica trusts it.
    pair = ("--tls-cert-path", str(paths["cert"]), "--tls-key-path", str(paths["key"]))
    direct = pylon("direct", *pair)
    wait_routable(replica, 2)
    wait_until(
        lambda: (
            "reverse tunnel to" in untrusted.process.log
            and "failed" in untrusted.process.log
            and "failed" in wrong_protocol.process.log
        ),
        10,
        "the refused dials",
    )
    time.sleep(1.0)  # a few heartbeats: still only the trusted two
    assert routing_view(replica).keys() == {good.id, direct.id}
    # The mounted QUIC pair's expiry is exported under its own material type (docs/tunnels.md).
    metrics = httpx.get(f"http://127.0.0.1:{replica.ports.metrics}/metrics").text
    expiry = re.search(
        r'stargate_tls_certificate_expiry_seconds\{material_type="quic_server_identity"\} (\S+)',
        metrics,
    )
    assert expiry is not None and float(expiry.group(1)) > time.time() + 365 * 86400


@pytest.mark.parametrize(("connectivity", "protocol"), COMBINATIONS[:2])
def test_a_pylon_stopped_with_sigterm_finishes_its_streams(
    fleet: Fleet, connectivity: str, protocol: str
) -> None:
    """SIGTERM closes the Pylon's registrations at once (the replica stops routing to it), and
    the streams in flight through its tunnel run to their end: the replica keeps a retired
    registration's connection until its requests are done, and the Pylon drains its tunnel."""
    replica, pylon, engine = tunneled(
        fleet, connectivity, protocol, "--tokens", "20", "--inter-token-ms", "100"
    )
    results: list[tuple[int, str]] = []

    def one() -> None:
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{replica.ports.http}/v1/chat/completions",
            json=chat(),
            timeout=30,
        ) as response:
            results.append((response.status_code, "".join(response.iter_text())))

    streaming = threading.Thread(target=one)
    streaming.start()
    wait_until(
        lambda: httpx.get(engine.url + "/test-control").json()["in_flight"] == 1, 5, "a stream"
    )
    pylon.process.process.send_signal(signal.SIGTERM)
    wait_until(lambda: replica.list_models(MODEL) == [], 3, "the registration closed")
    streaming.join()
    assert results[0][0] == 200 and "[DONE]" in results[0][1]  # the stream ran to its end
    assert pylon.process.process.wait(timeout=15) == 0
