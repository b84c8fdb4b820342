"""`stargate serve` flags: defaults, environment variables, and usage errors."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from stargate import runtime
from stargate.cli import main
from stargate.config import (
    ConfigError,
    ListenAddress,
    PoolOwnershipConfig,
    ProxyConfig,
    SecretsConfig,
    ServeConfig,
    TlsConfig,
    TracingConfig,
    WarmupConfig,
)


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
    assert config.metrics_listen_addr == ListenAddress("0.0.0.0", 0)  # the older flag's host
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
        ("--metrics-listen-addr", "localhost:9090", "is not an IP address"),
        ("--metrics-listen-addr", "9090", "is not an IP:PORT socket address"),
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


# ---- exposure switches: the metrics listener and /debug/state --------------------------------


def test_metrics_listen_addr_from_flag_and_environment(captured: list[ServeConfig]) -> None:
    code, output = _serve(["--metrics-listen-addr=127.0.0.1:9191"])
    assert code == 0, output
    code, output = _serve([], {"STARGATE_METRICS_LISTEN_ADDR": "[::1]:0"})
    assert code == 0, output
    assert [c.metrics_listen_addr for c in captured] == [
        ListenAddress("127.0.0.1", 9191),
        ListenAddress("::1", 0),
    ]
    assert all(c.metrics_port is None for c in captured)  # folded into the address


def test_metrics_defaults_and_the_older_port_flag(captured: list[ServeConfig]) -> None:
    """Without either flag: 0.0.0.0:9090. `--metrics-port` keeps working: the port on 0.0.0.0."""
    for args in ([], ["--metrics-port=9191"]):
        code, output = _serve(args)
        assert code == 0, output
    assert [c.metrics_listen_addr for c in captured] == [
        ListenAddress("0.0.0.0", 9090),
        ListenAddress("0.0.0.0", 9191),
    ]


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--metrics-listen-addr=127.0.0.1:9191", "--metrics-port=9191"], {}),
        # the default address spelled out is still a second way to say it
        (["--metrics-listen-addr=0.0.0.0:9090", "--metrics-port=9191"], {}),
        (["--metrics-listen-addr=127.0.0.1:9191"], {"STARGATE_METRICS_PORT": "9191"}),
        ([], {"STARGATE_METRICS_LISTEN_ADDR": "127.0.0.1:1", "STARGATE_METRICS_PORT": "2"}),
    ],
    ids=["flags", "default-address", "flag-and-env", "env"],
)
def test_metrics_port_with_metrics_listen_addr_is_a_usage_error_naming_both(
    captured: list[ServeConfig], args: list[str], env: dict[str, str]
) -> None:
    code, output = _serve(args, env)
    assert code == 2, output
    assert "--metrics-port cannot be combined with --metrics-listen-addr" in output
    assert captured == []


def test_serve_config_folds_the_older_metrics_port() -> None:
    """Code that builds a `ServeConfig` keeps `metrics_port`; the rule is the CLI's."""
    from stargate.config import ConfigError

    assert ServeConfig("r", metrics_port=0) == ServeConfig(
        "r", metrics_listen_addr=ListenAddress("0.0.0.0", 0)
    )
    with pytest.raises(ConfigError, match="--metrics-port cannot be combined"):
        ServeConfig("r", metrics_listen_addr=ListenAddress("127.0.0.1", 1), metrics_port=2)
    with pytest.raises(ConfigError, match=r"--metrics-port\) must be from 0 to 65535"):
        ServeConfig("r", metrics_port=70_000)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ([], {}, True),  # parity with the Rust router
        (["--no-debug-endpoints"], {}, False),
        (["--debug-endpoints"], {}, True),
        ([], {"STARGATE_DEBUG_ENDPOINTS": "false"}, False),
        (["--debug-endpoints"], {"STARGATE_DEBUG_ENDPOINTS": "false"}, True),  # the flag wins
    ],
)
def test_debug_endpoints_switch(
    captured: list[ServeConfig], args: list[str], env: dict[str, str], expected: bool
) -> None:
    code, output = _serve(args, env)
    assert code == 0, output
    assert captured[0].debug_endpoints is expected


def test_debug_endpoints_bad_environment_value_names_the_flag(captured: list[ServeConfig]) -> None:
    code, output = _serve([], {"STARGATE_DEBUG_ENDPOINTS": "sometimes"})
    assert code == 2, output
    assert "--debug-endpoints" in output
    assert captured == []


def test_demo_metrics_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stargate demo` binds like its other listeners (127.0.0.1); `--metrics-port` sets the port
    there; both flags at once is the same usage error as for `serve`."""
    from stargate import demo

    configs: list[demo.DemoConfig] = []

    async def fake_run_demo(config: demo.DemoConfig) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    runner = CliRunner()
    for args in ([], ["--metrics-port=9191"], ["--metrics-listen-addr=0.0.0.0:9292"]):
        result = runner.invoke(main, ["demo", *args], env={})
        assert result.exit_code == 0, result.output
    assert [c.metrics_listen_addr for c in configs] == [
        ListenAddress("127.0.0.1", 9090),
        ListenAddress("127.0.0.1", 9191),
        ListenAddress("0.0.0.0", 9292),
    ]
    result = runner.invoke(
        main, ["demo", "--metrics-port=1", "--metrics-listen-addr=127.0.0.1:2"], env={}
    )
    assert result.exit_code == 2
    assert "--metrics-port cannot be combined with --metrics-listen-addr" in result.output


def test_client_limit_flags(captured: list[ServeConfig]) -> None:
    """`--request-body-timeout-ms` and `--max-client-connections`: defaults (the cap `auto`,
    None: computed at start-up), flags, environment variables, and an explicit 0 (which disables
    each)."""
    code, output = _serve([])
    assert code == 0, output
    assert captured[-1].request_body_timeout_ms == 30_000
    assert captured[-1].request_body_timeout_seconds == 30.0
    assert captured[-1].max_client_connections is None
    for spelling in ("auto", "AUTO", " auto "):
        code, output = _serve([f"--max-client-connections={spelling}"])
        assert code == 0, output
        assert captured[-1].max_client_connections is None
    code, output = _serve([], {"STARGATE_MAX_CLIENT_CONNECTIONS": "auto"})
    assert code == 0, output
    assert captured[-1].max_client_connections is None
    code, output = _serve(["--request-body-timeout-ms=0", "--max-client-connections=0"])
    assert code == 0, output
    assert captured[-1].request_body_timeout_seconds is None
    assert captured[-1].max_client_connections == 0
    env = {"STARGATE_REQUEST_BODY_TIMEOUT_MS": "1500", "STARGATE_MAX_CLIENT_CONNECTIONS": "20"}
    code, output = _serve([], env)
    assert code == 0, output
    assert (captured[-1].request_body_timeout_ms, captured[-1].max_client_connections) == (1500, 20)


def test_max_client_connections_takes_auto_or_a_count(captured: list[ServeConfig]) -> None:
    code, output = _serve(["--max-client-connections=many"])
    assert code == 2
    assert "'--max-client-connections'" in output and "expected auto or an integer" in output
    assert captured == []


@pytest.mark.parametrize("flag", ["--request-body-timeout-ms", "--max-client-connections"])
def test_negative_client_limits_are_usage_errors_naming_the_flag(
    captured: list[ServeConfig], flag: str
) -> None:
    code, output = _serve([f"{flag}=-1"])
    assert code == 2
    assert f"'{flag}'" in output
    assert captured == []


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("request_body_timeout_ms", "--request-body-timeout-ms"),
        ("max_client_connections", "--max-client-connections"),
    ],
)
def test_serve_config_names_the_flag_of_a_negative_client_limit(field: str, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ServeConfig(stargate_id="x", **{field: -1})  # type: ignore[arg-type]


def test_max_connections_per_backend_flag(captured: list[ServeConfig]) -> None:
    """`--proxy-max-connections-per-backend`: default 1024, flag, environment variable; 0 and
    negative values are usage errors naming the flag, in the CLI and in `ProxyConfig`."""
    code, output = _serve([])
    assert code == 0, output
    assert captured[-1].proxy.max_connections_per_backend == 1024
    code, output = _serve(["--proxy-max-connections-per-backend=4096"])
    assert code == 0, output
    assert captured[-1].proxy.max_connections_per_backend == 4096
    code, output = _serve([], {"STARGATE_PROXY_MAX_CONNECTIONS_PER_BACKEND": "2"})
    assert code == 0, output
    assert captured[-1].proxy.max_connections_per_backend == 2
    for bad in ("0", "-1"):
        captured.clear()
        code, output = _serve([f"--proxy-max-connections-per-backend={bad}"])
        assert code == 2
        assert "'--proxy-max-connections-per-backend'" in output
        assert captured == []
    with pytest.raises(ConfigError, match="--proxy-max-connections-per-backend"):
        ProxyConfig(max_connections_per_backend=0)
    result = CliRunner().invoke(main, ["serve", "--help"], env={})
    assert "--proxy-max-connections-per-backend" in result.output
    assert "STARGATE_PROXY_MAX_CONNECTIONS_PER_BACKEND" in result.output


def test_derive_affinity_key_flags(captured: list[ServeConfig]) -> None:
    """`--derive-affinity-key` (off by default), `--derive-affinity-key-block-bytes` (default 256)
    and `--derive-affinity-key-depth` (default 64): flags and environment variables; 0, negative
    and non-numeric values are usage errors naming the flag, in the CLI and in `ProxyConfig`, and
    so is a product above 16 MiB."""
    code, output = _serve([])
    assert code == 0, output
    proxy = captured[-1].proxy
    assert proxy.derive_affinity_key is False
    assert (proxy.derive_affinity_key_block_bytes, proxy.derive_affinity_key_depth) == (256, 64)
    code, output = _serve(
        [
            "--derive-affinity-key",
            "--derive-affinity-key-block-bytes=512",
            "--derive-affinity-key-depth=8",
        ]
    )
    assert code == 0, output
    proxy = captured[-1].proxy
    assert proxy.derive_affinity_key is True
    assert (proxy.derive_affinity_key_block_bytes, proxy.derive_affinity_key_depth) == (512, 8)
    env = {
        "STARGATE_DERIVE_AFFINITY_KEY": "true",
        "STARGATE_DERIVE_AFFINITY_KEY_BLOCK_BYTES": "64",
        "STARGATE_DERIVE_AFFINITY_KEY_DEPTH": "3",
    }
    code, output = _serve([], env)
    assert code == 0, output
    proxy = captured[-1].proxy
    assert proxy.derive_affinity_key is True
    assert (proxy.derive_affinity_key_block_bytes, proxy.derive_affinity_key_depth) == (64, 3)
    for flag in ("--derive-affinity-key-block-bytes", "--derive-affinity-key-depth"):
        for bad in ("0", "-1", "x"):
            captured.clear()
            code, output = _serve([f"{flag}={bad}"])
            assert code == 2
            assert f"'{flag}'" in output
            assert captured == []
    with pytest.raises(ConfigError, match="--derive-affinity-key-block-bytes"):
        ProxyConfig(derive_affinity_key_block_bytes=0)
    with pytest.raises(ConfigError, match="--derive-affinity-key-depth"):
        ProxyConfig(derive_affinity_key_depth=0)
    with pytest.raises(ConfigError, match="at most 16777216 bytes"):
        ProxyConfig(derive_affinity_key_block_bytes=1 << 20, derive_affinity_key_depth=17)
    code, output = _serve(
        ["--derive-affinity-key-block-bytes=1048576", "--derive-affinity-key-depth=17"]
    )
    assert code == 2 and "--derive-affinity-key-depth" in output
    result = CliRunner().invoke(main, ["serve", "--help"], env={})
    assert "--derive-affinity-key-block-bytes" in result.output
    assert "--derive-affinity-key-depth" in result.output
    assert "STARGATE_DERIVE_AFFINITY_KEY" in result.output


# --- TLS, the replica's own credentials, tracing (issue 15) --------------------------------------


def test_tls_credentials_and_tracing_flags_from_the_environment(
    captured: list[ServeConfig], tmp_path: Path
) -> None:
    for name in ("tls.crt", "tls.key", "secrets.json", "gateway-ca.pem"):
        (tmp_path / name).write_text("")
    env = {
        "STARGATE_TLS_CERT_PATH": str(tmp_path / "tls.crt"),
        "STARGATE_TLS_KEY_PATH": str(tmp_path / "tls.key"),
        "STARGATE_TLS_RELOAD_INTERVAL_MS": "2000",
        "STARGATE_WORKER_AUTH_ENDPOINT": "https://gateway:9090",
        "STARGATE_WORKER_AUTH_CA_FILE": str(tmp_path / "gateway-ca.pem"),
        "SECRETS_PATH": str(tmp_path / "secrets.json"),  # the Rust router's variable names
        "SECRETS_JSON_PATH": "nvcfApiToken",
        "OAUTH2_PROVIDER_HOST": "https://idp.example",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_SERVICE_NAME": "router-a",
    }
    code, output = _serve([], env)
    assert code == 0, output
    (config,) = captured
    assert config.tls == TlsConfig(tmp_path / "tls.crt", tmp_path / "tls.key", 2000)
    assert config.secrets == SecretsConfig(tmp_path / "secrets.json", "nvcfApiToken")
    assert config.control_plane.worker_auth_endpoint == "https://gateway:9090"
    assert config.control_plane.worker_auth_ca_file == tmp_path / "gateway-ca.pem"
    assert config.control_plane.oauth2_provider_host == "https://idp.example"
    assert config.tracing == TracingConfig("http://collector:4317", "router-a")


def test_tls_credentials_and_tracing_are_off_by_default(captured: list[ServeConfig]) -> None:
    code, output = _serve([])
    assert code == 0, output
    (config,) = captured
    assert config.tls is None
    assert config.secrets == SecretsConfig(None, "authToken")
    assert config.tracing == TracingConfig(None, "stargate") and not config.tracing.enabled


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("--tls-cert-path", "--tls-key-path is required with --tls-cert-path"),
        ("--tls-key-path", "--tls-cert-path is required with --tls-key-path"),
        ("--secrets-path", None),  # alone it is fine
    ],
)
def test_half_a_tls_pair_is_a_usage_error(
    captured: list[ServeConfig], tmp_path: Path, given: str, message: str | None
) -> None:
    (tmp_path / "f").write_text("{}")
    code, output = _serve([f"{given}={tmp_path / 'f'}"])
    if message is None:
        assert code == 0, output
        return
    assert code == 2, output
    assert message in output
    assert captured == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--oauth2-provider-host=https://idp"], "--oauth2-provider-host requires --secrets-path"),
        (["--oauth2-provider-host=idp:443", "--secrets-path={f}"], "must be an http:// or"),
        (["--worker-auth-ca-file={f}"], "--worker-auth-ca-file requires --worker-auth-endpoint"),
        (
            ["--worker-auth-ca-file={f}", "--worker-auth-endpoint=http://gw:9090"],
            "--worker-auth-ca-file dials the gateway over TLS",
        ),
        (["--secrets-json-path=a..b"], "--secrets-json-path must be dot-separated keys"),
        (["--otel-endpoint=collector:4317"], "--otel-endpoint must be an OTLP/gRPC collector URL"),
        (["--otel-service-name= "], "--otel-service-name must not be empty"),
        (["--tls-reload-interval-ms=0"], "value must be greater than 0"),
    ],
)
def test_bad_credentials_and_tracing_settings_are_usage_errors(
    captured: list[ServeConfig], tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "f").write_text("{}")
    code, output = _serve([arg.format(f=tmp_path / "f") for arg in args])
    assert code == 2, output
    assert message in output
    assert captured == []


def test_serve_help_groups_tls_worker_auth_and_tracing_flags() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200)
    text = result.output
    headings = [text.index(h) for h in ("Options:", "TLS:", "Worker authentication:", "Tracing:")]
    assert headings == sorted(headings)
    tls = text[text.index("TLS:") : text.index("Worker authentication:")]
    assert "--tls-cert-path" in tls and "--tls-reload-interval-ms" in tls
    auth = text[text.index("Worker authentication:") : text.index("Tracing:")]
    for flag in ("--worker-auth-endpoint", "--secrets-path", "--oauth2-provider-host"):
        assert flag in auth
    assert "--otel-endpoint" in text[text.index("Tracing:") :]
    assert "--tls-cert-path" not in text[: text.index("TLS:")]


# --- shared model pools (issue 16, docs/pool-ownership.md) ---------------------------------------


def test_pool_ownership_flags(captured: list[ServeConfig], tmp_path: Path) -> None:
    (tmp_path / "pools.yaml").write_text("pools: []\n")
    env = {
        "STARGATE_POOL_CONFIG": str(tmp_path / "pools.yaml"),
        "STARGATE_POOL_OWNERSHIP": "lease",
        "STARGATE_POOL_LEASE_NAMESPACE": "llm",
        "STARGATE_POOL_LEASE_PREFIX": "router",
        "STARGATE_POOL_LEASE_DURATION_MS": "9000",
        "STARGATE_POOL_LEASE_RENEW_DEADLINE_MS": "6000",
        "STARGATE_POOL_LEASE_RETRY_PERIOD_MS": "1000",
        "STARGATE_POOL_OWNER_URL": "http://10.0.0.7:8000/",
    }
    code, output = _serve([], env)
    assert code == 0, output
    (config,) = captured
    assert config.activator.ownership == PoolOwnershipConfig(
        "lease", "llm", "router", 9000, 6000, 1000, "http://10.0.0.7:8000"
    )
    captured.clear()
    code, output = _serve([])
    assert code == 0, output
    assert captured[0].activator.ownership == PoolOwnershipConfig()  # local, CLI defaults


def test_pool_breaker_flags(captured: list[ServeConfig]) -> None:
    """docs/activator.md, "Breaker": defaults 3 failures and 30 s; 0 failures turns it off;
    env vars work; a bad value is a usage error naming the flag."""
    code, output = _serve([])
    assert code == 0, output
    assert (captured[0].activator.breaker_failures, captured[0].activator.breaker_cooldown_ms) == (
        3,
        30_000,
    )
    captured.clear()
    env = {"STARGATE_POOL_BREAKER_FAILURES": "0", "STARGATE_POOL_BREAKER_COOLDOWN_MS": "5000"}
    code, output = _serve([], env)
    assert code == 0, output
    assert (captured[0].activator.breaker_failures, captured[0].activator.breaker_cooldown_ms) == (
        0,
        5_000,
    )
    captured.clear()
    for bad in ("--pool-breaker-failures=-1", "--pool-breaker-cooldown-ms=0"):
        code, output = _serve([bad])
        assert code == 2, output
        assert bad.split("=")[0] in output
    assert captured == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pool-ownership=lease"], "--pool-ownership=lease requires --pool-config"),
        (["--pool-ownership=raft"], "'raft' is not one of 'local', 'lease'"),
        (["--pool-lease-renew-deadline-ms=20000"], "must satisfy 0 < --pool-lease-retry-period-ms"),
        (["--pool-lease-prefix=Router_A"], "--pool-lease-prefix must be a DNS label"),
        (["--pool-owner-url=10.0.0.7:8000"], "--pool-owner-url must be this replica's"),
    ],
)
def test_bad_pool_ownership_settings_are_usage_errors(
    captured: list[ServeConfig], args: list[str], message: str
) -> None:
    code, output = _serve(args)
    assert code == 2, output
    assert message in output
    assert captured == []


def test_outlier_and_slow_start_flags(captured: list[ServeConfig]) -> None:
    """docs/outliers.md: both on by default (5 failures, 30 s base, 300 s max, 10 %, 10 s decay;
    a 30 s linear window with a 10 % floor); flags and environment variables; out-of-range
    values, and a max below the base, are usage errors naming the flag."""
    code, output = _serve([])
    assert code == 0, output
    p = captured[-1].proxy
    assert (p.outlier_consecutive_failures, p.outlier_base_ejection_ms) == (5, 30_000)
    assert (p.outlier_max_ejection_ms, p.outlier_max_ejection_percent) == (300_000, 10)
    assert p.outlier_decay_interval_ms == 10_000
    assert (p.slow_start_window_ms, p.slow_start_aggression) == (30_000, 1.0)
    assert p.slow_start_min_weight_percent == 10.0
    code, output = _serve(
        [
            "--outlier-consecutive-failures=0",
            "--slow-start-window-ms=0",
            "--slow-start-aggression=2",
        ]
    )
    assert code == 0, output
    p = captured[-1].proxy
    assert (p.outlier_consecutive_failures, p.slow_start_window_ms) == (0, 0)
    assert p.slow_start_aggression == 2.0
    env = {
        "STARGATE_OUTLIER_CONSECUTIVE_FAILURES": "3",
        "STARGATE_OUTLIER_BASE_EJECTION_MS": "1000",
        "STARGATE_OUTLIER_MAX_EJECTION_MS": "2000",
        "STARGATE_OUTLIER_MAX_EJECTION_PERCENT": "50",
        "STARGATE_OUTLIER_DECAY_INTERVAL_MS": "500",
        "STARGATE_SLOW_START_WINDOW_MS": "5000",
        "STARGATE_SLOW_START_AGGRESSION": "0.5",
        "STARGATE_SLOW_START_MIN_WEIGHT_PERCENT": "2.5",
    }
    code, output = _serve([], env)
    assert code == 0, output
    p = captured[-1].proxy
    assert (p.outlier_consecutive_failures, p.outlier_base_ejection_ms) == (3, 1_000)
    assert (p.outlier_max_ejection_ms, p.outlier_max_ejection_percent) == (2_000, 50)
    assert p.outlier_decay_interval_ms == 500
    assert (p.slow_start_window_ms, p.slow_start_aggression) == (5_000, 0.5)
    assert p.slow_start_min_weight_percent == 2.5
    for flag, bad in (
        ("--outlier-consecutive-failures", "-1"),
        ("--outlier-base-ejection-ms", "0"),
        ("--outlier-max-ejection-ms", "0"),
        ("--outlier-max-ejection-percent", "101"),
        ("--outlier-decay-interval-ms", "0"),
        ("--slow-start-window-ms", "-1"),
        ("--slow-start-aggression", "0"),
        ("--slow-start-min-weight-percent", "100.5"),
    ):
        captured.clear()
        code, output = _serve([f"{flag}={bad}"])
        assert code == 2, (flag, output)
        assert f"'{flag}'" in output
        assert captured == []
    code, output = _serve(["--outlier-max-ejection-ms=1000"])  # below the 30 s base
    assert code == 2 and "--outlier-max-ejection-ms" in output
    assert captured == []


def test_an_http_stack_the_patches_were_not_written_for_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whichever command first loads the serving code, a refused patch table is the table's own
    message and exit 1, not a traceback."""
    from stargate import hypercorn_patches

    def refuse(*args: object, **kwargs: object) -> None:
        raise hypercorn_patches.PatchTableMismatch("refusing to start: hypercorn 9.9 is installed")

    monkeypatch.setattr(runtime, "run", refuse)
    result = CliRunner().invoke(
        main, ["serve", "--readiness-warmup-ms=0", "--disable-dns-discovery"]
    )
    assert result.exit_code == 1
    assert "refusing to start: hypercorn 9.9 is installed" in result.output
    assert "Traceback" not in result.output
