"""Patches of Hypercorn's HTTP/1.1 side: the head written with the body, and the chunks of a
streamed body framed here (two costs; docs/http-serving.md, "Head with the body" and "Chunks of
a streamed body").

Hypercorn writes the head the moment the app sends `http.response.start`, so every response cost
two writes, each a `send(2)` of some 25 us of kernel time on loopback (a third of what the replica
adds to a request goes to syscalls). An app may mark its start message with `BODY_FOLLOWS`
(stargate/asgi.py) when its first body message comes right after without waiting for anything;
the head is then held (`stargate_head` on the `H11Protocol`) and written together with the next
message of the exchange whatever it is (the body, its end, or the end of the exchange should the
app stop first): one write, one TCP segment. The proxy sets the key only when it already holds
body bytes to send right after the head, so nothing waits for it. HTTP/2 ignores the key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import h11
from h11._writers import ChunkedWriter
from hypercorn.events import RawData
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

from stargate.asgi import BODY_FOLLOWS

__all__ = ["app_send", "send_h11_event", "stream_send"]

AppSend = Callable[[HTTPStream, Any], Awaitable[None]]
SendEvent = Callable[[H11Protocol, Any], Awaitable[None]]
StreamSend = Callable[[H11Protocol, StreamEvent], Awaitable[None]]


def app_send(original: AppSend) -> AppSend:
    """`HTTPStream.app_send`: a body message in the middle of a chunked HTTP/1.1 body is framed
    and written here; a head the app marked `BODY_FOLLOWS` is noted on the exchange.

    The middle of a chunked body: the original hands a body message to the protocol as an event,
    which h11 validates, runs through its state machine (where a chunk changes nothing) and
    frames, about 15 us a message of a streamed answer, one per SSE event. When the exchange is
    in its response (the head is out: not held, h11 sending the body with its chunked writer)
    and the message has data and more to come, this writes `size CRLF data CRLF` (the framing
    h11 would write) with the protocol's send, which is all the original ends up doing. The
    last message, an empty one, a held head, HTTP/2, a body h11 frames by `content-length` and
    every other message go to the original.
    """

    async def app_send(self: HTTPStream, message: Any) -> None:
        if message is not None:
            if message.get("more_body") is True and self.state is ASGIHTTPState.RESPONSE:
                body = message.get("body")
                protocol = getattr(self.send, "__self__", None)
                if (
                    body
                    and message["type"] == "http.response.body"
                    and type(protocol) is H11Protocol
                    and getattr(protocol, "stargate_head", None) is None
                ):
                    connection = protocol.connection
                    if connection.our_state is h11.SEND_BODY and (
                        type(connection._writer) is ChunkedWriter
                    ):
                        await protocol.send(RawData(data=b"%x\r\n%b\r\n" % (len(body), body)))
                        return
            elif message.get(BODY_FOLLOWS) is True:
                self.stargate_body_follows = True  # type: ignore[attr-defined]
        await original(self, message)

    return app_send


def send_h11_event(original: SendEvent) -> SendEvent:
    """`H11Protocol._send_h11_event`: hold a marked head; write a held head with the next event."""

    async def send_h11_event(self: H11Protocol, event: Any) -> None:
        held: bytes | None = getattr(self, "stargate_head", None)
        if held is None:
            stream = self.stream
            if type(event) is h11.Response and getattr(stream, "stargate_body_follows", False):
                stream.stargate_body_follows = False  # type: ignore[union-attr]
                try:
                    data = self.connection.send(event)
                except h11.LocalProtocolError:
                    if self.connection.their_state != h11.ERROR:
                        raise
                    return
                self.stargate_head = data  # type: ignore[attr-defined]
                return
            await original(self, event)
            return
        self.stargate_head = None  # type: ignore[attr-defined]
        try:
            data = self.connection.send(event) or b""
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            data = b""
        await self.send(RawData(data=held + data))

    return send_h11_event


def stream_send(original: StreamSend) -> StreamSend:
    """`H11Protocol.stream_send`: a head still held when the exchange ends (the app stopped
    before its body) is written then."""

    async def stream_send(self: H11Protocol, event: StreamEvent) -> None:
        held: bytes | None = getattr(self, "stargate_head", None)
        if held is not None and isinstance(event, StreamClosed):
            self.stargate_head = None  # type: ignore[attr-defined]
            await self.send(RawData(data=held))  # the app ended before its body
        await original(self, event)

    return stream_send
