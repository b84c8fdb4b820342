"""The Helm chart in helm/stargate, rendered offline (no cluster, no helm binary).

Each rendering is checked three ways: every manifest against the Kubernetes 1.30 OpenAPI schemas
(kubernetes-validate, strict: unknown fields fail), the rendered YAML with yamllint (relaxed), and
the container's `args` fed to the real `stargate serve` click parser. The values schema is
exercised through `Chart.validate_schema`.

Needs helm-python-sdk, kubernetes-validate and yamllint (`nox -s helm`); the regular test session
skips this module when they are missing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
yamllint_linter = pytest.importorskip("yamllint.linter")
yamllint_config = pytest.importorskip("yamllint.config")

import click  # noqa: E402
import yaml  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from stargate import __version__, runtime  # noqa: E402
from stargate import cli as stargate_cli  # noqa: E402
from stargate.activator.config import load_pool_config  # noqa: E402
from stargate.cli import main  # noqa: E402
from stargate.config import (  # noqa: E402
    Connectivity,
    ListenAddress,
    PoolOwnershipConfig,
    SecretsConfig,
    ServeConfig,
    TlsConfig,
    TracingConfig,
    TunnelConfig,
    TunnelProtocol,
    WarmupConfig,
)

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "stargate"
RELEASE = "router"
NAMESPACE = "llm"
FULLNAME = "router-stargate"
HEADLESS_FQDN = f"{FULLNAME}-headless.{NAMESPACE}.svc.cluster.local"
KUBERNETES_VERSION = "1.30.0"
POOL_CONFIG_PATH = "/etc/stargate/pools.yaml"
SAMPLE_POD = {"$(POD_NAME)": "router-stargate-0", "$(POD_IP)": "10.1.2.3"}

POOLS = {
    "pools": [
        {
            "name": "gpu1",
            "members": ["model-c", "model-d"],
            "swapBudget": "300s",
            "controller": {
                "kind": "kubernetes",
                "namespace": NAMESPACE,
                "members": {
                    "model-c": {"kind": "Deployment", "name": "vllm-c"},
                    "model-d": {
                        "apiVersion": "inference.llmkube.dev/v1alpha1",
                        "kind": "InferenceService",
                        "name": "small",
                    },
                },
            },
        }
    ]
}


# ----------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    loaded = helm_python.Chart.load(CHART_DIR)
    try:
        yield loaded
    finally:
        loaded.close()


class Rendering:
    """One `helm template`: the raw text per template file and the parsed manifests."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.manifests: list[dict[str, Any]] = [
            doc for text in files.values() for doc in yaml.safe_load_all(text) if doc
        ]

    def kinds(self) -> list[str]:
        return sorted(m["kind"] for m in self.manifests)

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [
            m
            for m in self.manifests
            if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)
        ]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
        return found[0]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    @property
    def statefulset(self) -> dict[str, Any]:
        return self.one("StatefulSet")

    @property
    def pod(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.statefulset["spec"]["template"]["spec"]
        return spec

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.pod["containers"]
        return dict(container)

    @property
    def args(self) -> list[str]:
        return list(self.container["args"])


def render(chart: Any, values: dict[str, Any] | None = None) -> Rendering:
    """Render, then validate every manifest (kubernetes-validate strict) and lint the YAML."""
    files = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    rendering = Rendering(files)
    # yamllint -d relaxed over the stream as `helm template` prints it: errors fail (as its exit
    # status does); warnings (toYaml's unindented sequences, long lines) are tolerated.
    stream = "".join(
        f"---\n# Source: {path}\n{text.strip()}\n"
        for path, text in sorted(files.items())
        if text.strip()
    )
    lint_config = yamllint_config.YamlLintConfig("extends: relaxed")
    lines = stream.splitlines()
    problems = [
        f"{p.line}:{p.column} [{p.level}] {p.message} ({p.rule}): {lines[p.line - 1]!r}"
        for p in yamllint_linter.run(stream, lint_config)
        if p.level == "error"
    ]
    assert not problems, "\n".join(problems)
    for manifest in rendering.manifests:
        if manifest["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: kubernetes-validate only knows the built-in kinds
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            kind, name = manifest["kind"], manifest["metadata"]["name"]
            raise AssertionError(f"{kind} {name}: {error.message} at {list(error.path)}") from None
    return rendering


def substitute(args: list[str], files: dict[str, str] | None = None) -> list[str]:
    """What the kubelet would pass: $(VAR) expanded with a sample pod, file paths remapped."""
    out = []
    for arg in args:
        for var, sample in SAMPLE_POD.items():
            arg = arg.replace(var, sample)
        for container_path, local_path in (files or {}).items():
            arg = arg.replace(container_path, local_path)
        out.append(arg)
    return out


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse args with the real `stargate serve`; `runtime.run` only records the config."""
    for name in list(os.environ):
        if name.startswith("STARGATE_"):
            monkeypatch.delenv(name)
    configs: list[ServeConfig] = []

    def fake_run(config: ServeConfig) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(runtime, "run", fake_run)

    def parse(args: list[str]) -> tuple[int, str, ServeConfig | None]:
        configs.clear()
        result = CliRunner().invoke(main, ["serve", *args])
        return result.exit_code, result.output, (configs[0] if configs else None)

    return parse


def flag_values(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.split("=", 1)[0] == flag]


# ----------------------------------------------------------------------------------------------
# chart metadata, lint, defaults


def test_chart_metadata_matches_the_package(chart: Any) -> None:
    meta = chart.metadata
    assert meta["apiVersion"] == "v2"
    assert meta["name"] == "stargate"
    assert meta["version"] == "0.1.0"
    assert meta["appVersion"] == __version__


def test_helm_lint_is_clean() -> None:
    report = helm_python.lint(CHART_DIR, strict=True, kube_version="v" + KUBERNETES_VERSION)
    errors = [m for m in report["messages"] if m["severity"] >= 2]
    assert not errors and not report["errors"], report


def test_default_values_pass_the_schema(chart: Any) -> None:
    chart.validate_schema({})
    chart.validate_schema(chart.values)


DEFAULT_ARGS = [
    "--stargate-id=$(POD_NAME)",
    "--http-listen-addr=0.0.0.0:8000",
    "--listen-addr=0.0.0.0:50071",
    "--model-discovery-listen-addr=0.0.0.0:50073",
    "--advertise-addr=$(POD_IP):50071",
    f"--stargate-discovery-dns-name={HEADLESS_FQDN}",
    "--metrics-listen-addr=0.0.0.0:9090",
    "--shutdown-delay-ms=5000",
    "--shutdown-drain-timeout-ms=30000",
]


def test_default_rendering(chart: Any, cli: Any) -> None:
    r = render(chart)
    assert r.kinds() == [
        "PodDisruptionBudget",
        "Service",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    sts = r.statefulset
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec["serviceName"] == f"{FULLNAME}-headless"
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"] == {"type": "RollingUpdate"}
    assert spec["minReadySeconds"] == 10
    assert r.pod["terminationGracePeriodSeconds"] == 5 + 30 + 5  # leave + drain + margin
    assert r.pod["automountServiceAccountToken"] is False

    c = r.container
    assert c["image"] == f"stargate:{__version__}"
    assert c["command"] == ["stargate", "serve"]
    assert r.args == DEFAULT_ARGS  # the warmup flags are absent: the CLI defaults apply
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "POD_IP": "status.podIP",
    }
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 50071, "discovery": 50073, "metrics": 9090}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http", "scheme": "HTTP"}
    assert c["readinessProbe"]["periodSeconds"] == 2
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTP"}

    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert r.pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert set(c["resources"]) == {"requests", "limits"}

    pdb = r.one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]

    code, output, config = cli(substitute(r.args))
    assert code == 0, output
    assert config == ServeConfig(
        stargate_id="router-stargate-0",
        advertise_addr=ListenAddress("10.1.2.3", 50071),
        warmup=WarmupConfig(),  # 60000 / 1000 / 5
        discovery=config.discovery,
    )
    assert config.discovery.dns_name == HEADLESS_FQDN


def test_services_split_readiness(chart: Any) -> None:
    """Clients: ClusterIP backed by ready pods only. Pylons and peers: headless, not-ready too."""
    r = render(chart)
    selector = r.statefulset["spec"]["selector"]["matchLabels"]
    client = r.one("Service", FULLNAME)["spec"]
    assert client["type"] == "ClusterIP"
    assert "publishNotReadyAddresses" not in client and "clusterIP" not in client
    assert {p["name"]: p["port"] for p in client["ports"]} == {"http": 8000, "discovery": 50073}
    assert client["selector"] == selector

    headless = r.one("Service", f"{FULLNAME}-headless")["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["publishNotReadyAddresses"] is True
    ports = {p["name"]: p["port"] for p in headless["ports"]}
    assert ports == {"grpc": 50071, "discovery": 50073, "http": 8000}
    assert {p["targetPort"] for p in headless["ports"]} == set(ports)  # named container ports
    assert headless["selector"] == selector


# ----------------------------------------------------------------------------------------------
# presence-aware warmup flags and integer formatting


def test_warmup_disabled_renders_zero(chart: Any, cli: Any) -> None:
    r = render(chart, {"readiness": {"warmupMs": 0}})
    assert "--readiness-warmup-ms=0" in r.args
    assert flag_values(r.args, "--warmup-sample-interval-ms") == []
    code, output, config = cli(substitute(r.args))
    assert code == 0, output
    assert config is not None and config.warmup == WarmupConfig(0, 1_000, 5)


def test_zero_sample_interval_reaches_the_cli_which_rejects_it(chart: Any, cli: Any) -> None:
    values = {"readiness": {"warmupSampleIntervalMs": 0}}
    chart.validate_schema(values)  # the schema lets 0 through: the CLI is the authority
    r = render(chart, values)
    assert "--warmup-sample-interval-ms=0" in r.args
    code, output, config = cli(substitute(r.args))
    assert code == 2, output
    assert "--warmup-sample-interval-ms" in output
    assert config is None


def test_zero_stabilization_window_reaches_the_cli(chart: Any, cli: Any) -> None:
    r = render(chart, {"readiness": {"warmupStabilizationWindow": 0}})
    assert "--warmup-stabilization-window=0" in r.args
    code, output, _ = cli(substitute(r.args))
    assert code == 2 and "--warmup-stabilization-window" in output, output


def test_large_values_render_as_plain_integers(chart: Any, cli: Any) -> None:
    values = {
        "readiness": {"warmupMs": 100_000_000, "warmupSampleIntervalMs": 1_000_000},
        "minReadySeconds": 5_000_000,
        "shutdown": {"delayMs": 0, "drainTimeoutMs": 1_000_001},
        "serve": {"proxyMaxReplayBodyBytes": 1_000_000_000, "grpcMaxMessageBytes": 16_777_216},
    }
    r = render(chart, values)
    text = "\n".join(r.files.values())
    assert "e+" not in text
    assert "--readiness-warmup-ms=100000000" in r.args
    assert "--warmup-sample-interval-ms=1000000" in r.args
    assert "--shutdown-drain-timeout-ms=1000001" in r.args
    assert "--proxy-max-replay-body-bytes=1000000000" in r.args
    assert "--grpc-max-message-bytes=16777216" in r.args
    assert r.statefulset["spec"]["minReadySeconds"] == 5_000_000
    assert r.pod["terminationGracePeriodSeconds"] == 1_001 + 5  # ceil(1000.001 s) + margin
    code, output, config = cli(substitute(r.args))
    assert code == 0, output
    assert config is not None
    assert config.warmup == WarmupConfig(100_000_000, 1_000_000, 5)
    assert config.shutdown_drain_timeout_ms == 1_000_001
    assert config.proxy.max_replay_body_bytes == 1_000_000_000


@pytest.mark.parametrize(
    ("delay_ms", "drain_ms", "margin", "grace"),
    [
        (0, 30_000, 5, 35),
        (5_000, 30_000, 5, 40),
        (0, 0, 5, 5),
        (0, 1, 0, 1),
        (500, 501, 0, 2),
        (1_000, 29_001, 2, 33),
        (10_000, 45_000, 10, 65),
    ],
)
def test_termination_grace_is_delay_plus_drain_rounded_up_plus_margin(
    chart: Any, cli: Any, delay_ms: int, drain_ms: int, margin: int, grace: int
) -> None:
    values = {
        "shutdown": {
            "delayMs": delay_ms,
            "drainTimeoutMs": drain_ms,
            "terminationGraceMarginSeconds": margin,
        }
    }
    r = render(chart, values)
    assert r.pod["terminationGracePeriodSeconds"] == grace
    assert f"--shutdown-delay-ms={delay_ms}" in r.args
    assert f"--shutdown-drain-timeout-ms={drain_ms}" in r.args
    code, output, config = cli(substitute(r.args))
    assert code == 0, output
    assert config is not None
    assert (config.shutdown_delay_ms, config.shutdown_drain_timeout_ms) == (delay_ms, drain_ms)


def test_min_ready_seconds_must_cover_the_stability_window(chart: Any) -> None:
    # 2 s x 8 samples = 16 s > 10 s
    too_long = {"readiness": {"warmupSampleIntervalMs": 2_000, "warmupStabilizationWindow": 8}}
    with pytest.raises(helm_python.HelmError, match="minReadySeconds"):
        chart.render(too_long, name=RELEASE, namespace=NAMESPACE)
    assert (
        render(chart, {**too_long, "minReadySeconds": 16}).statefulset["spec"]["minReadySeconds"]
        == 16
    )
    # a warmup deadline shorter than the window caps it; warmup disabled needs nothing
    render(chart, {"readiness": {**too_long["readiness"], "warmupMs": 10_000}})
    render(chart, {"readiness": {**too_long["readiness"], "warmupMs": 0}, "minReadySeconds": 0})


# ----------------------------------------------------------------------------------------------
# every `stargate serve` flag is reachable from values


def test_every_serve_flag_is_reachable(chart: Any, cli: Any, tmp_path: Path) -> None:
    files = {}
    contents = [("token", "s3cret\n"), ("lb.json", "{}\n"), ("ca.pem", ""), ("secrets.json", "{}")]
    for name, content in [*contents, ("tls.crt", ""), ("tls.key", "")]:
        (tmp_path / name).write_text(content)
        files[name] = str(tmp_path / name)
    pool_file = tmp_path / "pools.yaml"
    pool_file.write_text(yaml.safe_dump(POOLS))
    values = {
        "replicaCount": 1,
        "ports": {"http": 18000, "grpc": 15071, "discovery": 15073, "metrics": 19090},
        "readiness": {"warmupMs": 0, "warmupSampleIntervalMs": 250, "warmupStabilizationWindow": 3},
        "shutdown": {"delayMs": 250, "drainTimeoutMs": 0},
        "serve": {
            "stargateId": "replica-x",
            "advertiseAddr": "10.9.9.9:15071",
            "peer": ["10.0.0.1:15071", "b=10.0.0.2:15071"],  # replaces the DNS name
            "disableDnsDiscovery": False,  # a switch: false renders nothing (see below)
            "peerAbsentAfterMs": 0,
            "dnsPollMs": 250,
            "watchHeartbeatMs": 0,
            "remoteStargateUrl": ["http://other-region:50071"],
            "grpcPylonDialAddr": "lb.example:50071",
            "registrationUpdateIdleTimeoutMs": 0,
            "registrationUpdateMaxIdleTimeoutMs": 0,
            "grpcMaxMessageBytes": 16_777_216,
            "workerAuthEndpoint": "auth.example:9090",  # excludes a token file (see below)
            "workerAuthCaFile": files["ca.pem"],
            "secretsPath": files["secrets.json"],
            "secretsJsonPath": "nvcf.apiToken",
            "oauth2ProviderHost": "https://login.example",
            "healthCheckTimeoutMs": 1_500,
            "backendConnectivity": "reverse",
            "tunnelProtocol": "http3",
            "directQuicConnections": 3,
            "reverseTunnelListenAddr": "0.0.0.0:15072",
            "reverseTunnelPylonDialAddr": "udp-lb.example:15072",
            "reverseTunnelConnectTimeoutMs": 0,
            "quicConnectTimeoutMs": 1_500,
            "quicRequestTimeoutMs": 60_000,
            "quicInsecure": True,
            "quicTlsCertPath": files["tls.crt"],
            "quicTlsKeyPath": files["tls.key"],
            "proxyMaxConnectRetries": 0,
            "proxyMaxRequestRetries": 0,
            "proxyMaxReplayBodyBytes": 1_000_000,
            "proxyRequirePylonRetrySignal": False,
            "proxyRetryBudgetHeader": "",
            "proxyResponseHeaderTimeoutMs": 120_000,
            "proxyConnectTimeoutMs": 2_000,
            "proxyMaxConnectionsPerBackend": 4_096,
            "acceptOpenaiRequests": True,
            "unmeasuredBackends": "exclude",
            "outlierConsecutiveFailures": 0,  # an explicit 0 (off) reaches the CLI
            "outlierBaseEjectionMs": 15_000,
            "outlierMaxEjectionMs": 120_000,
            "outlierMaxEjectionPercent": 50,
            "outlierDecayIntervalMs": 5_000,
            "slowStartWindowMs": 0,  # an explicit 0 (off) reaches the CLI
            "slowStartAggression": 1.5,
            "slowStartMinWeightPercent": 25,
            "deriveAffinityKey": True,
            "deriveAffinityKeyBlockBytes": 512,
            "deriveAffinityKeyDepth": 16,
            "loadingComments": False,  # a toggle: false renders --no-loading-comments
            "loadingCommentIntervalMs": 2500,
            "lbConfigPath": files["lb.json"],
            "upstreamCaFile": files["ca.pem"],
            "tlsCertPath": files["tls.crt"],
            "tlsKeyPath": files["tls.key"],
            "tlsReloadIntervalMs": 5_000,
            "otelEndpoint": "http://collector.example:4317",
            "otelServiceName": "router-x",
            "poolConfig": str(pool_file),
            "poolResyncIntervalMs": 2_500,
            "poolControllerTimeoutMs": 4_000,
            "poolBreakerFailures": 0,  # an explicit 0 (breaker off) reaches the CLI
            "poolBreakerCooldownMs": 45_000,
            "poolOwnership": "lease",
            "poolLeaseNamespace": "llm-leases",
            "poolLeasePrefix": "router-x",
            "poolLeaseDurationMs": 9_000,
            "poolLeaseRenewDeadlineMs": 6_000,
            "poolLeaseRetryPeriodMs": 1_000,
            "poolOwnerUrl": "http://10.9.9.9:18000",
            "requestBodyTimeoutMs": 0,  # an explicit 0 (disabled) reaches the CLI
            "maxClientConnections": 0,  # 0 = unlimited
            "metricsPrefix": "llm_request_router_",
            "debugEndpoints": False,  # a toggle: false renders --no-debug-endpoints
            "logLevel": "debug",
            "logFormat": "json",
        },
        "extraArgs": ["--log-level=warning"],
    }
    chart.validate_schema(values)
    r = render(chart, values)
    args = r.args

    serve = main.commands["serve"]
    assert isinstance(serve, click.Command)
    cli_flags = {
        flag
        for p in serve.params
        if isinstance(p, click.Option) and "--help" not in p.opts
        for flag in (max(p.opts, key=len), *p.secondary_opts)
    }
    # The older spelling of --metrics-listen-addr: the chart never renders it.
    cli_flags.discard("--metrics-port")
    # Flags that exclude some of the above (--peer, --worker-auth-endpoint) get a rendering of
    # their own.
    alone = {
        "replicaCount": 1,
        "serve": {
            "stargateDiscoveryDnsName": "peers.example",
            "disableDnsDiscovery": True,
            "registrationTokenFile": files["token"],
            "debugEndpoints": True,
            "loadingComments": True,
        },
    }
    alone_args = render(chart, alone).args
    assert "--disable-dns-discovery" in alone_args and "--disable-dns-discovery" not in args
    code, output, config = cli(substitute(alone_args))
    assert code == 0, output
    assert config is not None
    assert config.discovery.disable_dns_discovery is True
    assert config.discovery.dns_name == "peers.example"
    assert config.control_plane.registration_token_file == Path(files["token"])
    assert config.debug_endpoints is True

    rendered_flags = {a.split("=", 1)[0] for a in [*args, *alone_args]}
    assert cli_flags - rendered_flags == set()
    assert rendered_flags - cli_flags == set()
    assert "--proxy-retry-budget-header=" in args
    assert "--proxy-require-pylon-retry-signal=false" in args
    assert "--watch-heartbeat-ms=0" in args
    assert args[-1] == "--log-level=warning"  # extraArgs come last

    code, output, config = cli(substitute(args))
    assert code == 0, output
    assert config is not None
    assert config.stargate_id == "replica-x"
    assert config.http_listen_addr == ListenAddress("0.0.0.0", 18000)
    assert config.listen_addr == ListenAddress("0.0.0.0", 15071)
    assert config.model_discovery_listen_addr == ListenAddress("0.0.0.0", 15073)
    assert config.advertise_addr == ListenAddress("10.9.9.9", 15071)
    assert config.metrics_listen_addr == ListenAddress("0.0.0.0", 19090)
    assert config.metrics_prefix == "llm_request_router_"
    assert config.debug_endpoints is False
    assert config.shutdown_drain_timeout_ms == 0
    assert config.shutdown_delay_ms == 250
    assert "--request-body-timeout-ms=0" in args and "--max-client-connections=0" in args
    assert (config.request_body_timeout_ms, config.max_client_connections) == (0, 0)
    assert config.warmup == WarmupConfig(0, 250, 3)
    d = config.discovery
    assert d.dns_name is None
    assert d.peers == ("10.0.0.1:15071", "b=10.0.0.2:15071")
    assert d.disable_dns_discovery is False
    assert (d.dns_poll_ms, d.watch_heartbeat_ms) == (250, 0)
    assert d.peer_absent_after_ms == 0
    assert d.remote_stargate_urls == ("http://other-region:50071",)
    assert d.grpc_pylon_dial_addr == "lb.example:50071"
    cp = config.control_plane
    assert (cp.idle_timeout_ms, cp.max_idle_timeout_ms) == (0, 0)
    assert cp.grpc_max_message_bytes == 16_777_216
    assert cp.worker_auth_endpoint == "auth.example:9090"
    assert cp.health_check_timeout_ms == 1_500
    p = config.proxy
    assert (p.max_connect_retries, p.max_request_retries) == (0, 0)
    assert p.max_replay_body_bytes == 1_000_000
    assert p.require_pylon_retry_signal is False
    assert p.retry_budget_header is None
    assert (p.response_header_timeout_ms, p.connect_timeout_ms) == (120_000, 2_000)
    assert p.max_connections_per_backend == 4_096
    assert p.accept_openai_requests is True
    assert "--unmeasured-backends=exclude" in args
    assert p.estimate_unmeasured_backends is False
    assert "--outlier-consecutive-failures=0" in args and "--slow-start-window-ms=0" in args
    assert (p.outlier_consecutive_failures, p.outlier_base_ejection_ms) == (0, 15_000)
    assert (p.outlier_max_ejection_ms, p.outlier_max_ejection_percent) == (120_000, 50)
    assert p.outlier_decay_interval_ms == 5_000
    assert (p.slow_start_window_ms, p.slow_start_aggression) == (0, 1.5)
    assert p.slow_start_min_weight_percent == 25
    assert "--derive-affinity-key" in args and "--derive-affinity-key-block-bytes=512" in args
    assert "--derive-affinity-key-depth=16" in args
    assert "--no-loading-comments" in args and "--loading-comment-interval-ms=2500" in args
    assert (p.derive_affinity_key, p.derive_affinity_key_block_bytes) == (True, 512)
    assert p.derive_affinity_key_depth == 16
    assert p.lb_config_path == Path(files["lb.json"])
    assert p.upstream_ca_file == Path(files["ca.pem"])
    assert cp.worker_auth_ca_file == Path(files["ca.pem"])
    assert cp.oauth2_provider_host == "https://login.example"
    assert config.secrets == SecretsConfig(Path(files["secrets.json"]), "nvcf.apiToken")
    assert config.tls == TlsConfig(Path(files["tls.crt"]), Path(files["tls.key"]), 5_000)
    assert config.tunnels == TunnelConfig(
        protocol=TunnelProtocol.HTTP3,
        connectivity=Connectivity.REVERSE,
        direct_connections=3,
        reverse_listen_addr=ListenAddress("0.0.0.0", 15072),
        reverse_pylon_dial_addr="udp-lb.example:15072",
        reverse_connect_timeout_ms=0,
        connect_timeout_ms=1_500,
        request_timeout_ms=60_000,
        insecure=True,
        cert_path=Path(files["tls.crt"]),
        key_path=Path(files["tls.key"]),
        reload_interval_ms=5_000,
    )
    assert config.tracing == TracingConfig("http://collector.example:4317", "router-x")
    assert config.activator.pool_config_path == pool_file
    assert (config.activator.resync_interval_ms, config.activator.controller_timeout_ms) == (
        2_500,
        4_000,
    )
    assert (config.activator.breaker_failures, config.activator.breaker_cooldown_ms) == (0, 45_000)
    assert config.activator.ownership == PoolOwnershipConfig(
        "lease", "llm-leases", "router-x", 9_000, 6_000, 1_000, "http://10.9.9.9:18000"
    )


def test_a_reverse_tunnel_listener_gets_its_udp_ports_and_its_quic_secret(
    chart: Any, cli: Any
) -> None:
    """tunnels.reverse: the reverse connectivity and listener flags, a UDP container port and the
    same port on the headless Service (Pylons dial each replica); tunnels.tlsSecretName: mounted,
    passed as the QUIC pair. Without them: none of it."""
    values = {
        "ports": {"reverseTunnel": 15072},
        "tunnels": {"reverse": True, "tlsSecretName": "quic-identity"},
    }
    r = render(chart, values)
    assert "--backend-connectivity=reverse" in r.args
    assert "--reverse-tunnel-listen-addr=0.0.0.0:15072" in r.args
    assert "--quic-tls-cert-path=/etc/stargate-quic-tls/tls.crt" in r.args
    assert "--quic-tls-key-path=/etc/stargate-quic-tls/tls.key" in r.args
    udp = {"name": "reverse-tunnel", "containerPort": 15072, "protocol": "UDP"}
    assert udp in r.container["ports"]
    mounts = {m["name"]: m["mountPath"] for m in r.container["volumeMounts"]}
    assert mounts["quic-tls"] == "/etc/stargate-quic-tls"
    volumes = {v["name"]: v for v in r.pod["volumes"]}
    assert volumes["quic-tls"]["secret"]["secretName"] == "quic-identity"
    headless = r.one("Service", f"{FULLNAME}-headless")["spec"]
    udp_service = {"name": "reverse-tunnel", "port": 15072, "targetPort": "reverse-tunnel"}
    assert {**udp_service, "protocol": "UDP"} in headless["ports"]
    client = r.one("Service", FULLNAME)["spec"]  # clients never dial it
    assert all(p["protocol"] == "TCP" for p in client["ports"])
    # The CLI accepts the listener flags (the mounted files exist only in the pod).
    listener = render(chart, {"ports": {"reverseTunnel": 15072}, "tunnels": {"reverse": True}})
    code, output, config = cli(substitute(listener.args))
    assert code == 0, output
    assert config is not None and config.tunnels.reverse
    assert config.tunnels.reverse_listen_addr == ListenAddress("0.0.0.0", 15072)
    plain = render(chart, {})
    assert not any("tunnel" in arg or "quic" in arg for arg in plain.args)
    assert all(port["protocol"] == "TCP" for port in plain.container["ports"])


def test_switches_set_to_false_are_not_rendered(chart: Any) -> None:
    switches = {"disableDnsDiscovery": False, "acceptOpenaiRequests": False}
    r = render(chart, {"serve": {**switches, "deriveAffinityKey": False}})
    assert r.args == DEFAULT_ARGS


def test_disable_dns_discovery_with_several_replicas_fails(chart: Any) -> None:
    with pytest.raises(helm_python.HelmError, match="multi-replica routers require DNS"):
        chart.render({"serve": {"disableDnsDiscovery": True}}, name=RELEASE, namespace=NAMESPACE)


# ----------------------------------------------------------------------------------------------
# replicas


@pytest.mark.parametrize("replicas", [1, 3])
def test_replicas(chart: Any, cli: Any, replicas: int) -> None:
    r = render(chart, {"replicaCount": replicas})
    assert r.statefulset["spec"]["replicas"] == replicas
    assert f"--stargate-discovery-dns-name={HEADLESS_FQDN}" in r.args
    assert r.one("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    code, output, _ = cli(substitute(r.args))
    assert code == 0, output


# ----------------------------------------------------------------------------------------------
# pools


def test_pools_disabled_render_no_pool_objects(chart: Any) -> None:
    r = render(chart, {"pools": {"kubernetesController": True}})  # ignored while disabled
    assert not r.all("ConfigMap") and not r.all("Role") and not r.all("RoleBinding")
    assert not any(a.startswith("--pool-config") for a in r.args)
    assert [v["name"] for v in r.pod["volumes"]] == ["tmp"]


@pytest.mark.parametrize("as_string", [False, True])
def test_pools_enabled_without_kubernetes_controller(
    chart: Any, cli: Any, tmp_path: Path, as_string: bool
) -> None:
    config: Any = yaml.safe_dump(POOLS) if as_string else POOLS
    r = render(chart, {"replicaCount": 1, "pools": {"enabled": True, "config": config}})
    cm = r.one("ConfigMap", f"{FULLNAME}-pools")
    assert yaml.safe_load(cm["data"]["pools.yaml"]) == POOLS
    assert f"--pool-config={POOL_CONFIG_PATH}" in r.args
    mount = next(m for m in r.container["volumeMounts"] if m["name"] == "pool-config")
    assert mount == {"name": "pool-config", "mountPath": "/etc/stargate", "readOnly": True}
    volume = next(v for v in r.pod["volumes"] if v["name"] == "pool-config")
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    assert "checksum/pool-config" in r.statefulset["spec"]["template"]["metadata"]["annotations"]
    assert r.one("ServiceAccount")["metadata"]["name"] == r.pod["serviceAccountName"]
    assert not r.all("Role") and not r.all("RoleBinding")
    assert r.pod["automountServiceAccountToken"] is False

    # The rendered file is a valid pool config, and the args parse with it in place.
    pool_file = tmp_path / "pools.yaml"
    pool_file.write_text(cm["data"]["pools.yaml"])
    assert [p.pool.name for p in load_pool_config(pool_file).pools] == ["gpu1"]
    code, output, parsed = cli(substitute(r.args, {POOL_CONFIG_PATH: str(pool_file)}))
    assert code == 0, output
    assert parsed is not None and parsed.activator.pool_config_path == pool_file


def test_pools_with_kubernetes_controller_get_rbac(chart: Any) -> None:
    values = {
        "replicaCount": 1,
        "pools": {
            "enabled": True,
            "config": POOLS,
            "kubernetesController": True,
            "kubernetes": {
                "customResources": [
                    {"apiGroup": "inference.llmkube.dev", "resource": "inferenceservices"}
                ]
            },
        },
    }
    r = render(chart, values)
    role = r.one("Role", f"{FULLNAME}-pools")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale", "statefulsets/scale"],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": ["inference.llmkube.dev"],
            "resources": ["inferenceservices"],
            "verbs": ["get", "patch"],
        },
    ]
    binding = r.one("RoleBinding", f"{FULLNAME}-pools")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": r.pod["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert r.pod["automountServiceAccountToken"] is True


def test_pools_rbac_in_member_namespaces(chart: Any) -> None:
    values = {
        "replicaCount": 1,
        "pools": {
            "enabled": True,
            "config": POOLS,
            "kubernetesController": True,
            "kubernetes": {"namespaces": ["models-a", "models-b"]},
        },
    }
    r = render(chart, values)
    pool_roles = [m for m in r.all("Role") if m["metadata"]["name"] == f"{FULLNAME}-pools"]
    assert sorted(m["metadata"]["namespace"] for m in pool_roles) == ["models-a", "models-b"]
    # The pool Leases live in the release's namespace, whatever the members' namespaces.
    assert r.one("Role", f"{FULLNAME}-pool-leases")["metadata"]["namespace"] == NAMESPACE
    for binding in r.all("RoleBinding"):
        assert binding["subjects"][0]["namespace"] == NAMESPACE


def test_pools_guards(chart: Any) -> None:
    with pytest.raises(helm_python.HelmError, match=r"pools\.config"):
        chart.render({"pools": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE)
    both = {"pools": {"enabled": True, "config": POOLS}, "serve": {"poolConfig": "/x.yaml"}}
    with pytest.raises(helm_python.HelmError, match=r"serve\.poolConfig"):
        chart.render(both, name=RELEASE, namespace=NAMESPACE)


PROCESS_POOLS = {
    "pools": [
        {
            "name": "local",
            "members": ["model-a"],
            "controller": {
                "kind": "process",
                "members": {"model-a": {"command": ["engine", "--port", "{port}"]}},
            },
        }
    ]
}


LEASE_ARGS = [
    "--pool-ownership=lease",
    f"--pool-lease-prefix={FULLNAME}",
    "--pool-lease-namespace=$(POD_NAMESPACE)",
    "--pool-owner-url=http://$(POD_IP):8000",
]


@pytest.mark.parametrize(
    "pools",
    [
        {"enabled": True, "config": POOLS},  # a pool whose controller.kind is kubernetes
        {"enabled": True, "config": yaml.safe_dump(POOLS)},  # the same, as a YAML string
    ],
    ids=["kind-in-map", "kind-in-string"],
)
def test_kubernetes_pools_are_shared_through_leases(
    chart: Any, cli: Any, tmp_path: Path, pools: dict[str, Any]
) -> None:
    """Every replica serves the pools; one Lease per pool names the one that decides
    (docs/pool-ownership.md), so several replicas are allowed."""
    r = render(chart, {"replicaCount": 3, "pools": {**pools, "kubernetesController": True}})
    assert r.statefulset["spec"]["replicas"] == 3
    at = r.args.index(f"--pool-config={POOL_CONFIG_PATH}")
    assert r.args[at + 1 : at + 5] == LEASE_ARGS
    role = r.one("Role", f"{FULLNAME}-pool-leases")
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]
    assert (
        r.one("RoleBinding", f"{FULLNAME}-pool-leases")["roleRef"]["name"]
        == f"{FULLNAME}-pool-leases"
    )
    pool_file = tmp_path / "pools.yaml"
    pool_file.write_text(yaml.safe_dump(POOLS))
    code, output, parsed = cli(substitute(r.args, {POOL_CONFIG_PATH: str(pool_file)}))
    assert code == 0, output
    assert parsed is not None and parsed.activator.ownership.mode == "lease"
    assert parsed.activator.ownership.lease_prefix == FULLNAME

    tls = render(chart, {"pools": {**pools}, "tls": {"secretName": "t"}})
    assert "--pool-owner-url=https://$(POD_IP):8000" in tls.args
    own = render(chart, {"pools": {**pools}, "serve": {"poolOwnership": "local"}})
    assert "--pool-ownership=local" in own.args
    assert not any(a.startswith("--pool-lease-prefix") for a in own.args)


def test_process_pools_are_not_shared(chart: Any) -> None:
    """A process pool's engines are this replica's own: no Lease, whatever the RBAC switch."""
    pools = {"enabled": True, "config": PROCESS_POOLS, "kubernetesController": True}
    r = render(chart, {"replicaCount": 2, "pools": pools})
    assert not any(a.startswith("--pool-ownership") for a in r.args)
    assert not [m for m in r.all("Role") if m["metadata"]["name"].endswith("-pool-leases")]


def test_pool_lease_timings_must_let_an_owner_stop_first(chart: Any) -> None:
    values = {"serve": {"poolLeaseRenewDeadlineMs": 20_000}}  # above the 15 s duration
    with pytest.raises(helm_python.HelmError, match=r"serve\.poolLeaseRetryPeriodMs \(2000\)"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_process_pools_and_disabled_pools_keep_several_replicas(chart: Any) -> None:
    """A process pool's engines are this replica's own, and disabled pools are ignored."""
    r = render(chart, {"pools": {"enabled": True, "config": PROCESS_POOLS}})
    assert r.statefulset["spec"]["replicas"] == 3
    r = render(chart, {"pools": {"config": POOLS, "kubernetesController": True}})
    assert r.statefulset["spec"]["replicas"] == 3


# ----------------------------------------------------------------------------------------------
# metrics


def test_service_monitor(chart: Any) -> None:
    assert not render(chart).all("ServiceMonitor")
    r = render(chart, {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"r": "p"}}}})
    sm = r.one("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["r"] == "p"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    headless = r.one("Service", f"{FULLNAME}-headless")
    assert {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"} in (
        headless["spec"]["ports"]
    )
    labels = headless["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    client = r.one("Service", FULLNAME)
    client_labels = client["metadata"]["labels"]
    assert not all(
        client_labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items()
    )


@pytest.mark.parametrize(
    ("host", "rendered", "parsed"),
    [
        (None, "0.0.0.0:19191", ListenAddress("0.0.0.0", 19191)),
        ("$(POD_IP)", "$(POD_IP):19191", ListenAddress("10.1.2.3", 19191)),
        ("fd00::1", "[fd00::1]:19191", ListenAddress("fd00::1", 19191)),
    ],
)
def test_metrics_listen_addr_follows_ports_metrics(
    chart: Any, cli: Any, host: str | None, rendered: str, parsed: ListenAddress
) -> None:
    """--metrics-listen-addr is <metrics.listenHost>:<ports.metrics>, so the container port, the
    headless Service and the ServiceMonitor always name the port the listener binds."""
    values = {
        "ports": {"http": 8000, "grpc": 50071, "discovery": 50073, "metrics": 19191},
        "metrics": {"listenHost": host, "serviceMonitor": {"enabled": True}},
    }
    chart.validate_schema(values)
    r = render(chart, values)
    assert flag_values(r.args, "--metrics-listen-addr") == [rendered]
    assert flag_values(r.args, "--metrics-port") == []
    ports = {p["name"]: p["containerPort"] for p in r.container["ports"]}
    assert ports["metrics"] == 19191
    headless = r.one("Service", f"{FULLNAME}-headless")
    assert {"name": "metrics", "port": 19191, "targetPort": "metrics", "protocol": "TCP"} in (
        headless["spec"]["ports"]
    )
    assert r.one("ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    code, output, config = cli(substitute(r.args))
    assert code == 0, output
    assert config is not None and config.metrics_listen_addr == parsed


def test_loopback_metrics_host_cannot_be_scraped(chart: Any, cli: Any) -> None:
    r = render(chart, {"metrics": {"listenHost": "127.0.0.1"}})  # e.g. for a sidecar
    assert "--metrics-listen-addr=127.0.0.1:9090" in r.args
    code, output, config = cli(substitute(r.args))
    assert code == 0, output
    assert config is not None and config.metrics_listen_addr == ListenAddress("127.0.0.1", 9090)
    for metrics in ({"enabled": True}, {"serviceMonitor": {"enabled": True}}):
        with pytest.raises(helm_python.HelmError, match="loopback"):
            chart.render(
                {"metrics": {"listenHost": "127.0.0.1", **metrics}},
                name=RELEASE,
                namespace=NAMESPACE,
            )


@pytest.mark.parametrize(
    ("value", "rendered", "served"),
    [
        (None, [], True),
        (True, ["--debug-endpoints"], True),
        (False, ["--no-debug-endpoints"], False),
    ],
)
def test_debug_endpoints_is_presence_aware(
    chart: Any, cli: Any, value: bool | None, rendered: list[str], served: bool
) -> None:
    r = render(chart, {"serve": {"debugEndpoints": value}})
    assert [a for a in r.args if "debug-endpoints" in a] == rendered
    code, output, config = cli(substitute(r.args))
    assert code == 0, output
    assert config is not None and config.debug_endpoints is served


@pytest.mark.parametrize(
    ("value", "rendered", "applied"),
    [
        (None, [], "text"),
        ("text", ["--log-format=text"], "text"),
        ("json", ["--log-format=json"], "json"),
    ],
)
def test_log_format_is_presence_aware(
    chart: Any,
    cli: Any,
    monkeypatch: pytest.MonkeyPatch,
    value: str | None,
    rendered: list[str],
    applied: str,
) -> None:
    r = render(chart, {"serve": {"logLevel": "warning", "logFormat": value}})
    assert [a for a in r.args if a.startswith("--log-")] == ["--log-level=warning", *rendered]
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(stargate_cli, "configure_logging", lambda *a: seen.append(a))
    code, output, config = cli(substitute(r.args))
    assert code == 0, output
    assert config is not None and seen == [("warning", applied)]


def test_pdb_min_available_and_disabled(chart: Any) -> None:
    r = render(chart, {"podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"}})
    assert r.one("PodDisruptionBudget")["spec"] == {
        "minAvailable": "50%",
        "selector": {"matchLabels": r.statefulset["spec"]["selector"]["matchLabels"]},
    }
    assert not render(chart, {"podDisruptionBudget": {"enabled": False}}).all("PodDisruptionBudget")
    with pytest.raises(helm_python.HelmError, match="exactly one"):
        chart.render(
            {"podDisruptionBudget": {"minAvailable": 1}}, name=RELEASE, namespace=NAMESPACE
        )


# ----------------------------------------------------------------------------------------------
# values schema


@pytest.mark.parametrize("key", ["warmupMs", "warmupSampleIntervalMs", "warmupStabilizationWindow"])
@pytest.mark.parametrize("bad", [-1, 1.5, "1000"], ids=["negative", "fractional", "string"])
def test_schema_rejects_bad_warmup_values(chart: Any, key: str, bad: object) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=key):
        chart.validate_schema({"readiness": {key: bad}})


@pytest.mark.parametrize("key", ["warmupMs", "warmupSampleIntervalMs", "warmupStabilizationWindow"])
@pytest.mark.parametrize("good", [None, 0, 1, 100_000_000])
def test_schema_accepts_warmup_values(chart: Any, key: str, good: object) -> None:
    chart.validate_schema({"readiness": {key: good}})


@pytest.mark.parametrize(
    "values",
    [
        {"unknownTopLevelKey": True},
        {"serve": {"notAFlag": 1}},
        {"serve": {"proxyMaxConnectRetries": -1}},
        {"serve": {"proxyMaxConnectRetries": "2"}},
        {"serve": {"proxyRequirePylonRetrySignal": "false"}},
        {"serve": {"logLevel": "trace"}},
        {"serve": {"logFormat": "xml"}},
        {"serve": {"debugEndpoints": "false"}},
        {"serve": {"deriveAffinityKey": "true"}},
        {"serve": {"deriveAffinityKeyBlockBytes": 0}},
        {"serve": {"deriveAffinityKeyDepth": 0}},
        {"metrics": {"listenHost": ""}},
        {"readiness": {"warmupMillis": 1}},
        {"ports": {"http": 0}},
        {"shutdown": {"drainTimeoutMs": None}},
        {"shutdown": {"delayMs": -1}},
        {"pools": {"kubernetes": {"customResources": [{"apiGroup": "x"}]}}},
    ],
    ids=json.dumps,
)
def test_schema_rejects(chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(values)
    with pytest.raises(helm_python.HelmError):  # render applies the schema too
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


# --- TLS and the secrets file (docs/tls.md, docs/worker-auth.md) ---------------------------------


def test_tls_secret_is_mounted_as_a_directory_and_probes_use_https(chart: Any) -> None:
    plain = render(chart)
    assert plain.container["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert not any(a.startswith("--tls-") for a in plain.args)

    r = render(chart, {"tls": {"secretName": "router-tls"}})
    assert "--tls-cert-path=/etc/stargate-tls/tls.crt" in r.args
    assert "--tls-key-path=/etc/stargate-tls/tls.key" in r.args
    (mount,) = [m for m in r.container["volumeMounts"] if m["name"] == "tls"]
    assert mount == {"name": "tls", "mountPath": "/etc/stargate-tls", "readOnly": True}
    assert "subPath" not in mount  # a subPath mount never sees a renewed Secret
    (volume,) = [v for v in r.pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "router-tls"
    assert {item["key"] for item in volume["secret"]["items"]} == {"tls.crt", "tls.key"}
    for probe in ("readinessProbe", "livenessProbe"):
        assert r.container[probe]["httpGet"]["scheme"] == "HTTPS"

    own = render(chart, {"serve": {"tlsCertPath": "/m/c.pem", "tlsKeyPath": "/m/k.pem"}})
    assert own.container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert "--tls-cert-path=/m/c.pem" in own.args


def test_tls_guards(chart: Any) -> None:
    both = {"tls": {"secretName": "x"}, "serve": {"tlsCertPath": "/c", "tlsKeyPath": "/k"}}
    with pytest.raises(helm_python.HelmError, match=r"either tls\.secretName"):
        chart.render(both, name=RELEASE, namespace=NAMESPACE)
    with pytest.raises(helm_python.HelmError, match="--tls-key-path is required"):
        chart.render({"serve": {"tlsCertPath": "/c"}}, name=RELEASE, namespace=NAMESPACE)


def test_secrets_file_is_mounted_and_passed(chart: Any) -> None:
    values = {
        "secretsFile": {"secretName": "router-secrets", "key": "gateway.json"},
        "serve": {"workerAuthEndpoint": "https://gw:9090", "oauth2ProviderHost": "https://idp"},
    }
    r = render(chart, values)
    assert "--secrets-path=/etc/stargate-secrets/gateway.json" in r.args
    assert "--oauth2-provider-host=https://idp" in r.args
    (mount,) = [m for m in r.container["volumeMounts"] if m["name"] == "secrets-file"]
    assert mount["mountPath"] == "/etc/stargate-secrets" and "subPath" not in mount
    (volume,) = [v for v in r.pod["volumes"] if v["name"] == "secrets-file"]
    assert volume["secret"]["secretName"] == "router-secrets"
    with pytest.raises(helm_python.HelmError, match="requires a secrets file"):
        chart.render(
            {"serve": {"oauth2ProviderHost": "https://idp"}}, name=RELEASE, namespace=NAMESPACE
        )
    with pytest.raises(helm_python.HelmError, match=r"either secretsFile\.secretName"):
        chart.render(
            {"secretsFile": {"secretName": "s"}, "serve": {"secretsPath": "/x.json"}},
            name=RELEASE,
            namespace=NAMESPACE,
        )
