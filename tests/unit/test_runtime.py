"""A replica in this process on real loopback sockets (real clock: docs/decisions.md, H7).

These cover the drain contract: in-flight streams finish, the drain deadline and a forced exit
cut them and exit 1, and a server that ends on its own shuts the replica down with exit 1.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from stargate import serving
from stargate.activator.wiring import lease_owner_url
from stargate.config import (
    ActivatorConfig,
    ControlPlaneConfig,
    DiscoveryConfig,
    ListenAddress,
    PoolOwnershipConfig,
    ProxyConfig,
    SecretsConfig,
    ServeConfig,
    TracingConfig,
    WarmupConfig,
)
from stargate.control_plane import discovery
from stargate.lifecycle import Phase
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
    """`GET /slow-stream` in front of the replica's admin app: CHUNKS chunks, `gap` apart (the
    proxy hands every other path to the admin app, read when the replica starts serving)."""
    admin = replica.admin_app

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/slow-stream":
            await admin(scope, receive, send)
            return
        headers = [(b"content-type", b"text/plain")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for index in range(CHUNKS):
            chunk = f"chunk {index}\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await trio.sleep(gap)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    replica.admin_app = app  # type: ignore[assignment]


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
                    replica.shutdown.begin()
                    assert not replica.readiness.ready
    assert b"".join(received) == b"".join(f"chunk {i}\n".encode() for i in range(CHUNKS))
    assert exit_code() == 0
    assert replica.lifecycle.phase is Phase.DONE  # the drain finished on its own


async def test_listener_stops_accepting_once_shutdown_begins() -> None:
    replica = Replica(_config())
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        async with httpx.AsyncClient() as client:
            assert (await client.get(_url(bound, "/readyz"))).status_code == 200
        replica.shutdown.begin()
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
                        replica.shutdown.begin()
    assert exit_code() == 1
    assert trio.current_time() - start < 1.0
    assert replica.lifecycle.phase is Phase.DRAINING  # cut by the deadline, never done


async def test_force_exit_cancels_in_flight_work_and_exit_is_1() -> None:
    replica = Replica(_config())
    _add_slow_stream(replica, gap=1.0)
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", _url(bound, "/slow-stream")) as response:
                    async for _ in response.aiter_bytes():
                        replica.shutdown.begin()
                        replica.shutdown.force()
    assert exit_code() == 1


async def test_a_server_that_stops_on_its_own_shuts_the_replica_down_with_exit_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_serve = serving.serve_asgi
    served: list[str] = []

    async def metrics_server_that_dies(*args: Any, task_status: Any) -> None:
        # Hypercorn serves HTTP and metrics; the gRPC listeners are served by
        # stargate/h2_server.py and stay real.
        served.append(args[2])  # the socket: only the order matters
        if len(served) < 2:  # HTTP stays real
            await real_serve(*args, task_status=task_status)
            return
        task_status.started()  # the metrics server (started last) stops at once

    monkeypatch.setattr(serving, "serve_asgi", metrics_server_that_dies)
    replica = Replica(_config())
    async with trio.open_nursery() as nursery:
        _, exit_code = await _start(replica, nursery)
    assert exit_code() == 1
    assert len(served) == 2
    assert replica.lifecycle.shutting_down and replica.lifecycle.failed
    assert not replica.readiness.ready


async def test_shutdown_during_warmup_ends_the_sampler_and_readyz_stays_503() -> None:
    replica = Replica(_config(warmup=WarmupConfig(warmup_ms=600_000, sample_interval_ms=10)))
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        async with httpx.AsyncClient() as client:
            assert (await client.get(_url(bound, "/readyz"))).status_code == 503
        replica.shutdown.begin()
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
        nursery.start_soon(replica.shutdown.watch, signals)
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", _url(bound, "/slow-stream")) as response:
                    async for _ in response.aiter_bytes():
                        await send_signal.send(signal.SIGTERM)
                        await trio.testing.wait_all_tasks_blocked()
                        assert replica.lifecycle.shutting_down
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
        replica.shutdown.begin()
    warned = [r for r in caplog.records if "shorter than 1000 ms" in r.getMessage()]
    assert bool(warned) is warns


PROCESS_POOL = (
    "pools:\n"
    "  - name: local-pool\n"
    "    members: [m]\n"
    "    controller:\n"
    "      kind: process\n"
    "      members:\n"
    '        m: {command: [engine, --port, "{port}"]}\n'
)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("lb-config", "invalid load balancer config: {tmp}/lb.json: invalid JSON at line 1"),
        ("pool-config", "invalid pool config: {tmp}/pools.yaml"),
        (
            "lease-with-process-pool",
            "--pool-ownership=lease shares pools between replicas, but pools local-pool do not "
            "use the kubernetes controller (a process pool's engines run on this machine): use "
            "--pool-ownership=local, one replica per machine, for those",
        ),
        (
            "worker-auth-endpoint",
            "invalid worker auth configuration: worker auth endpoint 'ftp://gw:1': scheme must "
            "be http or https",
        ),
    ],
)
def test_a_setting_a_builder_refuses_fails_start_up_before_anything_binds(
    tmp_path: Path, case: str, message: str
) -> None:
    """The builders moved beside their parts (load_balancing/config.py, activator/wiring.py,
    control_plane/auth.py) still refuse when the replica is built, with the message naming the
    setting that `stargate serve` logs before exiting 1."""
    (tmp_path / "lb.json").write_text("{")
    (tmp_path / "pools.yaml").write_text("pools: 3\n")
    (tmp_path / "process.yaml").write_text(PROCESS_POOL)
    overrides: dict[str, Any] = {
        "lb-config": {"proxy": ProxyConfig(lb_config_path=str(tmp_path / "lb.json"))},
        "pool-config": {"activator": ActivatorConfig(pool_config_path=tmp_path / "pools.yaml")},
        "lease-with-process-pool": {
            "activator": ActivatorConfig(
                pool_config_path=tmp_path / "process.yaml",
                ownership=PoolOwnershipConfig(mode="lease"),
            )
        },
        "worker-auth-endpoint": {
            "control_plane": ControlPlaneConfig(worker_auth_endpoint="ftp://gw:1")
        },
    }[case]
    with pytest.raises(StartupError) as raised:
        Replica(_config(**overrides))
    assert str(raised.value).startswith(message.format(tmp=tmp_path))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"discovery": DiscoveryConfig(dns_name="not a host")},
            "invalid discovery configuration: discovery DNS name 'not a host' is not a host "
            "name (give the name only, without scheme or port)",
        ),
        (
            {
                "tracing": TracingConfig(endpoint="http://127.0.0.1:4317"),
                "secrets": SecretsConfig(path=Path("/nonexistent/secrets.json")),
            },
            "cannot start the trace exporter: ",
        ),
    ],
    ids=["discovery", "tracing-token"],
)
async def test_a_setting_refused_once_bound_fails_start_up_before_serving(
    overrides: dict[str, Any], message: str
) -> None:
    """The publisher (control_plane/discovery.py) and the trace exporter (stargate/tracing/) are
    built once the ports are bound; what they refuse still ends `run()` before anything is
    served, and the bound listeners are closed again."""
    replica = Replica(_config(**overrides))
    with pytest.raises(StartupError) as raised:
        await replica.run()
    assert str(raised.value).startswith(message)
    assert replica.bound is not None
    with socket.socket() as probe:  # the HTTP listener was closed: its port binds again
        probe.bind(("127.0.0.1", replica.bound.http.port))


async def test_the_wiring_logs_and_debug_state_are_the_runtimes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The LB config line stays the runtime's own (logger `stargate.runtime`), and `/debug/state`
    (admin_app.py's `debug_state_config`) reports the addresses the listeners actually bound."""
    lb_file = tmp_path / "lb.json"
    lb_file.write_text('{"default": "round-robin", "models": {"m": "random"}}')
    with caplog.at_level(logging.INFO, logger="stargate.runtime"):
        replica = Replica(_config(proxy=ProxyConfig(lb_config_path=str(lb_file))))
    assert [
        (r.name, r.getMessage()) for r in caplog.records if "load balancer" in r.getMessage()
    ] == [
        (
            "stargate.runtime",
            "load balancer config loaded: default_lb=round-robin model_overrides=1",
        )
    ]
    async with trio.open_nursery() as nursery:
        bound, exit_code = await _start(replica, nursery)
        async with httpx.AsyncClient() as client:
            state = (await client.get(_url(bound, "/debug/state"))).json()
        replica.shutdown.begin()
    assert exit_code() == 0
    assert state["config"] == {
        "stargate_id": "test-replica",
        "grpc_listen_addr": str(bound.grpc),
        "model_discovery_listen_addr": str(bound.model_discovery),
        "http_listen_addr": str(bound.http),
        "metrics_listen_addr": str(bound.metrics),
        "advertise_addr": f"127.0.0.1:{bound.grpc.port}",
        "stargate_discovery_dns_name": None,
        "tunnel_protocol": "http",
        "backend_connectivity": "direct",
        "direct_quic_connections": 0,
    }


@pytest.mark.parametrize(
    ("listen_host", "advertise", "expected"),
    [
        ("127.0.0.1", None, ("127.0.0.1:7001", "127.0.0.1:7000")),
        ("0.0.0.0", None, ("10.1.2.3:7001", "10.1.2.3:7000")),  # every interface: this host
        (
            "0.0.0.0",
            ListenAddress("192.0.2.5", 443),
            ("192.0.2.5:443", "192.0.2.5:7000"),
        ),
    ],
    ids=["listen-host", "unspecified-host", "advertise-addr"],
)
def test_the_advertise_address_rule(
    monkeypatch: pytest.MonkeyPatch,
    listen_host: str,
    advertise: ListenAddress | None,
    expected: tuple[str, str],
) -> None:
    """`--advertise-addr`, else the gRPC listener's host with its bound port, and this host's own
    address for a listener on every interface (peers and Pylons cannot dial 0.0.0.0); the HTTP
    address is the same host with the HTTP port (control_plane/discovery.py)."""
    monkeypatch.setattr(discovery, "host_address", lambda: "10.1.2.3")
    config = _config(listen_addr=ListenAddress(listen_host, 0), advertise_addr=advertise)
    publisher = discovery.publisher_config(config, grpc_port=7001, http_port=7000)
    assert (publisher.advertise_addr, publisher.http_advertise_addr) == expected


@pytest.mark.parametrize(
    ("owner_url", "advertised", "tls", "expected"),
    [
        ("http://10.0.0.7:8000", "10.0.0.9:8000", True, "http://10.0.0.7:8000"),
        (None, "10.0.0.9:8000", False, "http://10.0.0.9:8000"),
        (None, "10.0.0.9:8000", True, "https://10.0.0.9:8000"),
        (None, None, False, None),
    ],
    ids=["flag", "advertised", "advertised-tls", "nothing"],
)
def test_the_lease_owner_url_rule(
    owner_url: str | None, advertised: str | None, tls: bool, expected: str | None
) -> None:
    """The URL recorded in a pool Lease (activator/wiring.py): `--pool-owner-url`, else the HTTP
    listener as peers reach it, over https when that listener serves TLS
    (docs/pool-ownership.md, "In the replica")."""
    ownership = PoolOwnershipConfig(mode="lease", owner_url=owner_url)
    assert lease_owner_url(ownership, http_advertise_addr=advertised, tls=tls) == expected
