"""`ProxyApp` served by Hypercorn in process, with a forwarder double: what an operator reads in
the log when a backend fails in the middle of a streamed response (stargate/logs.py formats it).

The backend's body fails after two chunks were relayed; the client sees its stream cut (the
connection closes without the final chunk, as before), and the log holds exactly one WARNING line
with the request, backend, URL, bytes relayed and the error as fields, and no traceback (neither
ours nor Hypercorn's "Error in ASGI Framework").
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry

from stargate.config import ListenAddress, ProxyConfig
from stargate.load_balancing.config import LbConfig
from stargate.metrics import ProxyMetrics
from stargate.proxy.app import ProxyApp
from stargate.proxy.forwarder import Forwarded
from stargate.proxy.plan import Planner
from stargate.routing import RoutingState
from stargate.serving import bind_listener, hypercorn_config, serve_asgi
from stargate.upstream import UpstreamProtocolError
from tests.fakes.asgi_apps import not_found
from tests.fakes.logs import captured_logs

CHUNKS = [b"data: one\n\n", b"data: two\n\n"]
ERROR = "connection to 127.0.0.1:9 lost mid-body"
HEADERS = {"x-request-id": "req-mid", "x-input-tokens": "1", "x-model": "m"}


class _BrokenBody:
    """An upstream response whose body fails after `CHUNKS`."""

    def __init__(self) -> None:
        self.status = 200
        self.headers = [(b"content-type", b"text/event-stream")]
        self.complete = False  # never: the body fails first

    async def __aenter__(self) -> _BrokenBody:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def take_buffered(self) -> bytes | None:
        return None  # nothing arrived with the head

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        for chunk in CHUNKS:
            yield chunk
        raise UpstreamProtocolError(ERROR, request_sent=True)


class _Forwarder:
    planner = Planner(RoutingState(), LbConfig())

    async def forward_plan(self, plan: object, body: bytes, trace: object = None) -> Forwarded:
        backend = SimpleNamespace(
            inference_server_id="backend-7", url="http://127.0.0.1:9/", cluster_id="c"
        )
        return Forwarded(response=_BrokenBody(), backend=backend)  # type: ignore[arg-type]


@asynccontextmanager
async def _served() -> AsyncIterator[str]:
    app = ProxyApp(
        _Forwarder(),  # type: ignore[arg-type]
        ProxyConfig(),
        ProxyMetrics.create(CollectorRegistry(), "test_"),
        not_found,
    )
    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, app, sock, hypercorn_config(2.0), stop.wait)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop.set()


async def _cut_stream(base: str) -> bytes:
    received = b""
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream(
                "POST", f"{base}/v1/chat/completions?api-key=k3y", headers=HEADERS, content=b"{}"
            ) as response:
                assert response.status_code == 200
                async for chunk in response.aiter_raw():
                    received += chunk
    return received


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line]


async def test_a_mid_stream_failure_is_one_warning_line_with_fields() -> None:
    with captured_logs("info", "text") as output:
        async with _served() as base:
            received = await _cut_stream(base)
        text = output.getvalue()
    assert received == b"".join(CHUNKS)  # what was relayed, and not the end of the body
    warnings = [line for line in _lines(text) if " WARNING " in line]
    assert len(warnings) == 1, text
    assert warnings[0].split(" ", 2)[2] == (
        "WARNING stargate.proxy.app: upstream body failed mid-stream backend=backend-7 bytes=22 "
        f'error="{ERROR}" request_id=req-mid url=http://127.0.0.1:9/v1/chat/completions'
    )
    assert " ERROR " not in text
    assert "Traceback" not in text
    assert "Error in ASGI Framework" not in text
    assert "k3y" not in text  # the client's query string is not logged


async def test_a_mid_stream_failure_in_json() -> None:
    with captured_logs("info", "json") as output:
        async with _served() as base:
            await _cut_stream(base)
        text = output.getvalue()
    records: list[dict[str, Any]] = [json.loads(line) for line in _lines(text)]
    warnings = [r for r in records if r["level"] == "WARNING"]
    assert len(warnings) == 1, text
    (warning,) = warnings
    del warning["time"]
    assert warning == {
        "level": "WARNING",
        "logger": "stargate.proxy.app",
        "message": "upstream body failed mid-stream",
        "backend": "backend-7",
        "bytes": 22,
        "error": ERROR,
        "request_id": "req-mid",
        "url": "http://127.0.0.1:9/v1/chat/completions",
    }
    assert not any("exception" in r for r in records)
