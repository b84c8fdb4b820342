"""The chart's Grafana dashboard ConfigMap and PrometheusRule (docs/observability.md).

Rendered offline like tests/helm/test_chart.py (whose helpers this module reuses). The alert rules
and the dashboard's queries go through `promtool` (Debian's `prometheus` package: `check rules`
for syntax, `test rules` for when each alert fires); every metric they name is checked against
the replica's own registry and against the live `/metrics` of a real `stargate serve`.

promtool is skipped only outside CI: with `CI` set (`.ci/run` installs it) a missing promtool
fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
import yaml
from prometheus_client import CollectorRegistry

from stargate.activator.metrics import ActivatorMetrics
from stargate.metrics import Metrics, TlsMetrics
from tests.e2e.processes import Ports, launch, stop, wait_until
from tests.helm.test_chart import (  # skips this module, as that one, without the helm tools
    CHART_DIR,
    FULLNAME,
    NAMESPACE,
    RELEASE,
    Rendering,
    helm_python,
    render,
)

DASHBOARD_CM = f"{FULLNAME}-dashboard"
HEADLESS_JOB = f"{FULLNAME}-headless"
DEFAULT_SELECTOR = {"namespace": NAMESPACE, "job": HEADLESS_JOB}
ALERTS = {
    "StargateReplicaNotReady",
    "StargateHighServerErrorRatio",
    "StargateModelWithoutBackends",
    "StargatePoolSwapFailures",
    "StargateTLSCertificateExpiringSoon",
    "StargateBackendConnectionsSaturated",
    "StargateClientConnectionsRefused",
}
BOTH = {"observability": {"dashboards": {"enabled": True}, "alerts": {"enabled": True}}}


# ----------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    loaded = helm_python.Chart.load(CHART_DIR)
    try:
        yield loaded
    finally:
        loaded.close()


def observability(**blocks: dict[str, Any]) -> dict[str, Any]:
    return {"observability": blocks}


def dashboard_json(r: Rendering, name: str = DASHBOARD_CM) -> dict[str, Any]:
    cm = r.one("ConfigMap", name)
    (text,) = cm["data"].values()
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            # label_values(<selector>, label): the selector is PromQL.
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"]["query"])
            assert match, var["query"]
            exprs.append(match.group(1))
    return exprs


def rule_groups(r: Rendering) -> list[dict[str, Any]]:
    rule = r.one("PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alert_rules(r: Rendering) -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for g in rule_groups(r) for rule in g["rules"]}


_KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKEN = re.compile(
    r"(?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<other>.)"
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    aggregations, keywords, label names (in braces or grouping clauses) or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\boffset\s+\S+", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    tokens = list(_TOKEN.finditer(text))
    for i, token in enumerate(tokens):
        name = token.group("id")
        if name is None or name.lower() in _KEYWORDS:
            continue
        rest = "".join(t.group(0) for t in tokens[i + 1 :]).lstrip()
        if rest.startswith("("):
            continue  # a function or an aggregation
        names.add(name)
    return names


def test_metric_names_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{x="y{z}", w=~"$v"}[5m]))) '
        "/ on (model) group_left (pool) b offset 15m > 1e-05 and c_total{} unless d "
        '- time() < 14 * 86400 or vector(0) and label_values("q")'
    )
    assert metric_names(expr) == {"a_bucket", "b", "c_total", "d"}


def registry_names(prefix: str = "stargate_") -> set[str]:
    """Every sample name the replica's registries can export (histograms as _bucket/_sum/_count),
    the TLS families included (a replica has them only with --tls-cert-path)."""
    registry = CollectorRegistry()
    Metrics(registry, prefix)
    ActivatorMetrics.create(registry)
    TlsMetrics.create(registry, prefix)
    names: set[str] = set()
    for family in registry.collect():
        names.update(exposed_names(family.name, family.type))
    return names


def exposed_names(name: str, kind: str) -> set[str]:
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "counter":
        return {name if name.endswith("_total") else f"{name}_total"}
    return {name}


def referenced_names(r: Rendering) -> set[str]:
    names: set[str] = set()
    for expr in dashboard_exprs(dashboard_json(r)):
        names |= metric_names(expr)
    for rule in alert_rules(r).values():
        names |= metric_names(rule["expr"])
    return names


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI: .ci/run installs Debian's prometheus package")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)


def check_rules(path: Path, groups: list[dict[str, Any]]) -> None:
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------------------------
# off by default, objects when enabled


def test_off_by_default_renders_neither(chart: Any) -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["observability"]["dashboards"]["enabled"] is False
    assert values["observability"]["alerts"]["enabled"] is False
    r = render(chart)
    assert not r.all("PrometheusRule")
    assert not [m for m in r.all("ConfigMap") if m["metadata"]["name"] == DASHBOARD_CM]
    both = render(chart, BOTH)
    assert both.one("PrometheusRule") and both.one("ConfigMap", DASHBOARD_CM)
    # Each switch renders its own object only.
    only_alerts = render(chart, observability(alerts={"enabled": True}))
    assert only_alerts.one("PrometheusRule") and not only_alerts.all("ConfigMap")
    only_dash = render(chart, observability(dashboards={"enabled": True}))
    assert only_dash.one("ConfigMap", DASHBOARD_CM) and not only_dash.all("PrometheusRule")


def test_dashboard_configmap(chart: Any) -> None:
    """render() validates the ConfigMap against the Kubernetes schema (strict)."""
    r = render(chart, observability(dashboards={"enabled": True}))
    cm = r.one("ConfigMap", DASHBOARD_CM)
    assert cm["metadata"]["namespace"] == NAMESPACE
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert list(cm["data"]) == [f"{FULLNAME}.json"]
    dashboard = dashboard_json(r)
    assert dashboard["title"] == f"Stargate router ({NAMESPACE}/{FULLNAME})"
    assert re.fullmatch(r"stargate-[0-9a-f]{16}", dashboard["uid"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in (
        "Readiness per replica",
        "Warmup progress per replica",
        "Requests by status",
        "Failed upstream attempts by result",
        "Proxy duration (request start to upstream response head)",
        "Routing duration",
        "Requests in flight per replica (SSE streams included)",
        "Active backends per model",
        "Active backends per replica",
        "Swaps",
        "Swap failures",
        "Days until the served certificate expires",
    ):
        assert wanted in titles
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}

    # Another release gets another uid and title (Grafana keys dashboards by uid).
    other = chart.render(
        {"observability": {"dashboards": {"enabled": True}}}, name="other", namespace=NAMESPACE
    )
    (text,) = (t for path, t in other.items() if path.endswith("dashboard-configmap.yaml"))
    (other_json,) = yaml.safe_load(text)["data"].values()
    assert json.loads(other_json)["uid"] != dashboard["uid"]

    # Labels, annotations and the namespace (Grafana's, for a sidecar watching only it).
    r = render(
        chart,
        observability(
            dashboards={
                "enabled": True,
                "labels": {"grafana_dashboard": "yes", "team": "llm"},
                "annotations": {"grafana_folder": "LLM"},
                "namespace": "monitoring",
            }
        ),
    )
    cm = r.one("ConfigMap", DASHBOARD_CM)
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "yes"
    assert cm["metadata"]["labels"]["team"] == "llm"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_prometheus_rule_structure(chart: Any) -> None:
    r = render(chart, observability(alerts={"enabled": True, "labels": {"release": "kps"}}))
    rule = r.one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kps"
    (group,) = rule["spec"]["groups"]
    assert group["name"] and set(group) == {"name", "rules"}
    alerts = alert_rules(r)
    assert set(alerts) == ALERTS
    for name, alert in alerts.items():
        assert set(alert) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert alert["labels"]["severity"] in {"warning", "critical"}, name
        assert set(alert["annotations"]) == {"summary", "description", "runbook"}, name
        assert all(len(text) > 20 for text in alert["annotations"].values()), name
        # Every selector picks this release's series (the ServiceMonitor's namespace and job).
        selectors = re.findall(r"\w+\{([^{}]*)\}", alert["expr"])
        assert selectors, name
        for selector in selectors:
            assert f'namespace="{NAMESPACE}"' in selector, (name, selector)
            assert f'job="{HEADLESS_JOB}"' in selector, (name, selector)
    assert "for" not in alerts["StargatePoolSwapFailures"]  # one failure is enough
    assert alerts["StargateModelWithoutBackends"]["labels"]["severity"] == "critical"


def test_alert_values(chart: Any) -> None:
    r = render(
        chart,
        observability(
            alerts={
                "enabled": True,
                "selector": 'cluster="eu", app="router"',
                "alertLabels": {"team": "llm", "severity": "ignored"},
                "serverErrors": {
                    "ratio": 0.2,
                    "window": "2m",
                    "for": "15m",
                    "severity": "critical",
                },
                "tlsCertificateExpiry": {"days": 30},
                "poolSwapFailures": {"enabled": False},
                "clientConnectionsRefused": {"enabled": False},
            }
        ),
    )
    alerts = alert_rules(r)
    assert set(alerts) == ALERTS - {"StargatePoolSwapFailures", "StargateClientConnectionsRefused"}
    for alert in alerts.values():
        assert alert["labels"]["team"] == "llm"
        assert alert["labels"]["severity"] != "ignored"  # each alert's own severity wins
        assert "namespace=" not in alert["expr"] and 'cluster="eu", app="router"' in alert["expr"]
    errors = alerts["StargateHighServerErrorRatio"]
    assert errors["labels"]["severity"] == "critical"
    assert errors["for"] == "15m" and "[2m]" in errors["expr"] and "> 0.2)" in errors["expr"]
    assert "< 30 * 86400" in alerts["StargateTLSCertificateExpiringSoon"]["expr"]

    # An empty selector: bare metric names (one release per Prometheus).
    r = render(chart, observability(alerts={"enabled": True, "selector": ""}))
    assert alert_rules(r)["StargateReplicaNotReady"]["expr"] == "stargate_readiness_ready{} == 0"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, "120s"),  # max(60 s warmup, 5 s + 30 s shutdown) + 60 s grace
        ({"readiness": {"warmupMs": 300_000}}, "360s"),
        ({"readiness": {"warmupMs": 0}}, "95s"),  # the shutdown window is longer
        ({"readiness": {"warmupMs": 90_500}}, "151s"),  # rounded up to seconds
        ({"shutdown": {"delayMs": 5000, "drainTimeoutMs": 600_000}}, "665s"),
        ({"observability": {"alerts": {"notReady": {"graceSeconds": 0}}}}, "60s"),
        ({"observability": {"alerts": {"notReady": {"for": "30m"}}}}, "30m"),
    ],
)
def test_not_ready_waits_for_the_warmup_deadline(
    chart: Any, values: dict[str, Any], expected: str
) -> None:
    merged = json.loads(json.dumps(values))
    merged.setdefault("observability", {}).setdefault("alerts", {})["enabled"] = True
    r = render(chart, merged)
    assert alert_rules(r)["StargateReplicaNotReady"]["for"] == expected


@pytest.mark.parametrize(
    "values",
    [
        {"observability": {"dashboards": {"enabled": "yes"}}},
        {"observability": {"alerts": {"unknown": 1}}},
        {"observability": {"alerts": {"serverErrors": {"ratio": 2}}}},
        {"observability": {"alerts": {"serverErrors": {"window": "five minutes"}}}},
        {"observability": {"alerts": {"notReady": {"for": "10"}}}},
        {"observability": {"alerts": {"tlsCertificateExpiry": {"days": 0}}}},
        {"observability": {"dashboards": {"labels": {"grafana_dashboard": 1}}}},
    ],
    ids=json.dumps,
)
def test_schema_rejects_bad_observability_values(chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(values)


# ----------------------------------------------------------------------------------------------
# metric names: the prefix, the registry


@pytest.mark.parametrize("prefix", [None, "llm_request_router_", ""])
def test_every_referenced_metric_is_one_the_replica_defines(chart: Any, prefix: str | None) -> None:
    r = render(chart, {**BOTH, "serve": {"metricsPrefix": prefix}})
    names = referenced_names(r)
    known = registry_names("stargate_" if prefix is None else prefix)
    assert names and names <= known, sorted(names - known)
    # The dashboard, the rules and the replica agree on the prefix: nothing else is named.
    if prefix is not None:
        assert not [n for n in names if n.startswith("stargate_")]
    # Every panel and alert group of the brief is covered.
    for family in (
        "readiness_ready",
        "readiness_stable_samples",
        "requests_total",
        "proxy_duration_seconds_bucket",
        "routing_duration_seconds_bucket",
        "proxy_requests_in_flight",
        "active_inference_servers",
        "tls_certificate_expiry_seconds",
    ):
        assert f"{'stargate_' if prefix is None else prefix}{family}" in names
    for pool_family in (
        "llmkube_modelpool_swaps_total",
        "llmkube_modelpool_swap_failures_total",
        "llmkube_modelpool_resident",
    ):
        assert pool_family in names


# ----------------------------------------------------------------------------------------------
# promtool


def test_rules_pass_promtool_check(chart: Any, tmp_path: Path) -> None:
    for i, values in enumerate(
        [
            BOTH,
            {**BOTH, "serve": {"metricsPrefix": "llm_request_router_"}},
            {"observability": {"alerts": {"enabled": True, "selector": ""}}},
        ]
    ):
        check_rules(tmp_path / f"rules-{i}.yaml", rule_groups(render(chart, values)))


def test_dashboard_queries_pass_promtool_check(chart: Any, tmp_path: Path) -> None:
    """Each panel query, as a recording rule (Grafana's $__rate_interval as 5m)."""
    exprs = dashboard_exprs(dashboard_json(render(chart, BOTH)))
    rules = [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(exprs)
    ]
    check_rules(tmp_path / "dashboard.yaml", [{"name": "dashboard", "rules": rules}])
    # The checker really parses: a broken query fails it.
    broken = [{"record": "dashboard:broken", "expr": "sum by (le (rate(x[5m]))"}]
    with pytest.raises(AssertionError):
        check_rules(tmp_path / "broken.yaml", [{"name": "broken", "rules": broken}])


def _series(name: str, **labels: str) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in {**DEFAULT_SELECTOR, **labels}.items())
    return f"{name}{{{inner}}}"


def _fired(alertname: str, eval_time: str, *label_sets: dict[str, str]) -> dict[str, Any]:
    return {
        "eval_time": eval_time,
        "alertname": alertname,
        "exp_alerts": [{"exp_labels": labels} for labels in label_sets],
    }


def test_alerts_fire_when_they_should(chart: Any, tmp_path: Path) -> None:
    """`promtool test rules` on synthetic series (annotations left out: their templates are
    checked by `promtool check rules`)."""
    groups = rule_groups(render(chart, observability(alerts={"enabled": True})))
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    pod0 = {**DEFAULT_SELECTOR, "pod": "router-stargate-0"}
    fleet = {**DEFAULT_SELECTOR}
    pool = {"pool": "gpu0", "member": "model-b", "reason": "deadline"}
    tests = [
        {  # readiness 0 past max(warmup 60 s, shutdown 35 s) + 60 s; a ready replica never
            "interval": "1m",
            "input_series": [
                {
                    "series": _series("stargate_readiness_ready", pod="router-stargate-0"),
                    "values": "0x10",
                },
                {
                    "series": _series("stargate_readiness_ready", pod="router-stargate-1"),
                    "values": "1x10",
                },
            ],
            "alert_rule_test": [
                _fired("StargateReplicaNotReady", "1m"),
                _fired("StargateReplicaNotReady", "3m", {**pod0, "severity": "warning"}),
            ],
        },
        {  # model-a drops to 0, model-b's series goes away, model-c keeps its backend
            "interval": "1m",
            "input_series": [
                {
                    "series": _series(
                        "stargate_active_inference_servers",
                        model="model-a",
                        routing_key="",
                        pod="router-stargate-0",
                    ),
                    "values": "1x10 0x30",
                },
                {
                    "series": _series(
                        "stargate_active_inference_servers",
                        model="model-b",
                        routing_key="",
                        pod="router-stargate-0",
                    ),
                    "values": "2x10 _x30",  # gone (its last sample stays visible 5m)
                },
                {
                    "series": _series(
                        "stargate_active_inference_servers",
                        model="model-c",
                        routing_key="",
                        pod="router-stargate-0",
                    ),
                    "values": "1x40",
                },
            ],
            "alert_rule_test": [
                _fired("StargateModelWithoutBackends", "14m"),  # (routing_key="" is no label)
                _fired(
                    "StargateModelWithoutBackends",
                    "17m",
                    {**fleet, "model": "model-a", "severity": "critical"},
                ),
                _fired(
                    "StargateModelWithoutBackends",
                    "22m",
                    {**fleet, "model": "model-a", "severity": "critical"},
                    {**fleet, "model": "model-b", "severity": "critical"},
                ),
            ],
        },
        {  # the first failure creates the series at 1: increase() alone would never see it
            "interval": "1m",
            "input_series": [
                {
                    "series": _series(
                        "llmkube_modelpool_swap_failures_total",
                        router="x",
                        pod="router-stargate-0",
                        **pool,
                    ),
                    "values": "_x5 1x40",
                },
            ],
            "alert_rule_test": [
                _fired("StargatePoolSwapFailures", "4m"),
                _fired("StargatePoolSwapFailures", "7m", {**fleet, **pool, "severity": "warning"}),
                _fired("StargatePoolSwapFailures", "35m"),
            ],
        },
        {  # one response in three is a 5xx, sustained
            "interval": "1m",
            "input_series": [
                {
                    "series": _series(
                        "stargate_proxy_responses_total",
                        endpoint="chat",
                        status_class="2xx",
                        pod="router-stargate-0",
                    ),
                    "values": "0+120x30",
                },
                {
                    "series": _series(
                        "stargate_proxy_responses_total",
                        endpoint="chat",
                        status_class="5xx",
                        pod="router-stargate-0",
                    ),
                    "values": "0+60x30",
                },
            ],
            "alert_rule_test": [
                _fired("StargateHighServerErrorRatio", "5m"),
                _fired("StargateHighServerErrorRatio", "15m", {**fleet, "severity": "warning"}),
            ],
        },
        {  # a certificate expiring in 10 days; one in 100 days does not alert
            "interval": "1m",
            "input_series": [
                {
                    "series": _series(
                        "stargate_tls_certificate_expiry_seconds",
                        material_type="server_identity",
                        pod="router-stargate-0",
                    ),
                    "values": f"{10 * 86400}x20",
                },
                {
                    "series": _series(
                        "stargate_tls_certificate_expiry_seconds",
                        material_type="server_identity",
                        pod="router-stargate-1",
                    ),
                    "values": f"{100 * 86400}x20",
                },
            ],
            "alert_rule_test": [
                _fired(
                    "StargateTLSCertificateExpiringSoon",
                    "15m",
                    {**pod0, "material_type": "server_identity", "severity": "warning"},
                ),
            ],
        },
    ]
    spec = tmp_path / "tests.yaml"
    spec.write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    result = run_promtool("test", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------------------------
# a live replica


def _pool_config(path: Path) -> Path:
    member = [sys.executable, "-m", "stargate", "mock-backend", "--port", "{port}"]
    path.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": "gpu0",
                        "members": ["model-a"],
                        "controller": {
                            "kind": "process",
                            "members": {
                                "model-a": {
                                    "command": [*member, "--model", "model-a"],
                                    "healthPath": "/health",
                                }
                            },
                        },
                    }
                ]
            }
        )
    )
    return path


def live_names(exposition: str) -> set[str]:
    """Sample names in an exposition, with every family's names even before it has a sample."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= exposed_names(name, kind)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.mark.parametrize("prefix", [None, "llm_request_router_"])
def test_every_referenced_metric_is_in_a_live_replicas_metrics(
    chart: Any, tmp_path: Path, prefix: str | None
) -> None:
    """A replica with a pool (for the llmkube_modelpool_* families), TLS (for the tls_*
    families; the metrics listener stays plain) and the chart's prefix."""
    r = render(chart, {**BOTH, "serve": {"metricsPrefix": prefix}})
    referenced = referenced_names(r)
    ports = Ports.pick()
    authority = trustme.CA()
    served = authority.issue_cert("127.0.0.1")
    served.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    served.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    args = [
        "serve",
        *ports.args(),
        "--readiness-warmup-ms=0",
        "--disable-dns-discovery",
        f"--pool-config={_pool_config(tmp_path / 'pools.yaml')}",
        f"--tls-cert-path={tmp_path / 'tls.crt'}",
        f"--tls-key-path={tmp_path / 'tls.key'}",
    ]
    if prefix is not None:
        args.append(f"--metrics-prefix={prefix}")
    replica = launch(tmp_path / "replica.log", *args)
    url = f"http://127.0.0.1:{ports.metrics}/metrics"
    try:
        wait_until(lambda: httpx.get(url).status_code == 200, 20, "the replica's /metrics")
        exposed = live_names(httpx.get(url).text)
    finally:
        stop(replica)
    missing = referenced - exposed
    assert not missing, f"referenced but not exported: {sorted(missing)}\n{replica.log}"
    assert "llmkube_modelpool_swap_failures_total" in referenced & exposed
