"""The HTTP listener's client limits (`stargate/http_limits.py`): the admission rule and the
descriptor arithmetic (pure), the connection count with its reserve, the open-file limit, and the
request-body deadline on a fake ASGI app (virtual time), and once on a real Hypercorn listener
(many stalled bodies at once).

End to end: tests/e2e/test_client_limits.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
from collections import Counter
from collections.abc import Iterable
from typing import Any, cast

import pytest
import trio
from hypercorn.typing import AppWrapper
from prometheus_client import CollectorRegistry
from trio.testing import MockClock

from stargate import http_limits
from stargate.asgi import ASGIMessage, ASGIReceive, ASGIScope, ASGISend, answer_lifespan
from stargate.config import ListenAddress
from stargate.http_limits import (
    CONNECTION_RESERVE,
    DESCRIPTOR_HEADROOM,
    MIN_COMPUTED_CAP,
    UNLIMITED_OPEN_FILES,
    Admission,
    ConnectionLimit,
    admission,
    bare_refusal,
    check_open_file_limit,
    computed_cap,
    connection_cap,
    descriptors_needed,
    limit_connections,
    limit_http_clients,
    limit_request_body_time,
    raise_open_file_limit,
)
from stargate.hypercorn_patches.limits import admission as listener_admission
from stargate.metrics import HttpMetrics
from stargate.proxy.contract import limit_answer
from stargate.serving import bind_listener, hypercorn_config, serve_asgi

# --- admission and descriptors (pure) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("open_connections", "expected"),
    [
        (0, Admission.SERVE),
        (19, Admission.SERVE),
        (20, Admission.RESERVE),
        (20 + CONNECTION_RESERVE - 1, Admission.RESERVE),
        (20 + CONNECTION_RESERVE, Admission.REFUSE),
        (1000, Admission.REFUSE),
    ],
)
def test_admission_serves_then_reserves_then_refuses(
    open_connections: int, expected: Admission
) -> None:
    assert admission(open_connections, 20, CONNECTION_RESERVE) is expected


def test_a_cap_of_zero_is_unlimited() -> None:
    assert admission(10**6, 0, CONNECTION_RESERVE) is Admission.SERVE


def test_a_zero_reserve_refuses_at_the_cap() -> None:
    assert admission(19, 20, 0) is Admission.SERVE
    assert admission(20, 20, 0) is Admission.REFUSE


def test_descriptors_needed_counts_an_upstream_connection_per_normal_slot() -> None:
    assert descriptors_needed(384) == 2 * 384 + CONNECTION_RESERVE + http_limits.DESCRIPTOR_HEADROOM
    # The default cap fits the usual soft limit of 1,024.
    assert descriptors_needed(384) <= 1024
    assert descriptors_needed(512) > 1024


@pytest.mark.parametrize(
    ("open_files", "cap"),
    [
        (20_000, (20_000 - 32 - 128) // 2),  # 9,920: the operator's machine
        (1_048_576, (1_048_576 - 32 - 128) // 2),  # containerd's default
        (1024, 432),  # the usual soft limit without containers
        (400, 120),
        (177, 8),  # 17 // 2 = 8: just at the floor
        (176, MIN_COMPUTED_CAP),  # 16 // 2
        (160, MIN_COMPUTED_CAP),  # room for the reserve and headroom only: 0 -> the floor
        (64, MIN_COMPUTED_CAP),  # below even that: negative -> the floor
        (0, MIN_COMPUTED_CAP),
    ],
)
def test_the_computed_cap_is_what_fits_two_descriptors_a_connection(
    open_files: int, cap: int
) -> None:
    assert computed_cap(open_files) == cap
    if cap > MIN_COMPUTED_CAP:
        # The inverse of descriptors_needed: the cap fits, one more would not.
        assert descriptors_needed(cap) <= open_files < descriptors_needed(cap + 1)


def test_the_floor_is_documented_arithmetic() -> None:
    assert MIN_COMPUTED_CAP == 8
    assert computed_cap(2 * 8 + CONNECTION_RESERVE + DESCRIPTOR_HEADROOM) == 8
    assert computed_cap(2 * 9 + CONNECTION_RESERVE + DESCRIPTOR_HEADROOM) == 9


def test_an_unlimited_open_file_limit_counts_as_linux_s_ceiling() -> None:
    expected = (UNLIMITED_OPEN_FILES - CONNECTION_RESERVE - DESCRIPTOR_HEADROOM) // 2
    assert computed_cap(resource.RLIM_INFINITY) == expected
    assert computed_cap(-1) == expected


def test_a_larger_reserve_leaves_fewer_connections() -> None:
    assert computed_cap(1024, reserve=0) == (1024 - 128) // 2
    assert computed_cap(1024, reserve=64) == (1024 - 64 - 128) // 2


# --- the connection count ------------------------------------------------------------------------


def _metrics() -> tuple[HttpMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return HttpMetrics.create(registry, "t_"), registry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_connections_fill_the_cap_then_the_reserve_then_are_refused() -> None:
    metrics, registry = _metrics()
    limit = ConnectionLimit(2, 1, metrics=metrics)
    first, second, third = limit.admit(), limit.admit(), limit.admit()
    assert not first.reserved and not first.refused
    assert not second.reserved and not second.refused
    assert third.reserved and not third.refused
    refused = limit.admit()
    assert refused.refused and not refused.reserved
    assert (limit.open, limit.refusing) == (3, 1)
    assert _value(registry, "t_http_client_connections") == 4  # it holds a descriptor too
    assert _value(registry, "t_http_connection_refusals_total", reason="full") == 1
    assert _value(registry, "t_http_connection_refusals_total", reason="reserve") == 0


def test_a_refused_connection_takes_no_slot_and_promotes_nobody() -> None:
    metrics, registry = _metrics()
    limit = ConnectionLimit(1, 1, metrics=metrics)
    normal, reserve, refused = limit.admit(), limit.admit(), limit.admit()
    assert refused.refused
    limit.release(refused)
    limit.release(refused)  # idempotent
    assert (limit.open, limit.refusing) == (2, 0)
    assert reserve.reserved  # a refused connection leaving frees no normal slot
    assert limit.admit().refused  # still full
    limit.release(normal)
    assert not reserve.reserved
    assert _value(registry, "t_http_connection_refusals_total", reason="full") == 2


def test_a_reserve_connection_takes_the_slot_a_normal_one_frees() -> None:
    limit = ConnectionLimit(1, 2)
    normal, early, late = limit.admit(), limit.admit(), limit.admit()
    assert (normal.reserved, early.reserved, late.reserved) == (False, True, True)
    limit.release(normal)
    assert (early.reserved, late.reserved) == (False, True)  # the oldest first
    limit.release(late)  # a reserve connection leaving promotes nobody
    assert limit.open == 1 and not early.reserved
    assert limit.admit().reserved  # room in the reserve again


def test_release_is_idempotent() -> None:
    metrics, registry = _metrics()
    limit = ConnectionLimit(5, metrics=metrics)
    slot = limit.admit()
    limit.release(slot)
    limit.release(slot)
    assert limit.open == 0
    assert _value(registry, "t_http_client_connections") == 0


def test_an_unlimited_listener_still_counts() -> None:
    metrics, registry = _metrics()
    limit = ConnectionLimit(0, metrics=metrics)
    slots = [limit.admit() for _ in range(100)]
    assert not any(slot.reserved or slot.refused for slot in slots)
    assert _value(registry, "t_http_client_connections") == 100


# --- the open-file limit -------------------------------------------------------------------------


def test_raise_open_file_limit_lifts_the_soft_limit_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert raise_open_file_limit() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class _FakeRlimit:
    def __init__(self, soft: int, hard: int) -> None:
        self.limits = (soft, hard)

    def getrlimit(self, which: int) -> tuple[int, int]:
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        self.limits = limits


@pytest.mark.parametrize(
    ("soft", "hard", "cap", "warns"),
    [
        (1024, 1024, 384, False),  # the default cap fits the usual limit
        (1024, 1024, 512, True),
        (1024, 4096, 512, False),  # raised to the hard limit first
        (1024, 1024, 0, False),  # unlimited: nothing to compare
    ],
)
def test_check_open_file_limit_warns_when_the_cap_may_not_fit(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    soft: int,
    hard: int,
    cap: int,
    warns: bool,
) -> None:
    fake = _FakeRlimit(soft, hard)
    monkeypatch.setattr(http_limits.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(http_limits.resource, "setrlimit", fake.setrlimit)
    with caplog.at_level(logging.INFO, logger="stargate.http_limits"):
        check_open_file_limit(cap)
    assert fake.limits == (hard, hard)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) is warns
    if warns:
        assert f"--max-client-connections={cap}" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("soft", "hard", "cap"),
    [
        (1024, 20_000, 9_920),  # raised to the hard limit first, then computed
        (1024, 1024, 432),
        (64, 64, MIN_COMPUTED_CAP),
    ],
)
def test_the_default_cap_is_computed_from_the_raised_limit_and_logged(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    soft: int,
    hard: int,
    cap: int,
) -> None:
    fake = _FakeRlimit(soft, hard)
    monkeypatch.setattr(http_limits.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(http_limits.resource, "setrlimit", fake.setrlimit)
    with caplog.at_level(logging.INFO, logger="stargate.http_limits"):
        assert connection_cap(None) == cap
    assert fake.limits == (hard, hard)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    (line,) = [line for line in lines if line.startswith("max client connections")]
    assert f"max client connections: {cap}, computed from the open-file limit ({hard})" in line
    assert "(limit - 32 reserve - 128 headroom) / 2" in line
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warned) is (cap == MIN_COMPUTED_CAP)  # only the floor may not fit


def test_an_unlimited_limit_is_logged_as_such(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    infinity = resource.RLIM_INFINITY
    fake = _FakeRlimit(infinity, infinity)
    monkeypatch.setattr(http_limits.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(http_limits.resource, "setrlimit", fake.setrlimit)
    with caplog.at_level(logging.INFO, logger="stargate.http_limits"):
        assert connection_cap(None) == computed_cap(UNLIMITED_OPEN_FILES)
    assert f"unlimited, counted as {UNLIMITED_OPEN_FILES}" in caplog.text
    assert "WARNING" not in [r.levelname for r in caplog.records]


@pytest.mark.parametrize(("configured", "warns"), [(0, False), (20, False), (5_000, True)])
def test_an_explicit_cap_wins_and_warns_when_it_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    configured: int,
    warns: bool,
) -> None:
    fake = _FakeRlimit(1024, 1024)
    monkeypatch.setattr(http_limits.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(http_limits.resource, "setrlimit", fake.setrlimit)
    with caplog.at_level(logging.INFO, logger="stargate.http_limits"):
        assert connection_cap(configured) == configured
    assert "computed from the open-file limit" not in caplog.text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warned) is warns
    if warns:
        assert f"--max-client-connections={configured}" in warned[0]


# --- the request-body deadline -------------------------------------------------------------------


class _Exchange:
    """One HTTP exchange driven by hand: the body chunks the client sends, the messages the app
    sends back."""

    def __init__(self, http_version: str = "1.1", headers: Iterable[tuple[bytes, bytes]] = ()):
        self.scope: ASGIScope = {
            "type": "http",
            "http_version": http_version,
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": list(headers),
            "client": ("127.0.0.1", 5000),
        }
        self.to_app, self._from_client = trio.open_memory_channel[ASGIMessage](10)
        self.sent: list[ASGIMessage] = []

    async def receive(self) -> ASGIMessage:
        return await self._from_client.receive()

    async def send(self, message: ASGIMessage) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[-1]["status"] if starts else None

    def headers(self) -> dict[bytes, bytes]:
        start = [m for m in self.sent if m["type"] == "http.response.start"][-1]
        return dict(start["headers"])


class _ReadingApp:
    """Reads the whole body, then answers 200 after `then` seconds."""

    def __init__(self, then: float = 0.0, *, start_first: bool = False) -> None:
        self.then = then
        self.start_first = start_first
        self.cancelled = False
        self.finished = False

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        try:
            if self.start_first:
                await send({"type": "http.response.start", "status": 200, "headers": []})
            while (message := await receive())["type"] == "http.request" and message.get(
                "more_body", False
            ):
                pass
            await trio.sleep(self.then)
            if not self.start_first:
                await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            self.finished = True
        except trio.Cancelled:
            self.cancelled = True
            raise


async def test_a_body_that_never_arrives_is_answered_408_and_the_app_cancelled(
    autojump_clock: MockClock,
) -> None:
    app = _ReadingApp()
    exchange = _Exchange()
    started = trio.current_time()
    await limit_request_body_time(app, 2.0)(exchange.scope, exchange.receive, exchange.send)
    assert trio.current_time() - started == pytest.approx(2.0)
    assert app.cancelled and not app.finished
    assert exchange.status == 408
    assert exchange.headers() == {
        b"x-stargate-error-code": b"request_body_timeout",
        b"content-length": b"0",
        b"connection": b"close",
    }
    assert exchange.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_a_trickling_body_is_cut_at_the_deadline_from_the_head(
    autojump_clock: MockClock,
) -> None:
    metrics, registry = _metrics()
    app = _ReadingApp()
    exchange = _Exchange()

    async def trickle() -> None:
        for _ in range(10):
            await exchange.to_app.send({"type": "http.request", "body": b"x", "more_body": True})
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        limited = limit_request_body_time(app, 3.5, metrics=metrics)
        started = trio.current_time()
        await limited(exchange.scope, exchange.receive, exchange.send)
        assert trio.current_time() - started == pytest.approx(3.5)  # no byte extended it
        nursery.cancel_scope.cancel()
    assert exchange.status == 408
    assert _value(registry, "t_http_request_body_timeouts_total") == 1


async def test_a_complete_body_lifts_the_deadline(autojump_clock: MockClock) -> None:
    app = _ReadingApp(then=60.0)  # a long answer (a stream) after the body
    exchange = _Exchange()
    await exchange.to_app.send({"type": "http.request", "body": b"{}", "more_body": False})
    await limit_request_body_time(app, 1.0)(exchange.scope, exchange.receive, exchange.send)
    assert app.finished and exchange.status == 200


async def test_a_started_response_is_cut_without_a_408(autojump_clock: MockClock) -> None:
    app = _ReadingApp(start_first=True)
    exchange = _Exchange()
    await limit_request_body_time(app, 1.0)(exchange.scope, exchange.receive, exchange.send)
    assert app.cancelled
    assert [m["type"] for m in exchange.sent] == ["http.response.start"]  # left unfinished


async def test_http2_gets_no_connection_header(autojump_clock: MockClock) -> None:
    exchange = _Exchange(http_version="2")
    await limit_request_body_time(_ReadingApp(), 1.0)(
        exchange.scope, exchange.receive, exchange.send
    )
    assert exchange.status == 408
    assert b"connection" not in exchange.headers()


async def test_an_openai_form_request_gets_the_openai_error_document(
    autojump_clock: MockClock,
) -> None:
    def refusal(
        headers: Iterable[tuple[bytes, bytes]], status: int, code: str, message: str
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        return limit_answer(headers, status, code, message, accept_openai_requests=True)

    exchange = _Exchange()  # no x-model: the OpenAI form
    await limit_request_body_time(_ReadingApp(), 1.0, refusal)(
        exchange.scope, exchange.receive, exchange.send
    )
    headers = exchange.headers()
    assert headers[b"x-stargate-error-code"] == b"request_body_timeout"
    assert headers[b"content-type"] == b"application/json"
    body = json.loads(exchange.sent[-1]["body"])
    assert body["error"]["code"] == "request_body_timeout"
    assert body["error"]["type"] == "invalid_request_error"
    assert int(headers[b"content-length"]) == len(exchange.sent[-1]["body"])

    header_form = _Exchange(headers=[(b"x-model", b"m")])  # the Rust header form: bare
    await limit_request_body_time(_ReadingApp(), 1.0, refusal)(
        header_form.scope, header_form.receive, header_form.send
    )
    assert header_form.sent[-1]["body"] == b""
    assert header_form.headers()[b"x-stargate-error-code"] == b"request_body_timeout"


async def test_the_queue_to_the_app_keeps_moving_while_the_408_is_sent(
    autojump_clock: MockClock,
) -> None:
    """Hypercorn puts `http.disconnect` on the app's queue (10 messages) from inside the answer's
    last send; with the queue full of body chunks the cancelled app never read, that send would
    wait forever unless the wrapper drains the queue."""
    exchange = _Exchange()
    exchange.to_app, exchange._from_client = trio.open_memory_channel[ASGIMessage](2)
    for _ in range(2):
        await exchange.to_app.send({"type": "http.request", "body": b"x", "more_body": True})

    async def hypercorn_send(message: ASGIMessage) -> None:
        exchange.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            await exchange.to_app.send({"type": "http.disconnect"})

    async def never_reads(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        await trio.sleep_forever()

    with trio.fail_after(5):
        await limit_request_body_time(never_reads, 1.0)(
            exchange.scope, exchange.receive, hypercorn_send
        )
    assert exchange.status == 408


# Declares 20 bytes, sends 2.
STALLED = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 20\r\n\r\n{}"


async def _lifespan_and_reading_app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
    """What the HTTP listener serves, reduced: the lifespan protocol, and an app that reads the
    whole body before answering."""
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    await _ReadingApp()(scope, receive, send)


async def _stalled_client(port: int) -> bytes:
    """Send `STALLED`, read the answer's head (the 408 has no body), and close at once."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(STALLED)
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(65536)
            if not data:
                break
            head += data
    return head.partition(b"\r\n")[0]


async def test_many_stalled_bodies_at_once_are_answered_408_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a real Hypercorn listener: a client closing as soon as it has its 408 made the reading
    task close the connection (`send_eof`) while the answer's last send was under way, and trio
    refused that send with `BusyResourceError`, logged as "Error in ASGI Framework" with a
    traceback (fixed in stargate/hypercorn_patches/tcp.py, `protocol_send`). Four rounds of
    32 stalled bodies hit it nearly every round without the fix."""
    caplog.set_level(logging.DEBUG)
    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = hypercorn_config(2.0)
    limit_connections(config, ConnectionLimit(0))
    app = limit_request_body_time(_lifespan_and_reading_app, 0.2)
    stop = trio.Event()
    heads: list[bytes] = []

    async def client() -> None:
        heads.append(await _stalled_client(port))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_asgi, app, sock, config, stop.wait)
            for _ in range(4):
                async with trio.open_nursery() as clients:
                    for _ in range(32):
                        clients.start_soon(client)
            stop.set()
    assert set(heads) == {b"HTTP/1.1 408 "}, Counter(heads)
    logged = [record.getMessage() for record in caplog.records if record.exc_info]
    assert not logged, logged


async def test_a_connection_stops_counting_when_its_socket_closes() -> None:
    """Not when its task ends: an app still running after the answer that closed its connection
    (`Connection: close`) holds no slot any more."""
    limit = ConnectionLimit(1)
    finish = trio.Event()

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        await receive()
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
        await finish.wait()  # still running once its connection has closed

    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = hypercorn_config(2.0)
    limit_connections(config, limit)
    stop = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_asgi, app, sock, config, stop.wait)
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
            received = b""
            while chunk := await client.receive_some(65536):
                received += chunk
            await client.aclose()
            assert received.startswith(b"HTTP/1.1 200 ")
            with trio.fail_after(1):
                while limit.open:  # noqa: ASYNC110 (the count has no event)
                    await trio.sleep(0.01)
            finish.set()
            stop.set()


async def test_a_client_that_leaves_is_not_a_timeout(autojump_clock: MockClock) -> None:
    app = _ReadingApp()
    exchange = _Exchange()
    await exchange.to_app.send({"type": "http.disconnect"})
    await limit_request_body_time(app, 1.0)(exchange.scope, exchange.receive, exchange.send)
    assert exchange.status == 200  # the fake app does not care; the wrapper did not interfere


async def test_other_scopes_pass_through() -> None:
    seen: list[str] = []

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        seen.append(scope["type"])

    async def never() -> Any:
        await trio.sleep_forever()

    async def drop(message: ASGIMessage) -> None:
        pass

    await limit_request_body_time(app, 0.001)({"type": "lifespan"}, never, drop)
    assert seen == ["lifespan"]


def test_the_bare_refusal_has_only_the_code() -> None:
    assert bare_refusal([], 503, "too_many_connections", "full") == (
        [(b"x-stargate-error-code", b"too_many_connections")],
        b"",
    )


# --- both limits on the HTTP listener ------------------------------------------------------------


async def test_limit_http_clients_puts_both_limits_on_the_http_listener(
    autojump_clock: MockClock,
) -> None:
    """The body deadline on the app, answered through the refusal given; the connection count on
    the listener, with the same metrics."""
    metrics, registry = _metrics()
    listener = hypercorn_config(1.0)

    def refusal(
        headers: Iterable[tuple[bytes, bytes]], status: int, code: str, message: str
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        return [(b"x-refused", code.encode())], b"late"

    app = _ReadingApp()
    limited = limit_http_clients(
        app, listener, body_timeout=2.0, max_connections=1, refusal=refusal, metrics=metrics
    )
    exchange = _Exchange()
    await limited(exchange.scope, exchange.receive, exchange.send)
    assert exchange.status == 408 and app.cancelled
    assert exchange.headers()[b"x-refused"] == b"request_body_timeout"
    assert _value(registry, "t_http_request_body_timeouts_total") == 1
    admit = listener_admission(listener)
    assert admit is not None
    assert admit(cast(AppWrapper, app)) is not None
    assert _value(registry, "t_http_client_connections") == 1


def test_without_a_body_timeout_the_app_is_served_as_is_and_connections_still_count() -> None:
    listener = hypercorn_config(1.0)
    app = _ReadingApp()
    assert limit_http_clients(app, listener, body_timeout=None, max_connections=0) is app
    assert listener_admission(listener) is not None


# --- past the cap and the reserve, on a real listener ---------------------------------------------


async def _read_all(stream: trio.SocketStream) -> bytes:
    received = b""
    with contextlib.suppress(trio.BrokenResourceError):
        while chunk := await stream.receive_some(65536):
            received += chunk
    return received


async def test_past_the_reserve_a_connection_is_answered_503_and_an_idle_one_cut_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cap 1, no reserve: a second connection is answered `503 too_many_connections` with
    `Connection: close` (its app never runs) and closed; a third that sends nothing is closed at
    `REFUSAL_DEADLINE`, not at the 5 s keep-alive timeout. Both are counted `full`, and neither
    holds its count once closed."""
    monkeypatch.setattr(http_limits, "REFUSAL_DEADLINE", 0.5)
    metrics, registry = _metrics()
    limit = ConnectionLimit(1, 0, metrics=metrics)
    served: list[str] = []

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        served.append(scope["path"])
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = hypercorn_config(5.0)
    limit_connections(config, limit)
    stop = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_asgi, app, sock, config, stop.wait)
            holder = await trio.open_tcp_stream("127.0.0.1", port)
            await holder.send_all(b"GET /held HTTP/1.1\r\nhost: t\r\n\r\n")
            assert (await holder.receive_some(65536)).startswith(b"HTTP/1.1 200 ")

            refused = await trio.open_tcp_stream("127.0.0.1", port)
            await refused.send_all(b"GET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n")
            answer = await _read_all(refused)
            await refused.aclose()
            head = answer.split(b"\r\n\r\n")[0].lower()
            assert head.startswith(b"http/1.1 503 ")
            assert b"x-stargate-error-code: too_many_connections" in head
            assert b"retry-after: 1" in head and b"connection: close" in head

            idle = await trio.open_tcp_stream("127.0.0.1", port)
            started = trio.current_time()
            assert await _read_all(idle) == b""
            took = trio.current_time() - started
            await idle.aclose()
            assert 0.4 <= took < 2.0, took
            assert served == ["/held"]
            with trio.fail_after(1):
                while limit.refusing:  # noqa: ASYNC110 (the count has no event)
                    await trio.sleep(0.01)
            assert limit.open == 1
            await holder.aclose()
            stop.set()
    assert _value(registry, "t_http_connection_refusals_total", reason="full") == 2
