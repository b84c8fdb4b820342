"""End to end: the real `stargate serve` process on loopback ports, real clock, real clients."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx

from tests.e2e.processes import Ports, StargateProcess, wait_until

WARMUP_MS = 1_500


def test_serve_warms_up_serves_probes_and_metrics_and_drains_on_sigterm(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    ports = Ports.pick()
    http_port, metrics_port = ports.http, ports.metrics
    started_at = time.monotonic()
    replica = start_stargate(
        "serve",
        "--stargate-id=e2e-replica",
        *ports.args(),
        f"--readiness-warmup-ms={WARMUP_MS}",
        "--shutdown-delay-ms=0",  # the leave phase has tests of its own (test_rolling_restart)
        "--shutdown-drain-timeout-ms=5000",
    )
    base = f"http://127.0.0.1:{http_port}"
    with httpx.Client(timeout=5) as client:
        wait_until(
            lambda: client.get(f"{base}/healthz").status_code == 200, 10, "the HTTP listener"
        )
        ready = client.get(f"{base}/readyz")
        if time.monotonic() - started_at < WARMUP_MS / 1000:
            assert ready.status_code == 503, "not ready before the warmup deadline"
            assert ready.json()["phase"] == "warming"
        became_ready = wait_until(
            lambda: client.get(f"{base}/readyz").status_code == 200, 10, "/readyz to turn 200"
        )
        assert became_ready - started_at >= WARMUP_MS / 1000
        assert client.get(f"{base}/readyz").json()["promotion_reason"] == "deadline"
        assert client.get(f"{base}/healthz").status_code == 200

        metrics = client.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "stargate_readiness_ready 1.0" in metrics
        assert 'stargate_readiness_warmup_promotions_total{reason="deadline"} 1.0' in metrics
        assert "stargate_readiness_time_to_ready_seconds 1.5" in metrics
        assert "stargate_readiness_stable_samples 0.0" in metrics
        assert "stargate_readiness_sampled_backend_count 0.0" in metrics

    replica.process.send_signal(signal.SIGTERM)
    assert replica.process.wait(timeout=5) == 0
    log = replica.log
    assert "starting stargate version=" in log
    assert "stargate_id=e2e-replica" in log
    assert "readiness warmup ended: reason=deadline" in log
    assert "graceful shutdown complete" in log


def test_serve_is_ready_at_once_with_warmup_0_and_sigint_exits_0(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    ports = Ports.pick()
    http_port = ports.http
    replica = start_stargate("serve", *ports.args(), "--readiness-warmup-ms=0")
    with httpx.Client(timeout=5) as client:
        wait_until(
            lambda: client.get(f"http://127.0.0.1:{http_port}/readyz").status_code == 200,
            10,
            "/readyz",
        )
    replica.process.send_signal(signal.SIGINT)
    assert replica.process.wait(timeout=5) == 0
    assert "reason=disabled" in replica.log


def test_occupied_metrics_port_exits_1_naming_the_listener(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    import socket

    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        ports = Ports.pick()
        replica = start_stargate("serve", *ports.args(), f"--metrics-port={port}")
        assert replica.process.wait(timeout=10) == 1
    assert f"failed to bind metrics listener on 0.0.0.0:{port}" in replica.log


def test_metrics_on_loopback_only_and_debug_endpoints_off(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    """`--metrics-listen-addr=127.0.0.1:PORT` binds that address only (another loopback address
    of this host is refused, while the HTTP listener on 0.0.0.0 answers there), and
    `--no-debug-endpoints` makes `/debug/state` a 404 like any unknown path."""
    import socket

    ports = Ports.pick()
    replica = start_stargate(
        "serve",
        f"--http-listen-addr=0.0.0.0:{ports.http}",
        f"--listen-addr=127.0.0.1:{ports.grpc}",
        f"--model-discovery-listen-addr=127.0.0.1:{ports.discovery}",
        f"--metrics-listen-addr=127.0.0.1:{ports.metrics}",
        "--no-debug-endpoints",
        "--readiness-warmup-ms=0",
        "--shutdown-delay-ms=0",
    )
    with httpx.Client(timeout=5) as client:
        wait_until(
            lambda: client.get(f"http://127.0.0.1:{ports.http}/readyz").status_code == 200,
            10,
            "/readyz",
        )
        metrics = client.get(f"http://127.0.0.1:{ports.metrics}/metrics")
        assert metrics.status_code == 200 and "stargate_readiness_ready 1.0" in metrics.text
        # 127.0.0.2 is this host too: a wildcard listener accepts there, a 127.0.0.1 one does not.
        assert client.get(f"http://127.0.0.2:{ports.http}/healthz").status_code == 200
        with socket.socket() as probe:
            probe.settimeout(5)
            assert probe.connect_ex(("127.0.0.2", ports.metrics)) != 0
        debug = client.get(f"http://127.0.0.1:{ports.http}/debug/state")
        assert debug.status_code == 404 and debug.content == b""
        assert client.get(f"http://127.0.0.1:{ports.http}/v1/models").status_code == 200
    replica.process.send_signal(signal.SIGTERM)
    assert replica.process.wait(timeout=10) == 0
    assert f"metrics=127.0.0.1:{ports.metrics}" in replica.log
    assert "debug_endpoints=False" in replica.log


def test_metrics_port_with_metrics_listen_addr_is_a_usage_error(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    replica = start_stargate("serve", "--metrics-port=9191", "--metrics-listen-addr=127.0.0.1:9191")
    assert replica.process.wait(timeout=10) == 2
    assert "--metrics-port cannot be combined with --metrics-listen-addr" in replica.log


def test_zero_sample_interval_is_a_usage_error(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    replica = start_stargate("serve", "--warmup-sample-interval-ms", "0")
    assert replica.process.wait(timeout=10) == 2
    assert "'--warmup-sample-interval-ms'" in replica.log
    assert "value must be greater than 0" in replica.log


def test_idle_keep_alive_connections_do_not_hold_the_drain(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    """A kubelet or load balancer keeps connections open; SIGTERM must still exit promptly."""
    ports = Ports.pick()
    replica = start_stargate(
        "serve", *ports.args(), "--readiness-warmup-ms=0", "--shutdown-delay-ms=0"
    )
    with httpx.Client(timeout=5) as client:  # stays open (keep-alive) across the SIGTERM
        wait_until(
            lambda: client.get(f"http://127.0.0.1:{ports.http}/readyz").status_code == 200,
            10,
            "/readyz",
        )
        client.get(f"http://127.0.0.1:{ports.metrics}/metrics")
        started = time.monotonic()
        replica.process.send_signal(signal.SIGTERM)
        assert replica.process.wait(timeout=10) == 0
        assert time.monotonic() - started < 5  # far below the 30 s drain timeout
