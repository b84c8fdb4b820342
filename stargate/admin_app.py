"""The replica's admin HTTP app: probes, model listing and the debug state.

The proxy routes sit in front of it (`stargate/proxy/app.py`); the probes stay cheap because the
kubelet calls them every few seconds. Errors (404, 405) and the `OPTIONS` answer have an empty
`text/plain` body, never HTML. With `--accept-openai-requests`, `/v1/models` is a superset that
both OpenAI SDKs and contract clients read, and `/v1/models/{id}` exists (docs/clients.md).

Bad input is an answer, never a 500 (tests/unit/proxy/test_bad_input.py): only the decoded path,
the method and the query are read (never the `Host`), a query is decoded as a form with bad
bytes replaced, and nothing is redirected (a doubled slash is part of the path: `/v1/models/%2Fm`
is the model `/m`).

A plain ASGI app of a few routes, not a framework: it answers what the QuartTrio app it replaced
answered (same statuses, headers and JSON bytes), and a replica starts 0.5 s of CPU faster
without Quart, Werkzeug and Jinja2 to import (docs/decisions.md, H2).
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

from stargate.asgi import answer_lifespan, visible_query
from stargate.config import ListenAddress, ServeConfig
from stargate.readiness import Readiness
from stargate.routing import RoutingState, RoutingTargetKey

__all__ = [
    "AdminApp",
    "Answer",
    "ListenerAddresses",
    "create_admin_app",
    "debug_state_config",
    "replica_admin_app",
]


class ListenerAddresses(Protocol):
    """The addresses a replica's listeners bound (`stargate.serving.BoundAddresses` is one)."""

    @property
    def http(self) -> ListenAddress: ...

    @property
    def grpc(self) -> ListenAddress: ...

    @property
    def model_discovery(self) -> ListenAddress: ...

    @property
    def metrics(self) -> ListenAddress: ...


def debug_state_config(
    *,
    stargate_id: str,
    discovery_dns_name: str | None,
    bound: ListenerAddresses | None,
    advertise_addr: str | None,
) -> dict[str, Any]:
    """`/debug/state`'s `config`: the Rust replica's field set, so tools written for it read
    ours, with this replica's HTTP transport. The addresses are None until the listeners are
    bound (and the advertise address until the publisher exists)."""
    return {
        "stargate_id": stargate_id,
        "grpc_listen_addr": None if bound is None else str(bound.grpc),
        "model_discovery_listen_addr": None if bound is None else str(bound.model_discovery),
        "http_listen_addr": None if bound is None else str(bound.http),
        "metrics_listen_addr": None if bound is None else str(bound.metrics),
        "advertise_addr": advertise_addr,
        "stargate_discovery_dns_name": discovery_dns_name,
        "tunnel_protocol": "http",
        "backend_connectivity": "direct",
        "direct_quic_connections": 0,
    }


def replica_admin_app(
    config: ServeConfig,
    readiness: Readiness,
    routing: RoutingState,
    *,
    bound: Callable[[], ListenerAddresses | None],
    advertise_addr: Callable[[], str | None],
) -> AdminApp:
    """The admin app of a replica run with `config`. `bound` and `advertise_addr` are read at
    each `/debug/state`: the listeners bind, and the publisher is built, after the app."""
    return create_admin_app(
        readiness,
        routing,
        stargate_id=config.stargate_id,
        debug_config=lambda: debug_state_config(
            stargate_id=config.stargate_id,
            discovery_dns_name=config.discovery.dns_name,
            bound=bound(),
            advertise_addr=advertise_addr(),
        ),
        accept_openai_requests=config.proxy.accept_openai_requests,
        debug_endpoints=config.debug_endpoints,
    )


def create_admin_app(
    readiness: Readiness,
    routing: RoutingState,
    *,
    stargate_id: str,
    debug_config: Callable[[], Mapping[str, Any]] = dict,
    accept_openai_requests: bool = False,
    debug_endpoints: bool = True,
) -> AdminApp:
    """Build the admin app for one replica.

    `debug_config` supplies the `config` object of `/debug/state` (it includes addresses known only
    once the listeners are bound); without `debug_endpoints` (`--no-debug-endpoints`) the route
    does not exist, so it answers 404 like any unknown path.
    """

    def healthz(query: bytes) -> Answer:
        """Liveness: the process answers. Nothing else is checked, on purpose."""
        return _EMPTY_200

    def readyz(query: bytes) -> Answer:
        """Readiness: 200 once warmup is over, the replica is not draining and its TLS
        certificate (if any) has not expired, else 503.

        Probes only read the status; the JSON body says why, for the operator reading it.
        """
        state = readiness.state()
        promotion = state.promotion
        body: dict[str, Any] = {
            "stargate_id": stargate_id,
            "ready": state.ready,
            "phase": state.phase,
            "promotion_reason": None if promotion is None else promotion.reason.value,
            "stable_samples": state.stable_samples,
            "sampled_backend_count": state.sampled_backend_count,
            "reason": state.reason,  # why not ready (an expired TLS certificate: docs/tls.md)
        }
        return _json(body, 200 if state.ready else 503)

    def list_models(query: bytes) -> Answer:
        """Unkeyed models with an active backend (the HTTP mirror of ListModels,
        docs/control-plane.md, ListModels).

        A hint, not a promise: a listed model may be gone by the next request.
        """
        model_ids = [value.strip() for value in _query_values(query, "model_ids")]
        if any(not value for value in model_ids):
            return Answer(400)
        listed = routing.list_models(None, model_ids or None)
        if not accept_openai_requests:
            return _json({"model_ids": listed})
        return _json(
            {
                "object": "list",
                "data": [_openai_model(routing, model) for model in listed],
                "model_ids": listed,
            }
        )

    def retrieve_model(model_id: str) -> Answer:
        """One model, as OpenAI's `models.retrieve()` reads it, or OpenAI's 404."""
        if routing.list_models(None, [model_id]):
            return _json(_openai_model(routing, model_id))
        error = {
            "message": f"the model {model_id!r} does not exist or no backend serves it",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return _json({"error": error}, 404)

    def debug_state(query: bytes) -> Answer:
        """Operator view: effective listener config and every active model id (no secrets)."""
        return _json(
            {"config": dict(debug_config()), "active_model_ids": routing.active_model_ids()}
        )

    def debug_routing(query: bytes) -> Answer:
        """Operator view: every routable target's clusters and backends with the stats the
        load balancers see (pending reservations applied; docs/pylon-data-path.md). Backends
        by id only: like /debug/state it shows no backend URL."""
        return _json({"targets": [_target_view(routing, target) for target in routing.targets()]})

    routes: dict[str, Callable[[bytes], Answer]] = {
        "/healthz": healthz,
        "/readyz": readyz,
        "/v1/models": list_models,
    }
    if debug_endpoints:
        routes["/debug/state"] = debug_state
        routes["/debug/routing"] = debug_routing
    return AdminApp(routes, retrieve_model if accept_openai_requests else None)


def _target_view(routing: RoutingState, target: RoutingTargetKey) -> dict[str, Any]:
    snapshot = routing.snapshot(target)
    clusters = [] if snapshot is None else snapshot.clusters
    return {
        "routing_key": target.routing_key,
        "model_id": target.model_id,
        "clusters": [
            {
                "cluster_id": cluster.cluster_id,
                "rtt_ms": round(cluster.rtt_seconds * 1000, 3),
                "input_tps_estimated": cluster.input_tps_estimated,
                "stats": dataclasses.asdict(cluster.stats),
                "backends": [
                    {
                        "inference_server_id": backend.inference_server_id,
                        "rtt_ms": round(backend.rtt_ns / 1e6, 3),
                        "stats": dataclasses.asdict(backend.stats),
                        # Cached prefix blocks its Pylon published (precise mode): the count only.
                        "kv_blocks": len(backend.kv_blocks),
                    }
                    for backend in cluster.backends
                ],
            }
            for cluster in clusters
        ],
    }


@dataclass(frozen=True, slots=True)
class Answer:
    """One admin answer: a status and a body (`content_type` labels a non-empty body)."""

    status: int
    body: bytes = b""
    content_type: bytes = b"text/plain; charset=utf-8"
    allow: bytes | None = None


_EMPTY_200 = Answer(200)
_ALLOW = b"GET, HEAD, OPTIONS"
MODEL_PREFIX = "/v1/models/"


def _json(body: Any, status: int = 200) -> Answer:
    """JSON as the admin app always wrote it: compact, keys sorted, ASCII, newline-terminated."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":")) + "\n"
    return Answer(status, text.encode(), b"application/json")


def _query_values(query: bytes, name: str) -> list[str]:
    """Every value of `name` in a query string, decoded as a form (`+` is a space, a bad escape
    or bad UTF-8 is replaced, never an error)."""
    pairs = urllib.parse.parse_qsl(
        visible_query(query).decode("ascii"),  # raw bytes (HTTP/2 allows any) percent-encoded
        keep_blank_values=True,
        encoding="utf-8",
        errors="replace",
    )
    return [value for key, value in pairs if key == name]


class AdminApp:
    """The admin routes as a plain ASGI app: exact paths, plus `/v1/models/{id}` where OpenAI
    requests are accepted (the id is the rest of the path, slashes and a leading one included:
    `/v1/models/%2Fm` is the id `/m`, as an OpenAI SDK sends it).

    Every route answers GET and HEAD; OPTIONS is an empty 200 with `allow`, any
    other method an empty 405 with `allow`; an unknown path (a trailing slash is another path,
    nothing is redirected or merged) an empty 404. Bodies are never HTML. Paths are matched as
    the server decoded them, and nothing of the request but its path, method and query is read:
    not the `Host`, not the body.
    """

    def __init__(
        self,
        routes: Mapping[str, Callable[[bytes], Answer]],
        model: Callable[[str], Answer] | None,
    ) -> None:
        self._routes = dict(routes)
        self._model = model

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":  # a websocket: no route takes one
            await send({"type": "websocket.close", "code": 1000, "reason": ""})
            return
        answer = self._answer(scope["method"], scope["path"], scope["query_string"])
        headers = [(b"content-type", answer.content_type)]
        headers.append((b"content-length", str(len(answer.body)).encode()))
        if answer.allow is not None:
            headers.append((b"allow", answer.allow))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        # A HEAD answer's body is dropped by the server, which keeps its `content-length`.
        await send({"type": "http.response.body", "body": answer.body, "more_body": False})

    def _answer(self, method: str, path: str, query: bytes) -> Answer:
        path = "/" + path.lstrip("/")  # leading slashes are one, as Werkzeug matched them
        route = self._routes.get(path)
        model_id = None
        if route is None and self._model is not None and path.startswith(MODEL_PREFIX):
            model_id = path[len(MODEL_PREFIX) :] or None
        if route is None and model_id is None:
            return Answer(404)
        if method == "OPTIONS":
            return Answer(200, allow=_ALLOW)
        if method not in ("GET", "HEAD"):
            return Answer(405, allow=_ALLOW)
        if route is not None:
            return route(query)
        assert self._model is not None and model_id is not None
        return self._model(model_id)


def _openai_model(routing: RoutingState, model_id: str) -> dict[str, Any]:
    """An OpenAI model object; `created` is when a backend first registered it here."""
    created = routing.first_advertised(RoutingTargetKey(None, model_id))
    return {"id": model_id, "object": "model", "created": created or 0, "owned_by": "stargate"}
