"""The replica's HTTP app (QuartTrio): probes, model listing and the debug state.

Later parts mount the proxy here; the probes stay cheap because the kubelet calls them every few
seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from stargate.readiness import Readiness
from stargate.routing import RoutingState

__all__ = ["create_http_app"]


def create_http_app(
    readiness: Readiness,
    routing: RoutingState,
    *,
    stargate_id: str,
    debug_config: Callable[[], Mapping[str, Any]] = dict,
) -> QuartTrio:
    """Build the QuartTrio app for one replica.

    `debug_config` supplies the `config` object of `/debug/state` (it includes addresses known
    only once the listeners are bound). `RESPONSE_TIMEOUT` is disabled: Quart's default (60 s)
    applies to the whole streamed body and would cut long completions mid-stream (stack-notes P2).
    """
    app = QuartTrio("stargate")
    app.config["RESPONSE_TIMEOUT"] = None

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the process answers. Nothing else is checked, on purpose."""
        return Response(b"", status=200)

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
        """Unkeyed models with an active backend (the HTTP mirror of ListModels, spec §1.4).

        A hint, not a promise: a listed model may be gone by the next request.
        """
        model_ids = [value.strip() for value in request.args.getlist("model_ids")]
        if any(not value for value in model_ids):
            return Response(b"", status=400)
        return {"model_ids": routing.list_models(None, model_ids or None)}, 200

    @app.get("/debug/state")
    async def debug_state() -> dict[str, Any]:
        """Operator view: effective listener config and every active model id (no secrets)."""
        return {"config": dict(debug_config()), "active_model_ids": routing.active_model_ids()}

    return app
