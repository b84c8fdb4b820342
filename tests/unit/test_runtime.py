"""A replica in this process on real loopback sockets (real clock: docs/decisions.md, H7).

These cover the drain contract: in-flight streams finish, the drain deadline and a forced exit
cut them and exit 1, and a server that ends on its own shuts the replica down with exit 1.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from quart import Response

from stargate import runtime
from stargate.config import ListenAddress, ServeConfig, WarmupConfig
from stargate.runtime import BoundAddresses, Replica
from stargate.serving import StartupError

CHUNKS = 5
CHUNK_GAP = 0.1


def _config(**overrides: Any) -> ServeConfig:
    values: dict[str, Any] = {
        "stargate_id": "test-replica",
        "http_listen_addr": ListenAddress("127.0.0.1", 0),
        "listen_addr": ListenAddress("127.0.0.1", 0),
        "model_discovery_listen_addr": ListenAddress("127.0.0.1", 0),
        "metrics_port": 0,
        "shutdown_delay_ms": 0,  # the leave phase is tested in tests/e2e/test_rolling_restart.py
        "shutdown_drain_timeout_ms": 5_000,
        "warmup": WarmupConfig(warmup_ms=0),
    }
    values.update(overrides)
    return ServeConfig(**values)


def _add_slow_stream(replica: Replica, gap: float = CHUNK_GAP) -> None:
    @replica.admin_app.get("/slow-stream")
    async def slow_stream() -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for index in range(CHUNKS):
                yield f"chunk {index}\n".encode()
                await trio.sleep(gap)

        return Response(chunks(), mimetype="text/plain")


async def _start(
    replica: Replica, nursery: trio.Nursery
) -> tuple[BoundAddresses, Callable[[], int | None]]:
    result: list[int] = []

    async def run(*, task_status: trio.TaskStatus[BoundAddresses]) -> None:
        result.append(await replica.run(task_status=task_status))

    bound = await nursery.start(run)
    return bound, lambda: result[0] if result else None


def _url(bound: BoundAddresses, path: str) -> str:
    return f"http://127.0.0.1:{bound.http.port}{path}"


async def test_in_flight_stream_finishes_during_drain_and_exit_is_0() -> None:
    replica = Replica(_config())
    _add_slow_stream(replica)
    received: list[bytes] = []
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        async with (
            httpx.AsyncClient() as client,
            client.stream("GET", _url(bound, "/slow-stream")) as response,
        ):
            async for chunk in response.aiter_bytes():
                received.append(chunk)
                if len(received) == 1:
                    replica.begin_shutdown()
                    assert not replica.readiness.ready
    assert b"".join(received) == b"".join(f"chunk {i}\n".encode() for i in range(CHUNKS))
    assert exit_code() == 0


async def test_listener_stops_accepting_once_shutdown_begins() -> None:
    replica = Replica(_config())
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        async with httpx.AsyncClient() as client:
            assert (await client.get(_url(bound, "/readyz"))).status_code == 200
        replica.begin_shutdown()
    assert exit_code() == 0
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", bound.http.port), timeout=1),
    ):
        pass


async def test_drain_timeout_cuts_the_stream_and_exit_is_1() -> None:
    replica = Replica(_config(shutdown_drain_timeout_ms=150))
    _add_slow_stream(replica, gap=1.0)
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        start = trio.current_time()
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", _url(bound, "/slow-stream")) as response:
                    async for _ in response.aiter_bytes():
                        replica.begin_shutdown()
    assert exit_code() == 1
    assert trio.current_time() - start < 1.0


async def test_force_exit_cancels_in_flight_work_and_exit_is_1() -> None:
    replica = Replica(_config())
    _add_slow_stream(replica, gap=1.0)
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", _url(bound, "/slow-stream")) as response:
                    async for _ in response.aiter_bytes():
                        replica.begin_shutdown()
                        replica.force_exit()
    assert exit_code() == 1


async def test_a_server_that_stops_on_its_own_shuts_the_replica_down_with_exit_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_serve = runtime.serve_asgi
    served: list[str] = []

    async def metrics_server_that_dies(*args: Any, task_status: Any) -> None:
        served.append(args[2])  # the socket: only the order matters
        if len(served) < 4:  # HTTP and the two gRPC servers stay real
            await real_serve(*args, task_status=task_status)
            return
        task_status.started()  # the metrics server (started last) stops at once

    monkeypatch.setattr(runtime, "serve_asgi", metrics_server_that_dies)
    replica = Replica(_config())
    async with trio.open_nursery() as nursery:
        _, exit_code = await _start(replica, nursery)
    assert exit_code() == 1
    assert len(served) == 4
    assert replica.shutting_down
    assert not replica.readiness.ready


async def test_shutdown_during_warmup_ends_the_sampler_and_readyz_stays_503() -> None:
    replica = Replica(_config(warmup=WarmupConfig(warmup_ms=600_000, sample_interval_ms=10)))
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        async with httpx.AsyncClient() as client:
            assert (await client.get(_url(bound, "/readyz"))).status_code == 503
        replica.begin_shutdown()
    # The nursery could only close because the sampler ended with the warmup scope.
    assert exit_code() == 0
    assert replica.readiness.warm and not replica.readiness.ready


async def test_run_refuses_an_occupied_port_before_serving() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        replica = Replica(_config(http_listen_addr=ListenAddress("127.0.0.1", port)))
        with pytest.raises(StartupError, match=f"HTTP listener on 127.0.0.1:{port}"):
            await replica.run()


async def test_first_signal_drains_and_a_second_forces_exit() -> None:
    replica = Replica(_config())
    _add_slow_stream(replica, gap=1.0)
    send_signal, signals = trio.open_memory_channel[int](2)
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        nursery.start_soon(runtime._watch_signals, signals, replica)
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", _url(bound, "/slow-stream")) as response:
                    async for _ in response.aiter_bytes():
                        await send_signal.send(signal.SIGTERM)
                        await trio.testing.wait_all_tasks_blocked()
                        assert replica.shutting_down
                        assert exit_code() is None  # still draining the stream
                        await send_signal.send(signal.SIGINT)
        await send_signal.aclose()  # ends the watcher
    assert exit_code() == 1


@pytest.mark.parametrize(
    ("interval_ms", "window", "warns"), [(200, 5, False), (100, 5, True), (1_000, 5, False)]
)
async def test_a_window_shorter_than_a_pylon_reconnect_is_warned_about(
    caplog: pytest.LogCaptureFixture, interval_ms: int, window: int, warns: bool
) -> None:
    warmup = WarmupConfig(
        warmup_ms=60_000, sample_interval_ms=interval_ms, stabilization_window=window
    )
    replica = Replica(_config(warmup=warmup))
    async with trio.open_nursery() as nursery:
        await _start(replica, nursery)
        replica.begin_shutdown()
    warned = [r for r in caplog.records if "shorter than 1000 ms" in r.getMessage()]
    assert bool(warned) is warns
