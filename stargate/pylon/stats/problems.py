"""Problem-details answers (RFC 9457) the Pylon gives instead of forwarding a request.

The Rust Pylon answers its own refusals (a bad tunnel header, a model still calibrating, an
unreachable engine, a queue mismatch) with `application/problem+json`, and the router reads the
`x-stargate-retry*` headers beside it to decide on a retry, so every such answer is built here
the same way. The body is compact JSON; the caller adds the framing (`content-length`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from stargate.http_headers import Headers

__all__ = ["PROBLEM_CONTENT_TYPE", "problem"]

PROBLEM_CONTENT_TYPE = b"application/problem+json"


def problem(
    status: int,
    title: str,
    detail: str,
    extra_headers: Iterable[tuple[bytes, bytes]] = (),
    *,
    fields: Mapping[str, object] | None = None,
) -> tuple[int, Headers, bytes]:
    """(status, headers, body) of one problem answer: `type` about:blank, `title`, `status` and
    `detail`, then `fields` (extra members such as a retry reason); the content type first, then
    `extra_headers` in order."""
    document: dict[str, object] = {
        "type": "about:blank",
        "title": title,
        "status": status,
        "detail": detail,
    }
    if fields:
        document.update(fields)
    body = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
    return status, [(b"content-type", PROBLEM_CONTENT_TYPE), *extra_headers], body
