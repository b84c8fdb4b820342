"""`stargate serve` flags: defaults, environment variables, and usage errors."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from stargate import runtime
from stargate.cli import main
from stargate.config import ListenAddress, ServeConfig, WarmupConfig


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[ServeConfig]:
    """Replace the runtime so `serve` only records the config it would run."""
    configs: list[ServeConfig] = []

    def fake_run(config: ServeConfig) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(runtime, "run", fake_run)
    return configs


def _serve(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["serve", *args], env=env or {})
    return result.exit_code, result.output


def test_defaults(captured: list[ServeConfig]) -> None:
    code, output = _serve([])
    assert code == 0, output
    assert captured == [
        ServeConfig(
            stargate_id=socket.gethostname(),
            http_listen_addr=ListenAddress("0.0.0.0", 8000),
            listen_addr=ListenAddress("0.0.0.0", 50071),
            metrics_port=9090,
            metrics_prefix="stargate_",
            shutdown_drain_timeout_ms=30_000,
            warmup=WarmupConfig(warmup_ms=60_000, sample_interval_ms=1_000, stabilization_window=5),
        )
    ]


def test_flags_override_defaults(captured: list[ServeConfig]) -> None:
    code, output = _serve(
        [
            "--stargate-id=replica-7",
            "--http-listen-addr=127.0.0.1:18000",
            "--listen-addr=[::1]:15071",
            "--metrics-port=0",
            "--metrics-prefix=llm_request_router_",
            "--shutdown-drain-timeout-ms=0",
            "--readiness-warmup-ms=0",
            "--warmup-sample-interval-ms=200",
            "--warmup-stabilization-window=1",
        ]
    )
    assert code == 0, output
    (config,) = captured
    assert config.stargate_id == "replica-7"
    assert config.http_listen_addr == ListenAddress("127.0.0.1", 18000)
    assert config.listen_addr == ListenAddress("::1", 15071)
    assert str(config.listen_addr) == "[::1]:15071"
    assert config.metrics_port == 0
    assert config.metrics_prefix == "llm_request_router_"
    assert config.shutdown_drain_timeout_ms == 0
    assert config.warmup == WarmupConfig(0, 200, 1)


def test_every_flag_reads_its_environment_variable(captured: list[ServeConfig]) -> None:
    env = {
        "STARGATE_ID": "from-env",
        "STARGATE_HTTP_LISTEN_ADDR": "127.0.0.2:8001",
        "STARGATE_LISTEN_ADDR": "127.0.0.3:50072",
        "STARGATE_METRICS_PORT": "9191",
        "STARGATE_METRICS_PREFIX": "x_",
        "STARGATE_SHUTDOWN_DRAIN_TIMEOUT_MS": "1234",
        "STARGATE_READINESS_WARMUP_MS": "5000",
        "STARGATE_WARMUP_SAMPLE_INTERVAL_MS": "250",
        "STARGATE_WARMUP_STABILIZATION_WINDOW": "9",
        "STARGATE_LOG_LEVEL": "warning",
    }
    code, output = _serve([], env)
    assert code == 0, output
    assert captured == [
        ServeConfig(
            stargate_id="from-env",
            http_listen_addr=ListenAddress("127.0.0.2", 8001),
            listen_addr=ListenAddress("127.0.0.3", 50072),
            metrics_port=9191,
            metrics_prefix="x_",
            shutdown_drain_timeout_ms=1234,
            warmup=WarmupConfig(5000, 250, 9),
        )
    ]


def test_flag_wins_over_environment(captured: list[ServeConfig]) -> None:
    code, _ = _serve(["--readiness-warmup-ms=10"], {"STARGATE_READINESS_WARMUP_MS": "99"})
    assert code == 0
    assert captured[0].warmup.warmup_ms == 10


@pytest.mark.parametrize("flag", ["--warmup-sample-interval-ms", "--warmup-stabilization-window"])
def test_zero_sampler_knobs_are_usage_errors_naming_the_flag(
    captured: list[ServeConfig], flag: str
) -> None:
    code, output = _serve([f"{flag}=0"])
    assert code == 2
    assert f"Invalid value for '{flag}'" in output
    assert "value must be greater than 0, got 0" in output
    assert captured == []


def test_zero_sampler_knob_from_environment_is_rejected_too(captured: list[ServeConfig]) -> None:
    code, output = _serve([], {"STARGATE_WARMUP_STABILIZATION_WINDOW": "0"})
    assert code == 2
    assert "'--warmup-stabilization-window'" in output
    assert captured == []


def test_negative_warmup_is_rejected(captured: list[ServeConfig]) -> None:
    code, output = _serve(["--readiness-warmup-ms=-1"])
    assert code == 2
    assert "'--readiness-warmup-ms'" in output


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--http-listen-addr", "localhost:8000", "is not an IP address"),
        ("--http-listen-addr", "0.0.0.0", "is not an IP:PORT socket address"),
        ("--listen-addr", "0.0.0.0:99999", "port must be a number from 0 to 65535"),
        ("--listen-addr", "::1:50071", "must be written in brackets"),
        ("--metrics-port", "70000", "70000 is not in the range"),
        ("--metrics-prefix", "1abc", "cannot start a Prometheus metric name"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    captured: list[ServeConfig], flag: str, value: str, message: str
) -> None:
    code, output = _serve([f"{flag}={value}"])
    assert code == 2, output
    assert f"'{flag}'" in output
    assert message in output
    assert captured == []


def test_occupied_http_address_exits_1_naming_the_listener(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        result = CliRunner().invoke(
            main,
            ["serve", f"--http-listen-addr=127.0.0.1:{port}", "--metrics-port=0"],
        )
    assert result.exit_code == 1
    assert f"failed to bind HTTP listener on 127.0.0.1:{port}" in caplog.text


def test_every_option_has_help_and_an_environment_variable() -> None:
    serve = main.commands["serve"]
    for param in serve.params:
        if param.name == "help":
            continue
        assert getattr(param, "help", None), param.name
        assert param.envvar, param.name


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert "stargate, version" in result.output
