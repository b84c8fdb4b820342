"""The serving plumbing of `stargate/serving.py`: the shared shutdown-signal watcher (signals come
from a memory channel, as in tests/unit/test_runtime.py) and listener binding."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from typing import cast

import pytest
import trio
import trio.testing

from stargate import serving
from stargate.config import ListenAddress
from stargate.mock import cli as mock_cli
from stargate.pylon import cli as pylon_cli
from stargate.pylon.sidecar import Pylon
from stargate.serving import (
    MAX_REQUESTS_PER_CONNECTION,
    UNLIMITED_REQUESTS_PER_CONNECTION,
    StartupError,
    bind_all,
    bind_listener,
    bound_address,
    hypercorn_config,
    watch_signals,
)

Calls = list[tuple[str, signal.Signals]]


def _recorder(calls: Calls, kind: str) -> Callable[[signal.Signals], None]:
    def record(sig: signal.Signals) -> None:
        calls.append((kind, sig))

    return record


async def test_the_first_signal_starts_the_shutdown_and_later_ones_repeat() -> None:
    calls: Calls = []
    send, signals = trio.open_memory_channel[int](3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            watch_signals, signals, _recorder(calls, "first"), _recorder(calls, "repeat")
        )
        await send.send(signal.SIGTERM)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == [("first", signal.SIGTERM)]
        await send.send(signal.SIGINT)
        await send.send(signal.SIGTERM)
        await send.aclose()  # ends the watcher
    assert calls == [
        ("first", signal.SIGTERM),
        ("repeat", signal.SIGINT),
        ("repeat", signal.SIGTERM),
    ]


async def test_without_on_repeat_the_watcher_returns_after_the_first_signal() -> None:
    calls: Calls = []
    send, signals = trio.open_memory_channel[int](3)
    await send.send(signal.SIGINT)
    await send.send(signal.SIGTERM)
    with trio.fail_after(5):
        await watch_signals(signals, _recorder(calls, "first"))
    assert calls == [("first", signal.SIGINT)]
    assert signals.receive_nowait() == signal.SIGTERM  # left queued


async def test_a_signal_while_already_stopping_is_a_repeat() -> None:
    calls: Calls = []
    stopping = False
    send, signals = trio.open_memory_channel[int](3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: watch_signals(
                signals,
                _recorder(calls, "first"),
                _recorder(calls, "repeat"),
                stopping=lambda: stopping,
            )
        )
        stopping = True  # e.g. a server failed and the replica began its shutdown
        await send.send(signal.SIGTERM)
        await send.aclose()
    assert calls == [("repeat", signal.SIGTERM)]


async def test_the_mock_backend_finishes_on_the_first_signal_and_exits_on_the_second() -> None:
    stop = trio.Event()
    send, signals = trio.open_memory_channel[int](2)
    with trio.CancelScope() as exit_scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mock_cli._watch_signals, signals, stop, exit_scope)
            await send.send(signal.SIGTERM)
            await trio.testing.wait_all_tasks_blocked()
            assert stop.is_set()
            assert not exit_scope.cancel_called
            await send.send(signal.SIGINT)
            await trio.sleep_forever()  # until the second signal cancels the scope
    assert exit_scope.cancel_called


class _StoppingPylon:
    """Records `stop()`, the Pylon's graceful stop."""

    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


async def test_the_pylon_stops_gracefully_on_the_first_signal_and_at_once_on_the_second() -> None:
    """The first signal closes the registrations and lets requests in flight finish
    (`Pylon.stop`); a second one cancels everything at once."""
    send, signals = trio.open_memory_channel[int](2)
    pylon = _StoppingPylon()
    with trio.CancelScope() as pylon_scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pylon_cli._watch_signals, signals, cast(Pylon, pylon), pylon_scope)
            await send.send(signal.SIGINT)
            await trio.testing.wait_all_tasks_blocked()
            assert pylon.stops == 1 and not pylon_scope.cancel_called
            await send.send(signal.SIGTERM)
            await trio.sleep_forever()
    assert pylon_scope.cancel_called
    assert pylon.stops == 1


def test_bind_listener_names_the_listener_that_cannot_bind() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(
            StartupError, match=f"failed to bind metrics listener on 127.0.0.1:{port}"
        ):
            bind_listener("metrics", ListenAddress("127.0.0.1", port))


def test_bind_all_binds_every_listener_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[socket.socket] = []

    def recording_bind(name: str, address: ListenAddress) -> socket.socket:
        sock = bind_listener(name, address)
        created.append(sock)
        return sock

    monkeypatch.setattr(serving, "bind_listener", recording_bind)
    with bind_listener("blocker", ListenAddress("127.0.0.1", 0)) as blocker:
        taken = bound_address(blocker)
        with pytest.raises(StartupError, match=f"failed to bind second listener on {taken}"):
            bind_all([("first", ListenAddress("127.0.0.1", 0)), ("second", taken)])
    assert len(created) == 1
    assert created[0].fileno() == -1  # the first listener was closed again

    sockets = bind_all([("a", ListenAddress("127.0.0.1", 0)), ("b", ListenAddress("127.0.0.1", 0))])
    try:
        assert sockets == created[1:]
        assert all(bound_address(sock).port != 0 for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()


def test_connection_rotation_is_opt_in() -> None:
    assert hypercorn_config(1.0).keep_alive_max_requests == UNLIMITED_REQUESTS_PER_CONNECTION
    rotated = hypercorn_config(3.0, rotate_connections=True)
    assert rotated.keep_alive_max_requests == MAX_REQUESTS_PER_CONNECTION
    assert rotated.graceful_timeout == 3.0
