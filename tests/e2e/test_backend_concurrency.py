"""Many concurrent streams to one backend: no hidden per-backend cap below what engines batch.

A real `stargate serve` and one `stargate mock-backend` whose streams last a few seconds, so 600
SSE streams sent at once are all open together. Before `--proxy-max-connections-per-backend`
(default 1024) the upstream pool allowed 256 connections per backend: the 257th stream waited
5 s for a slot and got a 503 (docs/data-plane.md, "Per-backend connections").

The client side is raw trio sockets, one HTTP/1.1 connection per stream with `Connection: close`
(the response ends with the socket), so the test process stays light next to the two servers
sharing the machine's cores.
"""

from __future__ import annotations

import json
import re
import resource
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from stargate.http_limits import raise_open_file_limit
from tests.e2e.processes import MockBackendProcess, launch_mock_backend
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica

STREAMS = 600
MODEL = "batch-model"
# Long enough that every stream is open before the first one ends (the ramp takes 1-3 s on 2
# cores), short enough for the whole test to stay well under 20 s.
TTFT_MS = 5_000
TOKENS = 4
INTER_TOKEN_MS = 50
FAMILY = "stargate_proxy_backend_connections"
IN_USE = re.compile(
    rf'^{FAMILY}\{{inference_server_id="engine",state="in_use"\}} (\S+)$', re.MULTILINE
)


@pytest.fixture(scope="module")
def backend() -> Iterator[MockBackendProcess]:
    # This process holds a socket per stream, the mock backend (which inherits the limit) one per
    # stream, the replica two (it raises its own limit the same way).
    soft = raise_open_file_limit()
    if soft != resource.RLIM_INFINITY and soft < 2 * STREAMS + 200:
        pytest.skip(f"the open-file limit ({soft}) is too low for {STREAMS} streams")
    started = launch_mock_backend(
        "--model",
        MODEL,
        "--ttft-ms",
        str(TTFT_MS),
        "--inter-token-ms",
        str(INTER_TOKEN_MS),
        "--tokens",
        str(TOKENS),
    )
    yield started
    started.stop()


@pytest.fixture(scope="module")
def replica(
    tmp_path_factory: pytest.TempPathFactory, backend: MockBackendProcess
) -> Iterator[ProxyReplica]:
    # HTTP/1.1 clients need one client connection per stream: room for 600 of them. (Behind an
    # HTTP/2 proxy a handful of connections would carry the same streams.)
    handle = start_proxy_replica(
        tmp_path_factory.mktemp("concurrency"), "--max-client-connections=1000"
    )
    handle.register("engine", backend.url, [MODEL])
    yield handle
    handle.close()


def _request(index: int) -> bytes:
    body = json.dumps(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        "host: stargate\r\n"
        f"x-request-id: stream-{index}\r\n"
        "x-input-tokens: 10\r\n"
        f"x-model: {MODEL}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


async def _stream(port: int, index: int, results: list[tuple[int, bool]]) -> None:
    """One streamed chat on its own connection: (status, whether it ended with [DONE])."""
    response = bytearray()
    with trio.move_on_after(15):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(_request(index))
            while chunk := await stream.receive_some(65536):
                response += chunk
    status_line = bytes(response).split(b"\r\n", 1)[0].split()
    status = int(status_line[1]) if len(status_line) > 1 and status_line[1].isdigit() else 0
    results.append((status, b"data: [DONE]" in response))


async def _watch_in_use(metrics_url: str, peak: list[float], done: trio.Event) -> None:
    """The highest `in_use` the replica reported for the engine while the streams ran."""
    async with httpx.AsyncClient(timeout=5) as client:
        while not done.is_set():
            found = IN_USE.search((await client.get(metrics_url)).text)
            if found:
                peak[0] = max(peak[0], float(found[1]))
            await trio.sleep(0.2)


async def test_600_concurrent_streams_to_one_backend_all_complete_at_the_default_cap(
    replica: ProxyReplica, backend: MockBackendProcess
) -> None:
    results: list[tuple[int, bool]] = []
    peak = [0.0]
    done = trio.Event()
    started = trio.current_time()
    async with trio.open_nursery() as watcher:
        watcher.start_soon(
            _watch_in_use, f"http://127.0.0.1:{replica.ports.metrics}/metrics", peak, done
        )
        async with trio.open_nursery() as nursery:
            for index in range(STREAMS):
                nursery.start_soon(_stream, replica.ports.http, index, results)
        done.set()
    elapsed = trio.current_time() - started

    statuses: dict[int, int] = {}
    for status, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    completed = sum(1 for status, finished in results if status == 200 and finished)
    assert completed == STREAMS, f"{completed} of {STREAMS} completed; statuses {statuses}"
    # They really were open together: more than the old hidden cap of 256 at once.
    assert peak[0] > 256, f"peak in use {peak[0]}"
    assert elapsed < 15, elapsed
    # Once they ended, nothing waits and every connection went back to the idle pool or closed.
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"http://127.0.0.1:{replica.ports.metrics}/metrics")).text
    assert f'{FAMILY}{{inference_server_id="engine",state="waiting"}} 0.0' in text
    assert f'{FAMILY}{{inference_server_id="engine",state="in_use"}} 0.0' in text


async def test_at_the_cap_a_request_waits_for_a_connection_then_gets_503(
    tmp_path: Path,
) -> None:
    """`--proxy-max-connections-per-backend=1` and two engines whose streams last 6 s: two
    streams take one engine each; a third finds both full, waits for a connection (counted as
    `waiting`), and gets the bare 503 after the pool's 5 s (docs/data-plane.md, "Per-backend
    connections"). The first two complete."""
    engines = [
        launch_mock_backend("--model", MODEL, "--ttft-ms", "6500", "--tokens", "1")
        for _ in range(2)
    ]
    replica = start_proxy_replica(tmp_path, "--proxy-max-connections-per-backend=1")
    try:
        for index, engine in enumerate(engines):
            replica.register(f"engine-{index}", engine.url, [MODEL], cluster_id=f"c{index}")
        results: dict[int, tuple[int, bool]] = {}
        waited: list[float] = []

        async def stream(index: int) -> None:
            out: list[tuple[int, bool]] = []
            await _stream(replica.ports.http, index, out)
            results[index] = out[0]

        async def third() -> None:
            await trio.sleep(0.5)  # the first two hold both engines' only connection
            started = trio.current_time()
            await stream(2)
            waited.append(trio.current_time() - started)

        metrics_url = f"http://127.0.0.1:{replica.ports.metrics}/metrics"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, 0)
            nursery.start_soon(stream, 1)
            nursery.start_soon(third)
            await trio.sleep(2.5)
            async with httpx.AsyncClient(timeout=5) as client:
                text = (await client.get(metrics_url)).text
        in_use = re.findall(rf'^{FAMILY}\{{[^}}]*state="in_use"\}} (\S+)$', text, re.MULTILINE)
        waiting = re.findall(rf'^{FAMILY}\{{[^}}]*state="waiting"\}} (\S+)$', text, re.MULTILINE)
        assert sorted(in_use) == ["1.0", "1.0"], text
        assert sorted(waiting) == ["0.0", "1.0"], text
        assert results[0] == (200, True) and results[1] == (200, True)
        assert results[2] == (503, False)
        assert 4.9 <= waited[0] < 6.4, waited
        assert "no free upstream connection" in replica.process.log
    finally:
        replica.close()
        for engine in engines:
            engine.stop()
