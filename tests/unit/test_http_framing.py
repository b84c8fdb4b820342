"""Strict HTTP/1.1 request framing (`stargate/hypercorn_patches/framing.py`): the pure checks,
and h11's server side with the strict reader installed (importing `stargate.serving` installs
it, as every stargate server does). The h11 tests fail without the fix: h11 alone splits a header
line on a bare LF and accepts Content-Length with Transfer-Encoding."""

from __future__ import annotations

import h11
import pytest

import stargate.serving  # noqa: F401  (installs the strict reader, as every server does)
from stargate.hypercorn_patches import install
from stargate.hypercorn_patches.framing import bare_line_break, conflicting_framing

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-Note: a\r\nContent-Length: 2\r\n\r\n"


@pytest.mark.parametrize(
    ("head", "offset"),
    [
        (HEAD, None),
        (b"GET / HTTP/1.1\r\n\r\n", None),
        (b"GET / HTTP/1.1\nHost: t\r\n\r\n", 14),  # the request line ends with a bare LF
        (b"GET / HTTP/1.1\r\nX: a\nY: b\r\n\r\n", 20),  # a header value splits on a bare LF
        (b"GET / HTTP/1.1\r\nX: a\rY: b\r\n\r\n", 20),  # a bare CR inside a value
        (b"GET / HTTP/1.1\r\nX: a\r\r\n\r\n", 20),  # CR CR LF: the first CR is bare
        (b"GET / HTTP/1.1\r\nX: a\n\n", 20),  # a head ended by LF LF
        (b"GET /\r HTTP/1.1\r\n\r\n", 5),  # a bare CR in the request line
    ],
)
def test_bare_line_break_finds_the_first_lf_or_cr_not_in_a_crlf(
    head: bytes, offset: int | None
) -> None:
    assert bare_line_break(head) == offset


def test_bare_line_break_looks_only_at_the_head() -> None:
    body = b"line one\nline two\r"  # a body may hold anything
    assert bare_line_break(HEAD + body, len(HEAD)) is None
    assert bare_line_break(HEAD + body) == len(HEAD) + 8


def test_conflicting_framing() -> None:
    assert conflicting_framing([(b"content-length", b"5"), (b"transfer-encoding", b"chunked")])
    assert not conflicting_framing([(b"content-length", b"5"), (b"host", b"t")])
    assert not conflicting_framing([(b"transfer-encoding", b"chunked")])


def _events(data: bytes, *, chunk: int | None = None) -> list[object]:
    """Feed `data` to an h11 server connection (in `chunk`-byte pieces) and collect its events
    until it needs more data."""
    connection = h11.Connection(h11.SERVER)
    events: list[object] = []
    pieces = [data] if chunk is None else [data[i : i + chunk] for i in range(0, len(data), chunk)]
    for piece in pieces:
        connection.receive_data(piece)
        while (event := connection.next_event()) is not h11.NEED_DATA:
            events.append(event)
            if isinstance(event, h11.EndOfMessage):
                return events
    return events


def test_a_well_formed_request_is_parsed_as_before() -> None:
    events = _events(HEAD + b"{}")
    request = events[0]
    assert isinstance(request, h11.Request)
    assert (b"x-note", b"a") in list(request.headers)
    assert isinstance(events[-1], h11.EndOfMessage)


def test_a_head_that_trickles_in_byte_by_byte_is_parsed() -> None:
    events = _events(HEAD + b"{}", chunk=1)
    assert isinstance(events[0], h11.Request)
    assert isinstance(events[-1], h11.EndOfMessage)


def test_a_body_may_hold_bare_line_breaks() -> None:
    body = b"a\nb\rc"
    head = HEAD.replace(b"Content-Length: 2", f"Content-Length: {len(body)}".encode())
    events = _events(head + body)
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == body


@pytest.mark.parametrize(
    "data",
    [
        # Without the fix h11 reads two headers, and X-Injected reaches the backend.
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-Note: a\nX-Injected: evil\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        b"GET / HTTP/1.1\nHost: t\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: t\r\nX-Note: a\rb\r\n\r\n",
        # Without the fix h11 lets chunked framing win and keeps the connection alive.
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n",
    ],
    ids=["bare LF in a value", "bare LF after the request line", "bare CR", "CL and TE"],
)
@pytest.mark.parametrize("chunk", [None, 1], ids=["at once", "byte by byte"])
def test_a_badly_framed_head_is_a_400(data: bytes, chunk: int | None) -> None:
    with pytest.raises(h11.RemoteProtocolError) as raised:
        _events(data, chunk=chunk)
    assert raised.value.error_status_hint == 400


def test_a_pipelined_second_request_is_checked_too() -> None:
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(
        b"GET / HTTP/1.1\r\nHost: t\r\n\r\nGET / HTTP/1.1\r\nX: a\nY: b\r\n\r\n"
    )
    assert isinstance(connection.next_event(), h11.Request)
    assert isinstance(connection.next_event(), h11.EndOfMessage)
    connection.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    connection.send(h11.EndOfMessage())
    connection.start_next_cycle()
    with pytest.raises(h11.RemoteProtocolError):
        connection.next_event()


def test_install_is_idempotent() -> None:
    reader = h11._readers.READERS[(h11.CLIENT, h11.IDLE)]
    install()
    assert h11._readers.READERS[(h11.CLIENT, h11.IDLE)] is reader
