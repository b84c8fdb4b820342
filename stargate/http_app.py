"""The replica's HTTP app (QuartTrio): liveness and readiness probes.

Later parts mount the proxy and the gRPC handler here; the probes stay cheap because the kubelet
calls them every few seconds.
"""

from __future__ import annotations

from typing import Any

from quart import Response
from quart_trio import QuartTrio

from stargate.readiness import Readiness

__all__ = ["create_http_app"]


def create_http_app(readiness: Readiness, *, stargate_id: str) -> QuartTrio:
    """Build the QuartTrio app for one replica.

    `RESPONSE_TIMEOUT` is disabled: Quart's default (60 s) applies to the whole streamed body and
    would cut long completions mid-stream (stack-notes P2).
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

    return app
