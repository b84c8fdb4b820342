"""The Kubernetes member controller against a fake API server that speaks the real JSON.

The fake (tests/fakes/kube_api.py) is a raw ASGI app, served here on Hypercorn (loopback, real
clock). It keeps Deployments, StatefulSets and LLMKube InferenceServices, serves `Scale` objects
on the `scale` subresource, applies RFC 7386 merge patches, answers errors with `Status` bodies,
and insists on the bearer token and the merge-patch content type, so a controller that drifts
from the wire contract fails here rather than against a cluster.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trustme
from hypercorn.config import Config as HypercornConfig

from stargate.activator import kubernetes
from stargate.activator.controller import MemberController, PhaseReporter
from stargate.activator.kubernetes import (
    ApiConfig,
    KubernetesConfigError,
    KubernetesController,
    KubernetesError,
    KubernetesTarget,
    load_api_config,
)
from stargate.config import ListenAddress
from stargate.serving import bind_listener, serve_asgi
from tests.fakes.kube_api import ISVC, NS, TOKEN, FakeApiServer

DEPLOY = "/apis/apps/v1/namespaces/models/deployments"
STS = "/apis/apps/v1/namespaces/models/statefulsets"


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    sock = bind_listener("fake-kube-api", ListenAddress("127.0.0.1", 0))
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = HypercornConfig()
    config.graceful_timeout = 1.0
    config.accesslog = None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, server, sock, config, stop.wait)
        yield server
        server.released.set()
        stop.set()


def two_deployments(api: FakeApiServer, a: int, b: int) -> KubernetesController:
    api.add_workload("deployments", "a", a)
    api.add_workload("deployments", "b", b)
    members = {"a": KubernetesTarget("Deployment", "a"), "b": KubernetesTarget("Deployment", "b")}
    return KubernetesController("pool", NS, members, ApiConfig(server=api.url, token=TOKEN))


def protocol_check(controller: KubernetesController) -> MemberController:
    assert isinstance(controller, PhaseReporter)
    return controller


# ---- scale subresource ---------------------------------------------------------------------------


async def test_activate_scales_up_through_the_scale_subresource(api: FakeApiServer) -> None:
    async with two_deployments(api, 0, 0) as controller:
        await protocol_check(controller).activate("b")
    assert api.replicas(f"{DEPLOY}/b") == 1
    assert [(c.method, c.path) for c in api.calls] == [
        ("GET", f"{DEPLOY}/a/scale"),
        ("GET", f"{DEPLOY}/b/scale"),
        ("PATCH", f"{DEPLOY}/b/scale"),
    ]
    patch = api.calls[-1]
    assert patch.content_type == "application/merge-patch+json"
    assert patch.body == {"spec": {"replicas": 1}}


async def test_deactivate_scales_down_and_is_a_noop_at_zero(api: FakeApiServer) -> None:
    async with two_deployments(api, 1, 0) as controller:
        await controller.deactivate("a")
        assert api.replicas(f"{DEPLOY}/a") == 0
        assert api.writes() == [(f"{DEPLOY}/a/scale", {"spec": {"replicas": 0}})]
        await controller.deactivate("a")  # the Scale now omits spec.replicas: read as 0
    assert len(api.writes()) == 1


async def test_activate_is_idempotent_by_check(api: FakeApiServer) -> None:
    async with two_deployments(api, 0, 1) as controller:
        await controller.activate("b")
        await controller.activate("b")
    assert api.writes() == []
    assert api.replicas(f"{DEPLOY}/b") == 1


async def test_activate_scales_the_other_members_down_first(api: FakeApiServer) -> None:
    api.add_workload("statefulsets", "c", 0)
    members = {
        "a": KubernetesTarget("Deployment", "a"),
        "b": KubernetesTarget("Deployment", "b"),
        "c": KubernetesTarget("StatefulSet", "c"),
    }
    api.add_workload("deployments", "a", 1)
    api.add_workload("deployments", "b", 0)
    async with KubernetesController(
        "pool", NS, members, ApiConfig(server=api.url, token=TOKEN)
    ) as controller:
        await controller.activate("b")
        assert await controller.phase("a") == "Scaled(0)"
        assert await controller.phase("b") == "Scaled(1)"
    assert [(c.method, c.path) for c in api.calls[:5]] == [
        ("GET", f"{DEPLOY}/a/scale"),
        ("PATCH", f"{DEPLOY}/a/scale"),  # the incumbent goes to 0 before the target starts
        ("GET", f"{STS}/c/scale"),  # already 0: no write
        ("GET", f"{DEPLOY}/b/scale"),
        ("PATCH", f"{DEPLOY}/b/scale"),
    ]
    assert api.writes() == [
        (f"{DEPLOY}/a/scale", {"spec": {"replicas": 0}}),
        (f"{DEPLOY}/b/scale", {"spec": {"replicas": 1}}),
    ]


# ---- custom resources ----------------------------------------------------------------------------


async def test_custom_resource_is_merge_patched_in_place(api: FakeApiServer) -> None:
    api.add_inference_service("small", 0)
    api.add_inference_service("large", None)  # unset replicas: the CRD default, maybe 1
    target = {
        name: KubernetesTarget(
            "InferenceService", name, api_version="inference.llmkube.dev/v1alpha1"
        )
        for name in ("large", "small")
    }
    config = ApiConfig(server=api.url, token=TOKEN)
    async with KubernetesController("pool", NS, target, config) as controller:
        assert await controller.phase("large") == "Scaled(default)"
        await controller.activate("small")
    assert api.writes() == [
        (f"{ISVC}/large", {"spec": {"replicas": 0}}),  # unset is not "stopped": patched
        (f"{ISVC}/small", {"spec": {"replicas": 1}}),
    ]
    small = api.objects[f"{ISVC}/small"]
    # A merge patch touches only spec.replicas; the rest of the object is intact.
    assert small["spec"] == {"modelRef": "small-model", "resources": {"gpu": 1}, "replicas": 1}
    assert small["status"] == {"phase": "Stopped"}
    assert all(c.content_type == "application/merge-patch+json" for c in api.calls if c.body)


def test_target_paths() -> None:
    isvc = KubernetesTarget("InferenceService", "x", api_version="inference.llmkube.dev/v1alpha1")
    assert (
        isvc.path("ns") == "/apis/inference.llmkube.dev/v1alpha1/namespaces/ns/inferenceservices/x"
    )
    assert KubernetesTarget("StatefulSet", "s").path("ns") == (
        "/apis/apps/v1/namespaces/ns/statefulsets/s/scale"
    )
    odd = KubernetesTarget("Policy", "p", api_version="example.com/v1", plural="policies")
    assert odd.path("ns") == "/apis/example.com/v1/namespaces/ns/policies/p"


# ---- errors --------------------------------------------------------------------------------------


async def test_deactivate_of_a_missing_object_is_done(
    api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    members = {"gone": KubernetesTarget("Deployment", "gone")}
    config = ApiConfig(server=api.url, token=TOKEN)
    with caplog.at_level(logging.WARNING, logger="stargate.activator.kubernetes"):
        async with KubernetesController("pool", NS, members, config) as controller:
            await controller.deactivate("gone")
            assert await controller.phase("gone") is None
    assert api.writes() == []
    assert 'deployments.apps "gone" not found' in caplog.text


async def test_activate_of_a_missing_object_raises_the_status(api: FakeApiServer) -> None:
    members = {"gone": KubernetesTarget("Deployment", "gone")}
    config = ApiConfig(server=api.url, token=TOKEN)
    async with KubernetesController("pool", NS, members, config) as controller:
        with pytest.raises(KubernetesError) as caught:
            await controller.activate("gone")
    error = caught.value
    assert (error.status, error.reason) == (404, "NotFound")
    assert 'deployments.apps "gone" not found' in error.message
    assert "get member 'gone'" in str(error)


async def test_conflict_is_retried_once(api: FakeApiServer) -> None:
    conflict = (
        409,
        "Conflict",
        'Operation cannot be fulfilled on deployments.apps "b": the object has been modified; '
        "please apply your changes to the latest version and try again",
    )
    async with two_deployments(api, 0, 0) as controller:
        api.script[("PATCH", f"{DEPLOY}/b/scale")] = [conflict]
        await controller.activate("b")
        assert api.replicas(f"{DEPLOY}/b") == 1
        assert [(c.method, c.path) for c in api.calls[1:]] == [
            ("GET", f"{DEPLOY}/b/scale"),
            ("PATCH", f"{DEPLOY}/b/scale"),  # 409
            ("GET", f"{DEPLOY}/b/scale"),  # re-read
            ("PATCH", f"{DEPLOY}/b/scale"),  # the one retry
        ]
        # Only once: a second conflict is the caller's to handle.
        api.script[("PATCH", f"{DEPLOY}/b/scale")] = [conflict, conflict]
        with pytest.raises(KubernetesError) as caught:
            await controller.deactivate("b")
    assert (caught.value.status, caught.value.reason) == (409, "Conflict")
    assert "scale down member 'b'" in str(caught.value)


async def test_other_errors_carry_the_api_message(api: FakeApiServer) -> None:
    forbidden = (
        403,
        "Forbidden",
        'deployments.apps "b" is forbidden: User "system:serviceaccount:models:router" cannot '
        'patch resource "deployments/scale" in API group "apps" in the namespace "models"',
    )
    async with two_deployments(api, 0, 0) as controller:
        api.script[("PATCH", f"{DEPLOY}/b/scale")] = [forbidden]
        with pytest.raises(KubernetesError) as caught:
            await controller.activate("b")
    assert (caught.value.status, caught.value.reason) == (403, "Forbidden")
    assert "cannot patch resource" in caught.value.message
    assert len(api.writes()) == 1  # no retry for anything but 409


async def test_wrong_token_is_unauthorized(api: FakeApiServer) -> None:
    members = {"a": KubernetesTarget("Deployment", "a")}
    api.add_workload("deployments", "a", 0)
    config = ApiConfig(server=api.url, token="stale")
    async with KubernetesController("pool", NS, members, config) as controller:
        with pytest.raises(KubernetesError) as caught:
            await controller.activate("a")
        assert await controller.phase("a") is None
    assert (caught.value.status, caught.value.reason) == (401, "Unauthorized")
    assert api.calls == []


@pytest.mark.parametrize("where", ["handler", "backlog"])
async def test_a_server_that_never_answers_times_out(api: FakeApiServer, where: str) -> None:
    api.add_workload("deployments", "a", 0)
    members = {"a": KubernetesTarget("Deployment", "a")}
    if where == "handler":
        api.hang.add(f"{DEPLOY}/a/scale")
        server = api.url
        silent = None
    else:  # the kernel accepts the connection; nobody ever reads it
        silent = bind_listener("silent", ListenAddress("127.0.0.1", 0))
        server = f"http://127.0.0.1:{silent.getsockname()[1]}"
    config = ApiConfig(server=server, token=TOKEN)
    try:
        async with KubernetesController(
            "pool", NS, members, config, request_timeout=0.3
        ) as controller:
            start = trio.current_time()
            with pytest.raises(KubernetesError) as caught:
                await controller.activate("a")
            elapsed = trio.current_time() - start
            assert await controller.phase("a") is None
    finally:
        if silent is not None:
            silent.close()
    assert 0.25 <= elapsed < 1.5
    assert (caught.value.status, caught.value.reason) == (None, "Timeout")
    assert "within 0.3 s" in str(caught.value)


# ---- configuration -------------------------------------------------------------------------------


async def test_token_file_is_reread_on_every_call(api: FakeApiServer, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    config = ApiConfig(server=api.url, token_file=token)
    api.add_workload("deployments", "a", 0)
    api.add_workload("deployments", "b", 0)
    members = {"a": KubernetesTarget("Deployment", "a"), "b": KubernetesTarget("Deployment", "b")}
    async with KubernetesController("pool", NS, members, config) as controller:
        await controller.activate("a")
        api.token = "rotated"
        token.write_text("rotated")
        await controller.activate("b")
    assert api.replicas(f"{DEPLOY}/a") == 0
    assert api.replicas(f"{DEPLOY}/b") == 1


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_kubeconfig_with_token_and_ca_data(tmp_path: Path) -> None:
    ca = trustme.CA()
    client = ca.issue_cert("router@example")
    path = tmp_path / "config"
    path.write_text(
        json.dumps(  # JSON is YAML; it keeps the test free of indentation mistakes
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "prod",
                "clusters": [
                    {
                        "name": "prod-cluster",
                        "cluster": {
                            "server": "https://kube.example:6443",
                            "certificate-authority-data": _b64(ca.cert_pem.bytes()),
                        },
                    },
                    {
                        "name": "lab-cluster",
                        "cluster": {
                            "server": "https://10.0.0.5:6443",
                            "insecure-skip-tls-verify": True,
                        },
                    },
                ],
                "contexts": [
                    {
                        "name": "prod",
                        "context": {"cluster": "prod-cluster", "user": "bot", "namespace": "llm"},
                    },
                    {"name": "lab", "context": {"cluster": "lab-cluster", "user": "cert-user"}},
                    {"name": "sso", "context": {"cluster": "lab-cluster", "user": "sso"}},
                ],
                "users": [
                    {"name": "bot", "user": {"token": "kube-token"}},
                    {
                        "name": "cert-user",
                        "user": {
                            "client-certificate-data": _b64(client.cert_chain_pems[0].bytes()),
                            "client-key-data": _b64(client.private_key_pem.bytes()),
                        },
                    },
                    {"name": "sso", "user": {"exec": {"command": "kubelogin"}}},
                ],
            }
        )
    )
    config = load_api_config(environ={"KUBECONFIG": str(path), "HOME": str(tmp_path)})
    assert config.server == "https://kube.example:6443"
    assert config.namespace == "llm"
    assert config.bearer_token() == "kube-token"
    assert config.ca_data == ca.cert_pem.bytes()
    assert "kube-token" not in repr(config)
    context = config.ssl_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert any("trustme" in str(cert["subject"]) for cert in context.get_ca_certs())

    lab = load_api_config(path, context="lab")
    assert lab.server == "https://10.0.0.5:6443"
    assert lab.insecure_skip_tls_verify and lab.bearer_token() is None
    insecure = lab.ssl_context()  # also loads the inline client certificate and key
    assert insecure.verify_mode == ssl.CERT_NONE and not insecure.check_hostname
    assert not list(tmp_path.glob("stargate-kube-*"))

    with pytest.raises(KubernetesConfigError, match="'exec' credentials"):
        load_api_config(path, context="sso")
    with pytest.raises(KubernetesConfigError, match="no context named 'nope'"):
        load_api_config(path, context="nope")


def test_kubeconfig_relative_ca_path_and_default_location(tmp_path: Path) -> None:
    kube = tmp_path / ".kube"
    kube.mkdir()
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(kube / "ca.pem"))
    (kube / "config").write_text(
        "current-context: dev\n"
        "clusters:\n"
        "- name: dev\n"
        "  cluster:\n"
        "    server: https://127.0.0.1:6443\n"
        "    certificate-authority: ca.pem\n"
        "contexts:\n"
        "- name: dev\n"
        "  context: {cluster: dev, user: dev}\n"
        "users:\n"
        "- name: dev\n"
        "  user: {token: dev-token}\n"
    )
    config = load_api_config(environ={"HOME": str(tmp_path)})
    assert config.ca_file == kube / "ca.pem"
    assert config.ssl_context().get_ca_certs()


def test_in_cluster_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token-1")
    (account / "namespace").write_text("models\n")
    trustme.CA().cert_pem.write_to_path(str(account / "ca.crt"))
    monkeypatch.setattr(kubernetes, "SERVICE_ACCOUNT_DIR", account)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    config = load_api_config(environ=env)
    assert config.server == "https://10.96.0.1:443"
    assert config.namespace == "models"
    assert config.ca_file == account / "ca.crt"
    assert config.ssl_context().get_ca_certs()
    assert config.bearer_token() == "pod-token-1"
    (account / "token").write_text("pod-token-2")  # the kubelet rotated it
    assert config.bearer_token() == "pod-token-2"

    six = load_api_config(environ={**env, "KUBERNETES_SERVICE_HOST": "fd00::1"})
    assert six.server == "https://[fd00::1]:443"
    (account / "token").unlink()
    with pytest.raises(KubernetesConfigError, match="no service-account token"):
        load_api_config(environ=env)


def test_no_configuration_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KubernetesConfigError, match="not running in a cluster") as caught:
        load_api_config(environ={"HOME": str(tmp_path)})
    assert str(tmp_path / ".kube" / "config") in str(caught.value)
    with pytest.raises(KubernetesConfigError, match="KUBECONFIG names no readable file"):
        load_api_config(environ={"KUBECONFIG": str(tmp_path / "missing")})
