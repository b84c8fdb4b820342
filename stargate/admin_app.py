"""The replica's admin HTTP app (QuartTrio): probes, model listing and the debug state.

The proxy routes sit in front of it (`stargate/proxy/app.py`); the probes stay cheap because the
kubelet calls them every few seconds. Framework errors (404, 405) have an empty `text/plain` body,
never Quart's HTML page, and so has the automatic `OPTIONS` answer. With
`--accept-openai-requests`, `/v1/models` is a superset that both OpenAI SDKs and contract clients
read, and `/v1/models/{id}` exists (docs/clients.md).

Bad input is an answer, never a 500 (tests/unit/proxy/test_bad_input.py): routing ignores the
`Host` header (Werkzeug raised `BadHost` outside every error handler for a name it cannot
IDNA-encode), a query that is not visible ASCII (HTTP/2 delivers any byte) is percent-encoded
before Quart decodes it as strict UTF-8, and Werkzeug never redirects (its merging of doubled
slashes answered `/v1/models/%2Fm` with a 308 to another model's URL and an HTML body).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import Response, request
from quart.wrappers import BaseRequestWebsocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.routing import MapAdapter, PathConverter

from stargate.asgi import visible_query
from stargate.config import ListenAddress, ServeConfig
from stargate.readiness import Readiness
from stargate.routing import RoutingState, RoutingTargetKey

__all__ = ["ListenerAddresses", "create_admin_app", "debug_state_config", "replica_admin_app"]


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
) -> QuartTrio:
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
) -> QuartTrio:
    """Build the QuartTrio app for one replica.

    `debug_config` supplies the `config` object of `/debug/state` (it includes addresses known only
    once the listeners are bound); without `debug_endpoints` (`--no-debug-endpoints`) the route
    does not exist, so it answers 404 like any unknown path. `RESPONSE_TIMEOUT` is disabled:
    Quart's default (60 s) applies to the whole streamed body and would cut long completions
    mid-stream (docs/decisions.md, H2).
    """
    app = _AdminApp("stargate")
    app.config["RESPONSE_TIMEOUT"] = None

    @app.errorhandler(HTTPException)
    async def framework_error(error: HTTPException) -> Response:
        """404 and 405 as the Rust replica answers them: empty, with `allow` on a 405."""
        response = Response(b"", status=error.code or 500, mimetype="text/plain")
        if isinstance(error, MethodNotAllowed) and error.valid_methods:
            response.headers["allow"] = ", ".join(error.valid_methods)
        return response

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the process answers. Nothing else is checked, on purpose."""
        return Response(b"", status=200, mimetype="text/plain")

    @app.get("/readyz")
    async def readyz() -> tuple[dict[str, Any], int]:
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
        return body, 200 if state.ready else 503

    @app.get("/v1/models")
    async def list_models() -> Response | tuple[dict[str, Any], int]:
        """Unkeyed models with an active backend (the HTTP mirror of ListModels,
        docs/control-plane.md, ListModels).

        A hint, not a promise: a listed model may be gone by the next request.
        """
        model_ids = [value.strip() for value in request.args.getlist("model_ids")]
        if any(not value for value in model_ids):
            return Response(b"", status=400, mimetype="text/plain")
        listed = routing.list_models(None, model_ids or None)
        if not accept_openai_requests:
            return {"model_ids": listed}, 200
        return {
            "object": "list",
            "data": [_openai_model(routing, model) for model in listed],
            "model_ids": listed,
        }, 200

    if accept_openai_requests:

        @app.get("/v1/models/<model_id:model_id>")
        async def retrieve_model(model_id: str) -> tuple[dict[str, Any], int]:
            """One model, as OpenAI's `models.retrieve()` reads it, or OpenAI's 404."""
            if routing.list_models(None, [model_id]):
                return _openai_model(routing, model_id), 200
            error = {
                "message": f"the model {model_id!r} does not exist or no backend serves it",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return {"error": error}, 404

    if debug_endpoints:

        @app.get("/debug/state")
        async def debug_state() -> dict[str, Any]:
            """Operator view: effective listener config and every active model id (no secrets)."""
            return {"config": dict(debug_config()), "active_model_ids": routing.active_model_ids()}

        @app.get("/debug/routing")
        async def debug_routing() -> dict[str, Any]:
            """Operator view: every routable target's clusters and backends with the stats the
            load balancers see (pending reservations applied; docs/pylon-data-path.md). Backends
            by id only: like /debug/state it shows no backend URL."""
            return {"targets": [_target_view(routing, target) for target in routing.targets()]}

    return app


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
                    }
                    for backend in cluster.backends
                ],
            }
            for cluster in clusters
        ],
    }


class _ModelIdConverter(PathConverter):
    """A model id: the rest of the path, slashes included, even a leading one (`/v1/models/%2Fm`
    is the id `/m`, which an OpenAI SDK sends for it; Werkzeug's `path` refuses a leading slash,
    so that was a 404 without the model's error document)."""

    part_isolating = False  # Werkzeug infers it from a `/` in `regex`; it spans segments
    regex = ".+"


class _AdminApp(QuartTrio):
    """QuartTrio with the edges of the request target made answers (module docstring)."""

    def __init__(self, import_name: str) -> None:
        super().__init__(import_name)
        # No redirects, before any rule exists (rules take the map's setting when added): no
        # merging of doubled slashes, and no rule ends with `/`, so `strict_slashes` redirects
        # nothing either (turning it off would serve `/healthz/` as `/healthz`, not a 404).
        self.url_map.merge_slashes = False
        self.url_map.converters["model_id"] = _ModelIdConverter

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            query = scope["query_string"]
            if (encoded := visible_query(query)) is not query:
                scope = {**scope, "query_string": encoded}
        await super().__call__(scope, receive, send)

    def create_url_adapter(self, request: BaseRequestWebsocket | None) -> MapAdapter | None:
        """Bound without the request's `Host`: the rules match paths only (no host matching, no
        subdomains, no external URLs), and Werkzeug's IDNA encoding of the host raised `BadHost`
        (a label over 63 characters, an empty label) before any error handler could answer."""
        if request is None:
            return super().create_url_adapter(None)
        return self.url_map.bind(
            "localhost",
            request.root_path,
            url_scheme=request.scheme,
            default_method=request.method,
            path_info=request.path,
            query_args=request.query_string.decode("latin-1"),
        )

    async def make_default_options_response(self, *context: Any) -> Response:
        """Quart's automatic `OPTIONS` answer (an empty 200 with `allow`), as `text/plain`: its
        default is `text/html` (docs/clients.md, "Paths": never HTML).

        `context`: Quart 0.23 (the line pip picks on Python 3.13) passes the request context;
        0.22 (Python 3.11 and 3.12) passes nothing. Both are handed on as they came."""
        response = await super().make_default_options_response(*context)
        response.mimetype = "text/plain"
        return response


def _openai_model(routing: RoutingState, model_id: str) -> dict[str, Any]:
    """An OpenAI model object; `created` is when a backend first registered it here."""
    created = routing.first_advertised(RoutingTargetKey(None, model_id))
    return {"id": model_id, "object": "model", "created": created or 0, "owned_by": "stargate"}
