"""Loading comments: a held streaming request gets its response head at once, and an SSE comment
every few seconds until its engine answers (docs/clients.md, "Held streaming requests").

Why: a request held for a model pool's swap, or for the routing wait of its `x-max-wait-ms`,
gets no byte until its engine answers, which for a cold model takes tens of seconds. Proxies and
SDKs with an idle read timeout (nginx 60 s, SDKs 10-600 s) cut such a request although it would
have succeeded. A streaming client already reads Server-Sent Events, whose comment lines
(`: ...`) every SSE parser skips, so the replica can send the head (`200`, `text/event-stream`,
no buffering by nginx) and keep the connection visibly alive with comments while it waits, then
relay the engine's stream unchanged. The price is the engine's head: its status and headers can
no longer be sent, so a failure after the head becomes one OpenAI-shaped error event and
`data: [DONE]` (what the OpenAI SDKs raise as an `APIError`), and the answering backend and the
`Server-Timing` values go into one comment before the engine's first bytes.

Pure parts (the head, the comments, the error event, how a request is known to stream) are
functions here; `LoadingStream` is the I/O: one task, started in the request's nursery only when
the request becomes held, that sends the head and a comment every interval until it is stopped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import trio

from stargate.asgi import BODY_FOLLOWS, ASGIMessage, ASGISend
from stargate.proxy import json_scan
from stargate.proxy.contract import ContractError, Headers

__all__ = [
    "DONE",
    "HEAD_GRACE",
    "AfterHead",
    "LoadingStream",
    "error_event",
    "eta_text",
    "final_comment",
    "is_streaming",
    "loading_comment",
    "loading_head",
    "upstream_error",
]

DONE = b"data: [DONE]\n\n"

# nginx buffers a proxied response unless told not to (`X-Accel-Buffering: no`); caches and
# intermediaries must not store a stream.
_HEAD: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

# How much of an upstream error body is read for its message: an error document is small, and a
# larger body is not read to its end for a message.
_ERROR_BODY_LIMIT = 64 * 1024


def loading_head(request_id: str | None = None) -> Headers:
    """The head's headers: an SSE stream that nothing buffers, with the replica's generated
    `x-request-id` (None: the client sent its own, which the engine's head would have echoed)."""
    if request_id is None:
        return list(_HEAD)
    return [*_HEAD, (b"x-request-id", request_id.encode())]


def is_streaming(body: bytes | bytearray) -> bool:
    """The request body asks for a stream (`"stream": true` at its top level). A body that is not
    JSON never streams: it gets the engine's own answer, held like any other."""
    try:
        return json_scan.top_level_true(body, "stream")
    except ValueError:
        return False


def eta_text(seconds: float | None) -> str:
    """`12s` (whole seconds, rounded up: a wait of 0.2 s is `1s`, never `0s` before it is over),
    or `unknown`."""
    if seconds is None or math.isnan(seconds):
        return "unknown"
    if seconds == math.inf:
        return "unknown"
    return f"{math.ceil(max(0.0, seconds))}s"


def loading_comment(model: str, eta: float | None) -> bytes:
    """One keep-alive comment: `: loading model <model> eta <eta>` and a blank line."""
    return f": loading model {_printable(model)} eta {eta_text(eta)}\n\n".encode()


def final_comment(timing: bytes, backend: tuple[str, str] | None = None) -> bytes:
    """The comment that ends the loading part: the `Server-Timing` value, and the answering
    backend's `x-inference-server-id` and `x-stargate-cluster-id` (the engine's head is not
    sent), as `: <header> <value>` lines."""
    lines = [b": server-timing " + timing]
    if backend is not None:
        server_id, cluster_id = backend
        lines.append(f": x-inference-server-id {_printable(server_id)}".encode())
        lines.append(f": x-stargate-cluster-id {_printable(cluster_id)}".encode())
    return b"\n".join(lines) + b"\n\n"


def error_event(error: ContractError) -> bytes:
    """The event that ends a loading stream that failed, then `[DONE]`: the OpenAI error document
    the request would have got as a body (`{"error": {"message", "type", "param", "code"}}`)."""
    _, document = error.answer(True)
    return b"data: " + document + b"\n\n" + DONE


def upstream_error(status: int, body: bytes) -> ContractError:
    """An upstream's non-2xx answer as the replica's error, for the error event: its message and
    code when its body is an error document (the OpenAI form, or the Rust router's
    `{"error": "...", "code": "..."}`), else one naming the status."""
    message: str | None = None
    code: str | None = None
    try:
        document: Any = json.loads(body)
    except ValueError:
        document = None
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict):
            message = _text(error.get("message"))
            code = _text(error.get("code"))
        else:
            message = _text(error) or _text(document.get("message"))
            code = _text(document.get("code"))
    return ContractError(
        status,
        message=message or f"the upstream answered {status}",
        code=code or f"upstream_{status}",
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _printable(text: str) -> str:
    """`text` without line breaks or other controls: a comment is one line."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else "?" for char in text)


_IDLE, _RUNNING, _STOPPED = range(3)

HEAD_GRACE = 0.5
"""Seconds a hold lasts before the loading head goes out. A routing wait is often a few
milliseconds (wait-and-widen polls a busy fleet): a stream held that briefly keeps the engine's own
head (its status, `x-inference-server-id`, `Server-Timing`). Half a second keeps the first byte of
a long hold well inside any read timeout (docs/clients.md, "Held streaming requests")."""


class LoadingStream:
    """One request's loading stream (the I/O). `hold` starts it, `stop` ends the comments; after
    a `stop` that returned True the head is out, and the caller sends only body (the final
    comment, the engine's stream or the error event).

    The head goes out `grace` seconds after `hold` (`HEAD_GRACE`): a `stop` before then ends the
    stream without a byte (it returns False) and the engine's own head is sent as usual. Once the
    head is being sent, the answer's form is decided, whatever happens next.
    """

    __slots__ = (
        "_body",
        "_done",
        "_eta",
        "_grace",
        "_head_sent",
        "_interval",
        "_model",
        "_nursery",
        "_request_id",
        "_send",
        "_sleeping",
        "_state",
        "_stopping",
        "comments",
    )

    def __init__(
        self,
        send: ASGISend,
        nursery: trio.Nursery,
        model: str,
        body: bytes | bytearray,
        interval: float,
        request_id: str | None = None,
        grace: float = HEAD_GRACE,
    ) -> None:
        self._send = send
        self._nursery = nursery
        self._model = model
        self._body = body
        self._interval = interval
        self._grace = grace
        self._head_sent = False
        self._request_id = request_id  # the generated one, for the head (else None)
        self._eta: Callable[[], float | None] = _unknown
        self._state = _IDLE
        self._stopping = False
        self._sleeping: trio.CancelScope | None = None
        self._done = trio.Event()
        self.comments = 0  # loading comments sent (tests)

    def hold(self, eta: Callable[[], float | None]) -> None:
        """The request started to wait (an `on_hold` callback: synchronous). The first time, for a
        streaming request, start the stream; `eta` gives each comment's ETA from now on (a pool
        hold, then a routing wait, each has its own)."""
        self._eta = eta
        if self._state != _IDLE:
            return
        if not is_streaming(self._body):
            self._state = _STOPPED  # not asked again
            return
        self._state = _RUNNING
        self._nursery.start_soon(self._run)

    async def stop(self) -> bool:
        """End the comments (waiting for one being sent); True when the head went out (False:
        the hold ended within the grace, or never began, and nothing was sent)."""
        if self._state != _RUNNING:
            self._state = _STOPPED
            return False
        self._stopping = True
        if self._sleeping is not None:
            self._sleeping.cancel()
        await self._done.wait()
        return self._head_sent

    async def _run(self) -> None:
        send = self._send
        try:
            if self._grace > 0:
                if not self._stopping:
                    with trio.CancelScope() as grace:
                        self._sleeping = grace
                        await trio.sleep(self._grace)
                    self._sleeping = None
                if self._stopping:
                    return  # the hold ended first: the engine's head goes out as usual
            self._head_sent = True
            headers = loading_head(self._request_id)
            start = {"type": "http.response.start", "status": 200, "headers": headers}
            start[BODY_FOLLOWS] = True  # the first comment follows at once: one write
            await send(start)
            deadline = trio.current_time()
            while True:
                comment = loading_comment(self._model, self._eta())
                await send({"type": "http.response.body", "body": comment, "more_body": True})
                self.comments += 1
                deadline += self._interval
                if self._stopping:
                    return
                with trio.CancelScope() as sleeping:
                    self._sleeping = sleeping
                    await trio.sleep_until(deadline)
                self._sleeping = None
                if sleeping.cancelled_caught:
                    return
        finally:
            self._done.set()


def _unknown() -> float | None:
    return None


class AfterHead:
    """An ASGI `send` for an answer that comes after a loading stream's head went out (the relay
    to a pool's owner, when ownership moved there while the request was held here): the answer's
    head is dropped; a 2xx body passes through, `prefix` (the final comment) before it; any other
    status becomes the error event, from up to 64 KiB of its body."""

    __slots__ = ("_error_body", "_prefix", "_send", "_status")

    def __init__(self, send: ASGISend, prefix: bytes = b"") -> None:
        self._send = send
        self._prefix = prefix
        self._status = 200
        self._error_body = bytearray()

    async def __call__(self, message: ASGIMessage) -> None:
        if message["type"] == "http.response.start":
            self._status = message["status"]
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        chunk: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if 200 <= self._status < 300:
            if self._prefix:
                chunk, self._prefix = self._prefix + chunk, b""
            await self._send({"type": "http.response.body", "body": chunk, "more_body": more})
            return
        if len(self._error_body) < _ERROR_BODY_LIMIT:
            self._error_body += chunk[: _ERROR_BODY_LIMIT - len(self._error_body)]
        if not more:
            error = upstream_error(self._status, bytes(self._error_body))
            await self._send({"type": "http.response.body", "body": error_event(error)})
