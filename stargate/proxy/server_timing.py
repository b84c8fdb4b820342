"""The `Server-Timing` value of a proxied answer (docs/clients.md, "Server-Timing").

Why: a slow answer from a model pool can be slow for three different reasons, and a client (or
the browser's network panel, or a load test) should see which without reading the replica's
metrics: the request was held (a pool's hold, then the routing wait of `x-max-wait-ms`), a swap
made its model resident, or the engine itself took long to answer. Three metrics, in
milliseconds with one decimal (W3C Server Timing, `metric;dur=<ms>`):

* `hold`: the time the request was held before it was forwarded: the pool's hold
  (`Grant.hold_seconds`) plus the routing wait (until its backend was chosen);
* `swap`: how long the swap the request waited for took (`Grant.swap_seconds`; 0 when it waited
  for none, or the model is not pooled);
* `upstream`: from the choice of its backend to the response head (attempts and retries
  included); for an answer the replica made itself, the time it spent routing and attempting
  after the routing wait.

Pure: formatting only; the proxy (stargate/proxy/app.py) measures.
"""

from __future__ import annotations

__all__ = ["server_timing"]


# Most requests were never held: only their upstream time needs formatting.
_NOT_HELD = b"hold;dur=0.0, swap;dur=0.0, upstream;dur="


def server_timing(hold: float, swap: float, upstream: float) -> bytes:
    """The header value for these durations, in seconds (never negative: a clock read in another
    order than the events is clamped to 0)."""
    if hold <= 0 and swap <= 0:
        return _NOT_HELD + b"%.1f" % (max(0.0, upstream) * 1000)
    return f"hold;dur={_ms(hold)}, swap;dur={_ms(swap)}, upstream;dur={_ms(upstream)}".encode()


def _ms(seconds: float) -> str:
    return f"{max(0.0, seconds) * 1000:.1f}"
