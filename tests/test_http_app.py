"""The probes and Quart settings, through Quart's in-memory test client."""

from __future__ import annotations

import trio
from quart import Response
from trio.testing import MockClock

from stargate.config import WarmupConfig
from stargate.http_app import create_http_app
from stargate.readiness import Readiness


async def test_healthz_is_always_200_even_while_warming_and_draining() -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=60_000))
    app = create_http_app(readiness, stargate_id="r1")
    client = app.test_client()
    assert (await client.get("/healthz")).status_code == 200
    readiness.begin_draining()
    assert (await client.get("/healthz")).status_code == 200


async def test_readyz_is_503_while_warming_and_explains_why() -> None:
    app = create_http_app(Readiness(WarmupConfig(warmup_ms=60_000)), stargate_id="r1")
    response = await app.test_client().get("/readyz")
    assert response.status_code == 503
    body = await response.get_json()
    assert body["phase"] == "warming"
    assert body["ready"] is False
    assert body["stargate_id"] == "r1"


async def test_readyz_is_200_when_warm_and_503_once_draining() -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=0))
    client = create_http_app(readiness, stargate_id="r1").test_client()
    response = await client.get("/readyz")
    assert response.status_code == 200
    assert (await response.get_json())["promotion_reason"] == "disabled"
    readiness.begin_draining()
    response = await client.get("/readyz")
    assert response.status_code == 503
    assert (await response.get_json())["phase"] == "draining"


async def test_long_streams_are_not_cut_by_quarts_response_timeout(
    autojump_clock: MockClock,
) -> None:
    """Quart's default RESPONSE_TIMEOUT (60 s) would cut this 150 s stream (stack-notes P2)."""
    app = create_http_app(Readiness(WarmupConfig(warmup_ms=0)), stargate_id="r1")

    @app.get("/slow-stream")
    async def slow_stream() -> Response:
        async def chunks():  # type: ignore[no-untyped-def]
            for index in range(5):
                await trio.sleep(30)
                yield f"chunk {index}\n".encode()

        return Response(chunks(), mimetype="text/plain")

    start = trio.current_time()
    response = await app.test_client().get("/slow-stream")
    body = await response.get_data()
    assert body == b"".join(f"chunk {i}\n".encode() for i in range(5))
    assert trio.current_time() - start == 150.0
