"""The replica's admin HTTP app (QuartTrio): probes, model listing and the debug state.

The proxy routes sit in front of it (`stargate/proxy/app.py`); the probes stay cheap because the
kubelet calls them every few seconds. Framework errors (404, 405) have an empty `text/plain` body,
never Quart's HTML page. With `--accept-openai-requests`, `/v1/models` is a superset that both
OpenAI SDKs and contract clients read, and `/v1/models/{id}` exists (docs/clients.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from stargate.readiness import Readiness
from stargate.routing import RoutingState, RoutingTargetKey

__all__ = ["create_admin_app"]


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
    app = QuartTrio("stargate")
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
        """Readiness: 200 once warmup is over and the replica is not draining, else 503.

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

        @app.get("/v1/models/<path:model_id>")
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

    return app


def _openai_model(routing: RoutingState, model_id: str) -> dict[str, Any]:
    """An OpenAI model object; `created` is when a backend first registered it here."""
    created = routing.first_advertised(RoutingTargetKey(None, model_id))
    return {"id": model_id, "object": "model", "created": created or 0, "owned_by": "stargate"}
