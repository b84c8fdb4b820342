"""Strict HTTP/1.1 request framing: a request head whose framing two parsers could read
differently is refused before any app sees it (docs/http-serving.md, "Strict framing").

The replica is a proxy: whatever request head it accepts, it re-serialises for a backend, and
often sits behind another proxy that parsed the same bytes first. Where h11 (Hypercorn's HTTP/1.1
parser) is more lenient than RFC 9112, the parsers on either side of the replica can disagree
about where a header, or the request, ends (request smuggling, header injection). Two such
leniencies are closed here; everything else h11 already refuses.

* **A bare LF or bare CR in the request head** (RFC 9112 §2.2: a recipient MAY accept a bare LF
  as a line terminator; §5.5: a bare CR in a field value must be refused or replaced). h11
  splits header lines on LF alone, so `X-Note: a<LF>X-Injected: b` became two headers, and the
  injected one was forwarded to the backend, while a strict proxy in front saw one header with an
  odd value. Now any LF not preceded by CR, and any CR not followed by LF, anywhere in the head
  (the request line included) is a 400. (h11 already refused most bare CRs, through its header
  grammar; the scan states the rule once.)
* **`Content-Length` together with `Transfer-Encoding`** (RFC 9112 §6.1: such a message "ought
  to be handled as an error", and a server that accepts it must close the connection after
  responding, §6.3). h11 let chunked framing win and kept the connection alive, so a front proxy
  that framed the body by its length disagreed about where the next request starts. Now it is a
  400.

Both are answered the way Hypercorn answers any request h11 cannot parse: 400 with an empty body
and `Connection: close`, and the connection is closed; no app is called, so nothing reaches a
backend. HTTP/2 needs no such rule: h2 refuses CR, LF and NUL in header fields itself, and a
message's framing there is the protocol's, not a header's.

How: h11 picks the reader of a request head from its `READERS` table (`(CLIENT, IDLE)`);
`read_request_head` replaces that entry with one that checks the complete head in the receive
buffer before h11 splits it into lines, and the parsed request's framing headers after. An error
raised there becomes, inside h11, the `RemoteProtocolError` Hypercorn answers with 400. The scan
runs once per complete head (found with h11's own incremental blank-line search), so a head that
trickles in is not rescanned on every byte. Applies to every HTTP/1.1 server in the process (the
replica's listeners and the mock backend); h11's client side (the upstream pool) is untouched.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import h11
from h11._receivebuffer import ReceiveBuffer, blank_line_regex

__all__ = ["bare_line_break", "conflicting_framing", "read_request_head"]

# A line break that is not CRLF: LF without CR before it, or CR without LF after it.
_BARE_LINE_BREAK = re.compile(rb"(?<!\r)\n|\r(?!\n)")

Reader = Callable[[ReceiveBuffer], object]


def bare_line_break(head: bytes | bytearray, end: int | None = None) -> int | None:
    """The offset of the first bare LF or bare CR in `head[:end]` (a request head, up to and
    including its blank line), or None when every line ends with CRLF."""
    match = _BARE_LINE_BREAK.search(head, 0, len(head) if end is None else end)
    return None if match is None else match.start()


def conflicting_framing(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers (names in lower case, as h11 gives them) frame its body twice:
    `Content-Length` and `Transfer-Encoding` together."""
    names = {name for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def read_request_head(original: Reader) -> Reader:
    """h11's `READERS[(CLIENT, IDLE)]`: the strict request-head reader."""

    def read_request_head(buf: ReceiveBuffer) -> object:
        data = buf._data
        # h11's own search, from where its last (failed) search left off: a head is scanned
        # once, when it is complete.
        end = blank_line_regex.search(data, buf._multiple_lines_search)
        if end is not None and bare_line_break(data, end.end()) is not None:
            raise h11.LocalProtocolError("bare LF or CR in the request head")
        event = original(buf)
        if isinstance(event, h11.Request) and conflicting_framing(event.headers):
            raise h11.LocalProtocolError("request with both Content-Length and Transfer-Encoding")
        return event

    return read_request_head
