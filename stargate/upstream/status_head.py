"""Reading a response head for its status and framing alone, without h11 (pure: bytes in, a
`StatusHead` out, no I/O).

Used by `Connection.get_status`, the exchange of the replica's health probes: a probe needs the
status, how the body is framed (to read past it and keep the connection) and whether the
connection may be kept. Through h11 a probe cost about 190 us of CPU, most of it h11's event
machinery on both sides; one probe per backend a second is 19 % of a core at 1,000 backends
(docs/performance.md, "Control plane"). The grammar is h11's own (its `status_line` and
`header_field` expressions), so a head h11 refuses is refused here; a response that frames its
body both ways is read by its chunks, as h11 reads it, and its connection is not kept (RFC 9112
§6.3). Obsolete line folding, which h11 unfolds, is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from h11 import _abnf as abnf

__all__ = ["MAX_HEAD", "HeadError", "StatusHead", "parse_status_head"]

MAX_HEAD: Final = 64 * 1024
"""The longest response head accepted (h11's default `max_incomplete_event_size` is 16 KiB for
one event; a probe answer's head is a few hundred bytes)."""

_STATUS_LINE: Final = re.compile(abnf.status_line.encode("ascii"))
_FIELD: Final = re.compile(abnf.header_field.encode("ascii"))


class HeadError(Exception):
    """The response head is malformed (the message names how)."""


@dataclass(frozen=True, slots=True)
class StatusHead:
    """What a status-only exchange needs of a response head."""

    status: int
    size: int
    """Bytes of the head, its blank line included: the body starts there."""
    keep_alive: bool
    """HTTP/1.1 without `Connection: close`."""
    content_length: int | None
    chunked: bool
    """`Transfer-Encoding: chunked`; with neither this nor a length the body runs to EOF (unless
    the status has no body)."""

    @property
    def bodyless(self) -> bool:
        """1xx, 204 and 304 have no body whatever the head says."""
        return self.status < 200 or self.status in (204, 304)


def parse_status_head(buf: bytes) -> StatusHead | None:
    """The head at the start of `buf`, or None if it has not fully arrived. Raises `HeadError`."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise HeadError("response head too long")
        return None
    lines = buf[:end].split(b"\r\n")
    match = _STATUS_LINE.fullmatch(lines[0])
    if match is None:
        raise HeadError(f"illegal status line: {lines[0][:100]!r}")
    version = match["http_version"]
    keep_alive = version == b"1.1"
    content_length: int | None = None
    chunked = False
    for line in lines[1:]:
        field = _FIELD.fullmatch(line)
        if field is None:
            raise HeadError(f"illegal header line: {line[:100]!r}")
        name = field["field_name"].lower()
        value = field["field_value"]
        if name == b"content-length":
            if not value.isdigit() or (content_length is not None and content_length != int(value)):
                raise HeadError(f"bad Content-Length: {value[:40]!r}")
            content_length = int(value)
        elif name == b"transfer-encoding":
            if value.strip().lower() != b"chunked" or chunked:
                raise HeadError(f"unsupported Transfer-Encoding: {value[:40]!r}")
            chunked = True
        elif name == b"connection" and b"close" in (
            token.strip().lower() for token in value.split(b",")
        ):
            keep_alive = False
    if chunked and content_length is not None:
        # RFC 9112 §6.3: Transfer-Encoding wins (h11 reads it so too), and such a message
        # "ought to be handled as an error": the connection is not kept.
        content_length = None
        keep_alive = False
    return StatusHead(int(match["status_code"]), end + 4, keep_alive, content_length, chunked)
