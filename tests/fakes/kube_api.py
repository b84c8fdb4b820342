"""A fake Kubernetes API server that speaks the real JSON: a raw ASGI app.

It keeps Deployments, StatefulSets and LLMKube InferenceServices, serves `Scale` objects on the
`scale` subresource, applies RFC 7386 merge patches, keeps `coordination.k8s.io/v1` Leases with
the API server's optimistic concurrency (a PUT must carry the current
`metadata.resourceVersion`, else 409 Conflict), answers errors with `Status` bodies, and insists
on the bearer token and the merge-patch content type, so a client that drifts from the wire
contract fails here rather than against a cluster.

Serve it on loopback with Hypercorn (tests/unit/activator/test_kubernetes.py), or in memory with
`server.transport(host)` (an `httpx.ASGITransport`), which also runs under `trio.testing.MockClock`.
The client host given to `transport` lets `partition` cut off one replica and not the others.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import trio

from stargate.asgi import answer_lifespan

NS = "models"
TOKEN = "s3cr3t-token"
ISVC = "/apis/inference.llmkube.dev/v1alpha1/namespaces/models/inferenceservices"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, which is what the API server applies for application/merge-patch+json."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass
class Call:
    method: str
    path: str
    content_type: str | None = None
    body: Any = None
    client: str | None = None  # the client host (ASGI scope), for in-memory transports
    at: float = 0.0  # trio.current_time() when the request arrived


@dataclass
class Partition:
    """Requests that fail: `writes` only (POST, PUT, PATCH) or `all`; from `hosts` (client hosts,
    see `FakeApiServer.transport`), or from everybody when None. `answer` is a 503 Status, or
    `timeout`: the request hangs until the client gives up (or `released` is set)."""

    scope: Literal["writes", "all"] = "writes"
    answer: Literal["503", "timeout"] = "503"
    hosts: frozenset[str] | None = None

    def cuts(self, method: str, host: str | None) -> bool:
        if self.hosts is not None and host not in self.hosts:
            return False
        return self.scope == "all" or method in ("POST", "PUT", "PATCH")


@dataclass
class FakeApiServer:
    """Objects by path; every request is recorded in `calls` (after the auth check)."""

    token: str = TOKEN
    url: str = ""
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    # (method, path) -> (code, reason, message) answers to give before behaving normally.
    script: dict[tuple[str, str], list[tuple[int, str, str]]] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)
    released: trio.Event = field(default_factory=trio.Event)
    version: int = 100
    partitions: list[Partition] = field(default_factory=list)

    # ---- workloads -----------------------------------------------------------------------------

    def add_workload(self, plural: str, name: str, replicas: int) -> str:
        path = f"/apis/apps/v1/namespaces/{NS}/{plural}/{name}"
        kind = {"deployments": "Deployment", "statefulsets": "StatefulSet"}[plural]
        self.objects[path] = self._metadata(
            {"apiVersion": "apps/v1", "kind": kind, "spec": {"replicas": replicas}}, name
        )
        return path + "/scale"

    def add_inference_service(self, name: str, replicas: int | None) -> str:
        path = f"{ISVC}/{name}"
        spec: dict[str, Any] = {"modelRef": f"{name}-model", "resources": {"gpu": 1}}
        if replicas is not None:
            spec["replicas"] = replicas
        self.objects[path] = self._metadata(
            {
                "apiVersion": "inference.llmkube.dev/v1alpha1",
                "kind": "InferenceService",
                "spec": spec,
                "status": {"phase": "Stopped"},
            },
            name,
        )
        return path

    def replicas(self, path: str) -> int | None:
        obj = self.objects[path.removesuffix("/scale")]
        value = obj["spec"].get("replicas")
        return None if value is None else int(value)

    def writes(self) -> list[tuple[str, Any]]:
        return [(c.path, c.body) for c in self.calls if c.method == "PATCH"]

    # ---- leases --------------------------------------------------------------------------------

    def lease_path(self, name: str, namespace: str = NS) -> str:
        return f"{LEASES.format(namespace=namespace)}/{name}"

    def lease(self, name: str, namespace: str = NS) -> dict[str, Any] | None:
        """The stored Lease object, or None."""
        return self.objects.get(self.lease_path(name, namespace))

    def lease_holder(self, name: str, namespace: str = NS) -> str | None:
        lease = self.lease(name, namespace)
        return None if lease is None else lease.get("spec", {}).get("holderIdentity")

    # ---- faults --------------------------------------------------------------------------------

    def partition(
        self,
        scope: Literal["writes", "all"] = "writes",
        *,
        answer: Literal["503", "timeout"] = "503",
        hosts: set[str] | None = None,
    ) -> Partition:
        """From now on fail matching requests (see `Partition`); `heal` undoes it."""
        cut = Partition(scope, answer, None if hosts is None else frozenset(hosts))
        self.partitions.append(cut)
        return cut

    def heal(self, cut: Partition | None = None) -> None:
        """End one partition, or all of them."""
        if cut is None:
            self.partitions.clear()
        else:
            self.partitions.remove(cut)

    # ---- serving -------------------------------------------------------------------------------

    def transport(self, host: str = "127.0.0.1") -> httpx.ASGITransport:
        """An in-memory transport to this server whose requests come from client `host`."""
        return httpx.ASGITransport(app=self, client=(host, 40000))

    def _metadata(self, obj: dict[str, Any], name: str) -> dict[str, Any]:
        self.version += 1
        obj["metadata"] = {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "resourceVersion": str(self.version),
            "creationTimestamp": "2026-01-01T00:00:00Z",
        }
        return obj

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        client = scope.get("client")
        host = str(client[0]) if client else None
        code, answer = await self._handle(scope["method"], scope["path"], headers, body, host)
        payload = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": code,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _handle(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, host: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        if headers.get("authorization") != f"Bearer {self.token}":
            return 401, status_body(401, "Unauthorized", "Unauthorized")
        content_type = headers.get("content-type")
        body = json.loads(raw) if raw else None
        self.calls.append(Call(method, path, content_type, body, host, trio.current_time()))
        for cut in self.partitions:
            if cut.cuts(method, host):
                if cut.answer == "timeout":
                    await self.released.wait()
                    return 504, status_body(504, "Timeout", "released")
                return 503, status_body(503, "ServiceUnavailable", "the server is unavailable")
        if path in self.hang:
            with trio.move_on_after(10):
                await self.released.wait()
            return 504, status_body(504, "Timeout", "released")
        scripted = self.script.get((method, path))
        if scripted:
            code, reason, message = scripted.pop(0)
            return code, status_body(code, reason, message)
        if "/apis/coordination.k8s.io/v1/" in path:
            return self._lease_call(method, path, content_type, body)
        is_scale = path.endswith("/scale")
        obj_path = path.removesuffix("/scale")
        obj = self.objects.get(obj_path)
        if obj is None:
            parts = obj_path.split("/")
            resource = parts[-2] + (".apps" if "/apps/" in obj_path else "")
            return 404, status_body(404, "NotFound", f'{resource} "{parts[-1]}" not found')
        if method == "PATCH":
            if content_type != "application/merge-patch+json":
                return 415, status_body(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types "
                    "include: application/json-patch+json, application/merge-patch+json, "
                    "application/apply-patch+yaml",
                )
            if is_scale:
                scale = merge_patch(self._scale(obj), body)
                obj["spec"]["replicas"] = int(scale["spec"].get("replicas", 0))
            else:
                merged = merge_patch(obj, body)
                obj.clear()
                obj.update(merged)
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
        elif method != "GET":
            return 405, status_body(405, "MethodNotAllowed", f"{method} not allowed")
        return 200, self._scale(obj) if is_scale else obj

    def _lease_call(
        self, method: str, path: str, content_type: str | None, body: Any
    ) -> tuple[int, dict[str, Any]]:
        """Leases as the API server keeps them: create on the collection, GET and PUT on the
        item; a PUT needs the current resourceVersion."""
        parts = path.split("/")
        # /apis/coordination.k8s.io/v1/namespaces/{ns}/leases[/{name}]
        if len(parts) not in (7, 8) or parts[4] != "namespaces" or parts[6] != "leases":
            return 404, status_body(404, "NotFound", "the server could not find the resource")
        namespace = parts[5]
        if method == "POST" and len(parts) == 7:
            return self._create_lease(namespace, content_type, body)
        if len(parts) != 8:
            return 405, status_body(405, "MethodNotAllowed", f"{method} not allowed")
        name = parts[7]
        stored = self.objects.get(path)
        if method == "GET":
            if stored is None:
                return 404, _lease_not_found(name)
            return 200, stored
        if method != "PUT":
            return 405, status_body(405, "MethodNotAllowed", f"{method} not allowed")
        if content_type != "application/json":
            return 415, status_body(415, "UnsupportedMediaType", f"unsupported {content_type}")
        if stored is None:
            return 404, _lease_not_found(name)
        meta = body.get("metadata") if isinstance(body, dict) else None
        if not isinstance(meta, dict) or meta.get("name") != name:
            return 400, status_body(400, "BadRequest", "the name of the object does not match")
        version = meta.get("resourceVersion")
        if not version:
            return 422, status_body(
                422,
                "Invalid",
                f'Lease.coordination.k8s.io "{name}" is invalid: metadata.resourceVersion: '
                "Invalid value: 0x0: must be specified for an update",
            )
        if version != stored["metadata"]["resourceVersion"]:
            return 409, status_body(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the '
                "object has been modified; please apply your changes to the latest version and "
                "try again",
            )
        self.version += 1
        updated = dict(body)
        updated["metadata"] = {
            **meta,
            "namespace": namespace,
            "uid": stored["metadata"]["uid"],
            "creationTimestamp": stored["metadata"]["creationTimestamp"],
            "resourceVersion": str(self.version),
        }
        self.objects[path] = updated
        return 200, updated

    def _create_lease(
        self, namespace: str, content_type: str | None, body: Any
    ) -> tuple[int, dict[str, Any]]:
        if content_type != "application/json":
            return 415, status_body(415, "UnsupportedMediaType", f"unsupported {content_type}")
        meta = body.get("metadata") if isinstance(body, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or not name:
            return 422, status_body(422, "Invalid", "metadata.name: Required value")
        if meta.get("resourceVersion"):
            return 500, status_body(
                500, "InternalError", "resourceVersion should not be set on objects to be created"
            )
        path = self.lease_path(name, namespace)
        if path in self.objects:
            return 409, status_body(
                409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists'
            )
        self.version += 1
        created = dict(body)
        created["metadata"] = {
            **meta,
            "namespace": namespace,
            "uid": f"uid-lease-{name}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "resourceVersion": str(self.version),
        }
        self.objects[path] = created
        return 201, created

    def _scale(self, obj: dict[str, Any]) -> dict[str, Any]:
        replicas = int(obj["spec"].get("replicas", 1))
        meta = obj["metadata"]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
                "resourceVersion": meta["resourceVersion"],
                "creationTimestamp": meta["creationTimestamp"],
            },
            # `ScaleSpec.replicas` is omitempty: a real API server leaves it out at 0.
            "spec": {"replicas": replicas} if replicas else {},
            "status": {"replicas": replicas, "selector": f"app={meta['name']}"},
        }


def _lease_not_found(name: str) -> dict[str, Any]:
    return status_body(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
