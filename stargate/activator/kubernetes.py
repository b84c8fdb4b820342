"""The Kubernetes member controller: a pool member is a workload whose replicas we flip 0 <-> 1.

docs/decisions.md, D7: a member is a Deployment or StatefulSet, scaled through its `scale`
subresource, or a custom resource with `spec.replicas` (an LLMKube InferenceService), merge-patched
directly. docs/activator.md, "Controllers" describes upstream's controller; this one keeps its
shape:

* every call is a live, uncached API request (no informer, no watch): the activator's residency
  belief is re-verified elsewhere, and a cache would only add staleness;
* `activate` is idempotent *by check*: at replicas >= 1 it writes nothing, so it never
  re-asserts a scale-up (upstream behaviour the #1837 fix was designed around);
* writes are JSON merge patches of `{"spec":{"replicas":N}}` with no resourceVersion: no
  optimistic lock, last writer wins, as upstream. A 409 (an admission webhook or an old server
  can still report one) is answered by one re-read and one retry.

One difference from upstream, where the LLMKube operator owns the slot: stargate has no operator,
so this controller owns slot exclusivity (controller.py): activating a member first scales every
other member of the pool that is up to 0, in declaration order, then scales the member to 1. It
does not wait for the old Pods to go; when members request the GPU, the scheduler keeps the new
Pod Pending until the old one has released it, which is the exclusivity we need.

Why no Kubernetes client library: the maintained async clients (kubernetes_asyncio, kr8s,
lightkube's async API) run on asyncio only, and stargate is trio-only. The synchronous official
client would need a thread per call and brings a large dependency tree. We need a handful of
calls (GET and PATCH, on a scale subresource or on an object; GET, POST and PUT on the pool
Leases of lease_ownership.py), so plain HTTP through `httpx.AsyncClient` (which runs on trio via
anyio), shared by both through `KubernetesApi`, is smaller and easier to reason about.
Configuration is read the way client-go reads it, minus exec/auth-provider plugins (see
`load_api_config`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final
from urllib.parse import quote

import httpx
import trio
import yaml

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "ApiConfig",
    "KubernetesApi",
    "KubernetesConfigError",
    "KubernetesController",
    "KubernetesError",
    "KubernetesTarget",
    "load_api_config",
]

log = logging.getLogger(__name__)

#: Where the kubelet mounts a Pod's service-account credentials. Tests point it elsewhere.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

MERGE_PATCH: Final = "application/merge-patch+json"

# Kinds whose replicas live behind the `scale` subresource in apps/v1 (their `spec.replicas` can
# also be patched, but the subresource is the narrow interface RBAC can grant on its own).
_SCALE_KINDS: Final = frozenset({"Deployment", "StatefulSet", "ReplicaSet"})


class KubernetesConfigError(Exception):
    """No usable API configuration (no in-cluster service account and no usable kubeconfig)."""


class KubernetesError(Exception):
    """The API server refused a call, or did not answer in time.

    `status` is the HTTP status (None when there was no response: timeout or transport error),
    `reason` the `Status.reason` (e.g. "NotFound", "Conflict", "Timeout"), and `message` says what
    we were doing followed by the API's own `Status.message`.
    """

    def __init__(self, status: int | None, reason: str, message: str) -> None:
        super().__init__(status, reason, message)
        self.status = status
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        code = "no response" if self.status is None else str(self.status)
        return f"{self.message} ({code} {self.reason})"


# ---- targets -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KubernetesTarget:
    """The workload behind one pool member.

    `plural` is the resource name in URLs; the default (lowercase kind + "s") is right for
    Deployment, StatefulSet and InferenceService, so it only needs setting for irregular plurals.
    """

    kind: str
    name: str
    api_version: str = "apps/v1"
    plural: str | None = None

    @property
    def resource(self) -> str:
        return self.plural if self.plural is not None else self.kind.lower() + "s"

    @property
    def uses_scale_subresource(self) -> bool:
        return self.api_version == "apps/v1" and self.kind in _SCALE_KINDS

    def path(self, namespace: str) -> str:
        """The URL path of the object that holds the replicas (the scale subresource if any)."""
        # The core group ("v1") lives under /api, every named group under /apis.
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{prefix}/namespaces/{_segment(namespace)}/{_segment(self.resource)}"
        path += f"/{_segment(self.name)}"
        return path + "/scale" if self.uses_scale_subresource else path

    def describe(self, namespace: str) -> str:
        return f"{self.kind} {namespace}/{self.name}"


def _segment(value: str) -> str:
    # Kubernetes names are DNS labels, but never let a stray "/" or "?" change the URL's meaning.
    return quote(value, safe="")


# ---- API configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiConfig:
    """How to reach and authenticate to the API server.

    Credentials are kept as given (paths or inline PEM) and turned into an `ssl.SSLContext` by
    `ssl_context()`. `token_file` is re-read on every call because projected service-account
    tokens rotate (hourly by default) and the old one stops working.
    """

    server: str
    namespace: str | None = None
    token: str | None = field(default=None, repr=False)  # never log a credential
    token_file: Path | None = None
    ca_file: Path | None = None
    ca_data: bytes | None = None
    insecure_skip_tls_verify: bool = False
    client_cert_file: Path | None = None
    client_key_file: Path | None = None
    client_cert_data: bytes | None = None
    client_key_data: bytes | None = field(default=None, repr=False)
    proxy_url: str | None = None
    source: str = "explicit"

    def bearer_token(self) -> str | None:
        """The token to send: the file's current content if there is a file, else `token`."""
        if self.token_file is not None:
            try:
                return self.token_file.read_text().strip() or None
            except OSError as error:
                raise KubernetesConfigError(
                    f"cannot read API token {self.token_file}: {error.strerror or error}"
                ) from error
        return self.token

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context: the configured CA (else the system's), and the client cert."""
        if self.insecure_skip_tls_verify:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            cadata = None if self.ca_data is None else self.ca_data.decode("ascii", "replace")
            context = ssl.create_default_context(
                cafile=None if self.ca_file is None else str(self.ca_file), cadata=cadata
            )
        self._load_client_cert(context)
        return context

    def _load_client_cert(self, context: ssl.SSLContext) -> None:
        has_cert = self.client_cert_file is not None or self.client_cert_data is not None
        has_key = self.client_key_file is not None or self.client_key_data is not None
        if not has_cert and not has_key:
            return
        if not (has_cert and has_key):
            raise KubernetesConfigError(
                f"{self.source}: a client certificate needs both a certificate and a key"
            )
        # `ssl` loads certificate chains from files only: inline data goes through a private
        # temporary directory that is removed as soon as the chain is loaded.
        with tempfile.TemporaryDirectory(prefix="stargate-kube-") as tmp:
            cert = self.client_cert_file or _write_private(Path(tmp, "cert"), self.client_cert_data)
            key = self.client_key_file or _write_private(Path(tmp, "key"), self.client_key_data)
            try:
                context.load_cert_chain(str(cert), str(key))
            except (OSError, ssl.SSLError) as error:
                raise KubernetesConfigError(
                    f"{self.source}: cannot load the client certificate: {error}"
                ) from error


def _write_private(path: Path, data: bytes | None) -> Path:
    assert data is not None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return path


def load_api_config(
    kubeconfig: str | os.PathLike[str] | None = None,
    *,
    context: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ApiConfig:
    """Find the API configuration the way controller-runtime's `GetConfig` does.

    Order: an explicit `kubeconfig` path; then `$KUBECONFIG` (a path list; files are merged, the
    first definition of a name wins); then the in-cluster service account (when
    `KUBERNETES_SERVICE_HOST` is set); then `~/.kube/config`. Raises `KubernetesConfigError`
    saying what was tried when none is usable.
    """
    env = os.environ if environ is None else environ
    if kubeconfig is not None:
        return _load_kubeconfig([Path(kubeconfig)], context)
    listed = [Path(p) for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    if listed:
        existing = [p for p in listed if p.is_file()]
        if not existing:
            raise KubernetesConfigError(
                f"KUBECONFIG names no readable file: {env.get('KUBECONFIG')}"
            )
        return _load_kubeconfig(existing, context)
    if env.get("KUBERNETES_SERVICE_HOST"):
        return _in_cluster(env)
    home = Path(env.get("HOME") or Path.home())
    default = home / ".kube" / "config"
    if default.is_file():
        return _load_kubeconfig([default], context)
    raise KubernetesConfigError(
        "no Kubernetes API configuration: not running in a cluster (KUBERNETES_SERVICE_HOST is "
        f"unset), KUBECONFIG is unset, and {default} does not exist"
    )


def _in_cluster(env: Mapping[str, str]) -> ApiConfig:
    host = env["KUBERNETES_SERVICE_HOST"]
    port = env.get("KUBERNETES_SERVICE_PORT", "")
    if not port:
        raise KubernetesConfigError(
            "in-cluster configuration: KUBERNETES_SERVICE_HOST is set but "
            "KUBERNETES_SERVICE_PORT is not"
        )
    token = SERVICE_ACCOUNT_DIR / "token"
    if not token.is_file():
        raise KubernetesConfigError(
            f"in-cluster configuration: no service-account token at {token} "
            "(is automountServiceAccountToken disabled?)"
        )
    ca = SERVICE_ACCOUNT_DIR / "ca.crt"
    namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
    bracketed = f"[{host}]" if ":" in host else host  # an IPv6 service address
    return ApiConfig(
        server=f"https://{bracketed}:{port}",
        namespace=namespace or None,
        token_file=token,
        ca_file=ca if ca.is_file() else None,
        source="in-cluster",
    )


def _load_kubeconfig(paths: Sequence[Path], context_name: str | None) -> ApiConfig:
    """Merge the files (first wins, like kubectl) and resolve the chosen context."""
    source = os.pathsep.join(str(p) for p in paths)
    current: str | None = None
    named: dict[str, dict[str, tuple[dict[str, Any], Path]]] = {
        "clusters": {},
        "contexts": {},
        "users": {},
    }
    for path in paths:
        try:
            document = yaml.safe_load(path.read_text())
        except OSError as error:
            raise KubernetesConfigError(f"cannot read kubeconfig {path}: {error}") from error
        except yaml.YAMLError as error:
            raise KubernetesConfigError(f"kubeconfig {path} is not valid YAML: {error}") from error
        if document is None:
            continue
        if not isinstance(document, dict):
            raise KubernetesConfigError(f"kubeconfig {path} is not a mapping")
        if current is None and document.get("current-context"):
            current = str(document["current-context"])
        for section, key in (("clusters", "cluster"), ("contexts", "context"), ("users", "user")):
            for entry in document.get(section) or []:
                if isinstance(entry, dict) and "name" in entry:
                    body = entry.get(key) or {}
                    named[section].setdefault(str(entry["name"]), (body, path.parent))
    chosen = context_name or current
    if not chosen:
        raise KubernetesConfigError(f"kubeconfig {source}: no current-context and none given")
    if chosen not in named["contexts"]:
        raise KubernetesConfigError(f"kubeconfig {source}: no context named {chosen!r}")
    ctx, _ = named["contexts"][chosen]
    cluster_name = str(ctx.get("cluster", ""))
    if cluster_name not in named["clusters"]:
        raise KubernetesConfigError(
            f"kubeconfig {source}: context {chosen!r} names unknown cluster {cluster_name!r}"
        )
    cluster, cluster_dir = named["clusters"][cluster_name]
    server = cluster.get("server")
    if not server:
        raise KubernetesConfigError(f"kubeconfig {source}: cluster {cluster_name!r} has no server")
    user_name = ctx.get("user")
    user: dict[str, Any] = {}
    user_dir = cluster_dir
    if user_name:
        if str(user_name) not in named["users"]:
            raise KubernetesConfigError(
                f"kubeconfig {source}: context {chosen!r} names unknown user {user_name!r}"
            )
        user, user_dir = named["users"][str(user_name)]
    for plugin in ("exec", "auth-provider"):
        if user.get(plugin):
            raise KubernetesConfigError(
                f"kubeconfig {source}: user {user_name!r} uses {plugin!r} credentials, which "
                "stargate does not run; use a token or a client certificate"
            )
    where = f"kubeconfig {source} (context {chosen!r})"
    return ApiConfig(
        server=str(server),
        namespace=str(ctx["namespace"]) if ctx.get("namespace") else None,
        token=str(user["token"]) if user.get("token") else None,
        token_file=_file(user, "tokenFile", user_dir),
        ca_file=_file(cluster, "certificate-authority", cluster_dir),
        ca_data=_data(cluster, "certificate-authority-data", where),
        insecure_skip_tls_verify=bool(cluster.get("insecure-skip-tls-verify", False)),
        client_cert_file=_file(user, "client-certificate", user_dir),
        client_key_file=_file(user, "client-key", user_dir),
        client_cert_data=_data(user, "client-certificate-data", where),
        client_key_data=_data(user, "client-key-data", where),
        proxy_url=str(cluster["proxy-url"]) if cluster.get("proxy-url") else None,
        source=where,
    )


def _file(section: Mapping[str, Any], key: str, base: Path) -> Path | None:
    # Relative paths in a kubeconfig are relative to the file that holds them.
    value = section.get(key)
    return None if not value else base / Path(str(value)).expanduser()


def _data(section: Mapping[str, Any], key: str, where: str) -> bytes | None:
    value = section.get(key)
    if not value:
        return None
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError) as error:
        raise KubernetesConfigError(f"{where}: {key} is not valid base64") from error


# ---- HTTP plumbing -------------------------------------------------------------------------------


class KubernetesApi:
    """One API server connection: authentication, the per-request bound, and error mapping.

    Shared by the member controller and the pool leases (lease.py), so both send the same
    credentials and turn the same failures into `KubernetesError`. Every request is bounded by
    `request_timeout` as a whole (see `request`). Pass `client` to share a connection pool, or
    `transport` (e.g. `httpx.ASGITransport` over a fake API server) to run without a network;
    otherwise a client is made from `api`, and `aclose()` closes whatever this object made.
    """

    def __init__(
        self,
        api: ApiConfig,
        *,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        request_timeout: float = 10.0,
        user_agent: str = "stargate-activator",
    ) -> None:
        if client is not None and transport is not None:
            raise ValueError("pass a client or a transport, not both")
        self.api = api
        self.request_timeout = request_timeout
        self.user_agent = user_agent
        self._owns_client = client is None
        if client is None:
            if transport is not None:
                client = httpx.AsyncClient(
                    transport=transport, timeout=request_timeout, follow_redirects=False
                )
            else:
                client = httpx.AsyncClient(
                    verify=api.ssl_context() if api.server.startswith("https:") else True,
                    proxy=api.proxy_url,
                    timeout=request_timeout,
                    trust_env=False,
                    follow_redirects=False,
                )
        self._client = client
        self.base = api.server.rstrip("/")

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: object | None,
        doing: str,
        *,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        """Send one request; return the JSON object answered, or raise `KubernetesError`.

        `doing` starts every error message ("scale up member 'a' (...)"), so a log line says
        what failed without a traceback. `body`, if any, is sent as JSON with `content_type`
        (default `application/json`).
        """
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        try:
            if self.api.token_file is not None:
                token = await trio.to_thread.run_sync(self.api.bearer_token)
            else:
                token = self.api.token
        except KubernetesConfigError as error:
            raise KubernetesError(None, "Unauthorized", f"{doing}: {error}") from error
        if token:
            headers["Authorization"] = f"Bearer {token}"
        content = None
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
            content = json.dumps(body).encode()
        url = self.base + path
        timeout = self.request_timeout
        try:
            # httpx's timeout bounds each phase; the trio deadline bounds the whole request, so a
            # server that trickles bytes cannot hold a call (made under the pool lock) forever.
            with trio.fail_after(timeout):
                response = await self._client.request(
                    method, url, headers=headers, content=content, timeout=timeout
                )
        except (trio.TooSlowError, httpx.TimeoutException) as error:
            raise KubernetesError(
                None, "Timeout", f"{doing}: no answer from {self.base} within {timeout:g} s"
            ) from error
        except httpx.TransportError as error:
            raise KubernetesError(
                None, "TransportError", f"{doing}: {type(error).__name__}: {error}"
            ) from error
        if not response.is_success:
            raise _status_error(response, doing)
        try:
            answer = response.json()
        except ValueError as error:
            raise KubernetesError(
                response.status_code, "BadResponse", f"{doing}: response is not JSON"
            ) from error
        if not isinstance(answer, dict):
            raise KubernetesError(
                response.status_code, "BadResponse", f"{doing}: response is not an object"
            )
        return answer


# ---- the controller ------------------------------------------------------------------------------


class KubernetesController:
    """Scale a pool's members between 0 and 1 replicas (the `MemberController` protocol).

    Every API request is bounded by `request_timeout` (upstream has no bound; docs/decisions.md,
    D16): a timed-out PATCH raises `KubernetesError` and must be treated as possibly applied, which
    the activator does. Pass `client` to share a connection pool (tests pass one for plain HTTP);
    otherwise the controller makes its own from `api` and `aclose()` closes it.
    """

    def __init__(
        self,
        pool_name: str,
        namespace: str,
        members: Mapping[str, KubernetesTarget],
        api: ApiConfig,
        *,
        client: httpx.AsyncClient | None = None,
        request_timeout: float = 10.0,
    ) -> None:
        if not members:
            raise ValueError(f"pool {pool_name!r} has no members")
        self.pool_name = pool_name
        self.namespace = namespace
        self.members = dict(members)
        self.api = api
        self.request_timeout = request_timeout
        self._http = KubernetesApi(api, client=client, request_timeout=request_timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> KubernetesController:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ---- the protocol -------------------------------------------------------------------------

    async def activate(self, member: str) -> None:
        """Scale every other up member to 0 (declaration order), then `member` to 1 if needed."""
        target = self._target(member)
        for other, other_target in self.members.items():
            if other != member:
                await self._scale_down(other, other_target)
        where = self._where(member, target)
        replicas = await self._replicas(target, f"get member {where}")
        if replicas is not None and replicas >= 1:
            return  # idempotent by check: never re-assert a scale-up
        await self._patch_replicas(target, 1, f"scale up member {where}")
        log.info("scaled up pool member", extra={"pool": self.pool_name, "member": member})

    async def deactivate(self, member: str) -> None:
        """Scale `member` to 0. Already 0 is a no-op; an object that is gone counts as done."""
        await self._scale_down(member, self._target(member))

    async def phase(self, member: str) -> str | None:
        """`Scaled(N)` with the desired replicas, or None when the API cannot be read.

        A custom resource that leaves `spec.replicas` unset reports `Scaled(default)`: its
        operator decides, so it is not reported as stopped.
        """
        try:
            target = self._target(member)
            replicas = await self._replicas(target, f"get member {self._where(member, target)}")
        except (KubernetesError, KubernetesConfigError, ValueError) as error:
            log.debug("pool member phase unknown: %s", error)
            return None
        return f"Scaled({'default' if replicas is None else replicas})"

    # ---- internals ----------------------------------------------------------------------------

    def _target(self, member: str) -> KubernetesTarget:
        try:
            return self.members[member]
        except KeyError:
            raise ValueError(f"pool {self.pool_name!r} has no member {member!r}") from None

    def _where(self, member: str, target: KubernetesTarget) -> str:
        return f"{member!r} ({target.describe(self.namespace)})"

    async def _scale_down(self, member: str, target: KubernetesTarget) -> None:
        where = self._where(member, target)
        try:
            replicas = await self._replicas(target, f"get member {where}")
            # Unset replicas on a custom resource means "the default", which may be 1: patch.
            if replicas == 0:
                return
            await self._patch_replicas(target, 0, f"scale down member {where}")
        except KubernetesError as error:
            if error.status != 404:
                raise
            log.warning("pool member to scale down is gone; treating as stopped: %s", error)
            return
        log.info("scaled down pool member", extra={"pool": self.pool_name, "member": member})

    async def _replicas(self, target: KubernetesTarget, doing: str) -> int | None:
        """The desired replicas, or None when a custom resource leaves `spec.replicas` unset."""
        body = await self._request("GET", target, None, doing)
        spec = body.get("spec")
        replicas = spec.get("replicas") if isinstance(spec, dict) else None
        if replicas is None:
            # `Scale.spec.replicas` is `omitempty`: the API server leaves it out when it is 0.
            return 0 if target.uses_scale_subresource else None
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise KubernetesError(None, "BadResponse", f"{doing}: spec.replicas is {replicas!r}")
        return replicas

    async def _patch_replicas(self, target: KubernetesTarget, replicas: int, doing: str) -> None:
        patch = {"spec": {"replicas": replicas}}
        try:
            await self._request("PATCH", target, patch, doing)
        except KubernetesError as error:
            if error.status != 409:
                raise
            # A merge patch without resourceVersion rarely conflicts; when it does, re-read (the
            # other writer may already have done our work) and try exactly once more.
            log.info("conflict on pool member patch; retrying once: %s", error)
            current = await self._replicas(target, doing)
            if current == replicas or (replicas >= 1 and current is not None and current >= 1):
                return
            await self._request("PATCH", target, patch, doing)

    async def _request(
        self, method: str, target: KubernetesTarget, patch: object | None, doing: str
    ) -> dict[str, Any]:
        content_type = None if patch is None else MERGE_PATCH
        return await self._http.request(
            method, target.path(self.namespace), patch, doing, content_type=content_type
        )


def _status_error(response: httpx.Response, doing: str) -> KubernetesError:
    """Turn a non-2xx answer into `KubernetesError`, preferring the API's `Status` object."""
    reason = response.reason_phrase or "Error"
    message = response.text.strip()[:500]
    with contextlib.suppress(ValueError):
        body = response.json()
        if isinstance(body, dict) and body.get("kind") == "Status":
            reason = str(body.get("reason") or reason)
            message = str(body.get("message") or message)
    return KubernetesError(response.status_code, reason, f"{doing}: {message}")
