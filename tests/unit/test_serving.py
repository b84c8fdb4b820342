"""The serving plumbing of `stargate/serving.py`: the shared shutdown-signal watcher (signals come
from a memory channel, as in tests/unit/test_runtime.py), listener binding, the replica's server
table and a group of servers shut down as one."""

from __future__ import annotations

import functools
import signal
import socket
from collections.abc import Callable
from typing import Any, cast

import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig

from stargate import serving
from stargate.asgi import ASGIReceive, ASGIScope, ASGISend
from stargate.config import ListenAddress, ServeConfig
from stargate.h2_server import H2Config
from stargate.mock import cli as mock_cli
from stargate.pylon import cli as pylon_cli
from stargate.pylon.sidecar import Pylon
from stargate.serving import (
    MAX_REQUESTS_PER_CONNECTION,
    TLS_HANDSHAKE_TIMEOUT_SECONDS,
    UNLIMITED_REQUESTS_PER_CONNECTION,
    ASGIApp,
    Server,
    Servers,
    StartupError,
    bind_all,
    bind_listener,
    bind_replica,
    bound_address,
    closed_on_failure,
    hypercorn_config,
    replica_servers,
    startup_failures,
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


def test_closed_on_failure_closes_the_sockets_only_when_start_up_fails() -> None:
    kept = [bind_listener("a", ListenAddress("127.0.0.1", 0))]
    with closed_on_failure(kept):
        pass
    assert kept[0].fileno() != -1
    kept[0].close()
    failed = [bind_listener("b", ListenAddress("127.0.0.1", 0))]
    with pytest.raises(StartupError), closed_on_failure(failed):
        raise StartupError("cannot start")
    assert failed[0].fileno() == -1


def test_startup_failures_flattens_nested_groups() -> None:
    first, second, third = StartupError("a"), StartupError("b"), StartupError("c")
    nested = BaseExceptionGroup("outer", [first, BaseExceptionGroup("inner", [second, third])])
    group = cast(BaseExceptionGroup[StartupError], nested)  # as `except* StartupError` sees it
    assert startup_failures(group) == [first, second, third]


def test_bind_replica_binds_the_four_listeners_in_order() -> None:
    config = ServeConfig(
        stargate_id="r1",
        http_listen_addr=ListenAddress("127.0.0.1", 0),
        listen_addr=ListenAddress("127.0.0.1", 0),
        model_discovery_listen_addr=ListenAddress("127.0.0.1", 0),
        metrics_port=0,
    )
    bound, sockets = bind_replica(config)
    try:
        assert [bound.http, bound.grpc, bound.model_discovery, bound.metrics] == [
            bound_address(sock) for sock in sockets
        ]
        assert str(bound) == (
            f"http={bound.http} grpc={bound.grpc} model_discovery={bound.model_discovery} "
            f"metrics={bound.metrics}"
        )
    finally:
        for sock in sockets:
            sock.close()


async def _app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
    pass


def test_the_replica_server_table() -> None:
    """Names, start order, connection rotation (not on the control plane's long-lived Pylon
    channels), TLS (not on metrics), Hypercorn's graceful timeout past the drain deadline, and the
    client limits on the HTTP listener only."""
    names = ("http", "control_plane", "model_discovery", "metrics", "limited")
    apps: dict[str, ASGIApp] = {name: functools.partial(_app) for name in names}  # distinct
    limited: list[tuple[ASGIApp, Any]] = []

    def limit_http(app: ASGIApp, listener: Any) -> ASGIApp:
        limited.append((app, listener))
        return apps["limited"]

    sockets = [cast(socket.socket, object()) for _ in range(4)]
    servers = replica_servers(
        sockets,
        http=apps["http"],
        control_plane=apps["control_plane"],
        model_discovery=apps["model_discovery"],
        metrics=apps["metrics"],
        drain_timeout=7.0,
        limit_http=limit_http,
    )
    assert [(s.name, s.app, s.sock, s.tls) for s in servers] == [
        ("HTTP server", apps["limited"], sockets[0], True),
        ("control-plane gRPC server", apps["control_plane"], sockets[1], True),
        ("model-discovery gRPC server", apps["model_discovery"], sockets[2], True),
        ("metrics server", apps["metrics"], sockets[3], False),
    ]
    assert limited == [(apps["http"], servers[0].config)]
    http, control_plane, discovery, metrics = (s.config for s in servers)
    # The gRPC listeners are served by the lean HTTP/2 server (stargate/h2_server.py), the others
    # by Hypercorn.
    assert isinstance(http, HypercornConfig) and isinstance(metrics, HypercornConfig)
    assert isinstance(control_plane, H2Config) and isinstance(discovery, H2Config)
    assert http.keep_alive_max_requests == MAX_REQUESTS_PER_CONNECTION
    assert metrics.keep_alive_max_requests == MAX_REQUESTS_PER_CONNECTION
    assert control_plane.max_requests_per_connection is None
    assert discovery.max_requests_per_connection == MAX_REQUESTS_PER_CONNECTION
    assert {s.config.graceful_timeout for s in servers} == {8.0}
    assert control_plane.tls_handshake_timeout == TLS_HANDSHAKE_TIMEOUT_SECONDS


async def test_servers_start_in_order_with_tls_where_asked_and_leave_once_shutting_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each server is served with its own settings, TLS only where the server takes it, through
    the supervisor; a server started after `leave` (a signal during start-up) leaves at once, and
    `stop` is every server's shutdown trigger."""
    served: list[tuple[str, bool]] = []
    triggers: list[Any] = []

    async def fake_serve(
        app: ASGIApp, sock: Any, config: Any, trigger: Any, *, task_status: Any, **tls: Any
    ) -> None:
        served.append((sock, "ssl_context" in tls))
        triggers.append(trigger)
        task_status.started()

    supervised: list[str] = []

    async def supervise(name: str, serve: Any, *, task_status: Any) -> None:
        supervised.append(name)
        await serve(task_status=task_status)

    monkeypatch.setattr(serving, "serve_asgi", fake_serve)
    group = Servers()
    first = Server("first", _app, cast(socket.socket, "a"), hypercorn_config(1.0))
    plain = Server("plain", _app, cast(socket.socket, "b"), hypercorn_config(1.0), tls=False)
    context = cast(Any, object())
    async with trio.open_nursery() as nursery:
        await group.start(nursery, [first], ssl_context=context, supervise=supervise)
        assert first.config.keep_alive_max_requests == UNLIMITED_REQUESTS_PER_CONNECTION
        group.leave()
        assert first.config.keep_alive_max_requests == 0  # told to leave
        await group.start(nursery, [plain], ssl_context=context, supervise=supervise)
        assert plain.config.keep_alive_max_requests == 0  # left as it started
    assert served == [("a", True), ("b", False)]
    assert supervised == ["first", "plain"]
    with trio.fail_after(1):
        group.stop()
        for trigger in triggers:
            await trigger()


async def test_servers_count_the_requests_in_flight_on_every_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    apps: list[ASGIApp] = []

    async def fake_serve(app: ASGIApp, *args: Any, task_status: Any) -> None:
        apps.append(app)
        task_status.started()

    release = trio.Event()

    async def slow(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        await release.wait()

    monkeypatch.setattr(serving, "serve_asgi", fake_serve)
    group = Servers()
    async with trio.open_nursery() as nursery:
        server = Server("s", slow, cast(socket.socket, None), hypercorn_config(1.0))
        await group.start(nursery, [server])
        nursery.start_soon(apps[0], {"type": "http"}, None, None)
        await trio.testing.wait_all_tasks_blocked()
        idle = False

        async def wait() -> None:
            nonlocal idle
            await group.wait_idle()
            idle = True

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not idle
        release.set()
    assert idle
