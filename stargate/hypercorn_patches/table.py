"""The table of every replacement stargate makes in Hypercorn's and h11's code (pure data).

One row per replaced target: where it is (`module:Owner.attribute`, or `module:MAPPING[KEY]` for
an entry of a table), whether the replacement wraps the original (calls it for what it does not
change) or replaces it (never calls it), the replacement (`module.function` in this package), the
fingerprint of the original's source, and the behaviours the replacement carries, each with its
kind (a fix of a bug, a cost cut, or a feature of ours), the doc section that explains it and the
test that fails without it. A target patched for two reasons is patched once: the row lists both
behaviours, and the replacement's docstring says in what order it runs them and why.

`WRITTEN_FOR` records the versions of the HTTP stack the table was written and tested for. At
start-up `stargate.hypercorn_patches.install()` refuses to patch anything when an installed
version is outside its range, or when the source of a target no longer has the fingerprint
recorded here (`refusal` says what to do). Both are read by the caller and passed in, so this
module does no I/O.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "PATCHES",
    "UPDATE_COMMAND",
    "WRITTEN_FOR",
    "Behaviour",
    "Kind",
    "Mode",
    "Patch",
    "fingerprint",
    "mismatches",
    "refusal",
    "version_tuple",
]

UPDATE_COMMAND = "python -m stargate.hypercorn_patches --update"
"""Rewrites `WRITTEN_FOR` and the fingerprints below for what is installed (after a review)."""

WRITTEN_FOR: dict[str, tuple[str, str]] = {
    "hypercorn": ("0.18", "0.19"),
    "h11": ("0.16", "0.17"),
    "h2": ("4.4", "4.5"),
    "trio": ("0.35", "0.36"),
}
"""Distribution -> [lowest, highest) version the patches were written and tested for: Hypercorn
and h11, whose code they replace, and h2, whose connection internals they read (stream states,
flow-control windows, a GOAWAY h2 does not know about), and trio, whose accept loop under
Hypercorn's listeners one row replaces. pyproject.toml pins the same ranges."""


class Kind(enum.Enum):
    FIX = "fix"  # a Hypercorn or h11 bug a client could hit
    COST = "cost"  # the same behaviour for less CPU (docs/performance.md)
    FEATURE = "feature"  # something of ours Hypercorn has no hook for


class Mode(enum.Enum):
    WRAPS = "wraps"  # the replacement is made from the original and calls it
    REPLACES = "replaces"  # the replacement never calls the original: it rewrites its body


@dataclass(frozen=True)
class Behaviour:
    what: str
    kind: Kind
    doc: str  # docs/<file>#<anchor>
    test: str  # tests/<path>::<name> of a test that fails without it, or "none: <why>"


@dataclass(frozen=True)
class Patch:
    target: str  # "package.module:Class.attribute" or "package.module:MAPPING[NAME, NAME]"
    mode: Mode
    replacement: str  # "module.name" in stargate.hypercorn_patches
    fingerprint: str  # `fingerprint()` of the original's source
    behaviours: tuple[Behaviour, ...]

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def distribution(self) -> str:
        """The distribution that ships the target (its top-level package)."""
        return self.module.split(".")[0]


def _fix(what: str, doc: str, test: str) -> Behaviour:
    return Behaviour(what, Kind.FIX, doc, test)


def _cost(what: str, doc: str, test: str) -> Behaviour:
    return Behaviour(what, Kind.COST, doc, test)


def _feature(what: str, doc: str, test: str) -> Behaviour:
    return Behaviour(what, Kind.FEATURE, doc, test)


# Where the behaviours are explained, and the tests that fail without them.
_SERVING = "docs/http-serving.md#"
_LIFECYCLE = _SERVING + "stream-lifecycle"
_CONNECTIONS = _SERVING + "client-connections---max-client-connections-default-auto"
_H2_STREAMS = "tests/e2e/test_h2_streams.py::"
_LIMITS_E2E = "tests/e2e/test_client_limits.py::"
_GRPC = "tests/unit/test_grpc_asgi.py::"
_FIXES = "tests/unit/test_hypercorn_fixes.py::"
_LIMITS = "tests/unit/test_http_limits.py::"

# --- the behaviours ------------------------------------------------------------------------------

SEND_ORDER = _cost(
    "HTTP/2 streams take turns in round robin instead of through the priority tree",
    "docs/performance.md#control-plane",
    # Its fixture shrinks the round robin h2.py installs; Hypercorn's own tree never refuses at 3.
    _H2_STREAMS + "test_a_full_priority_tree_refuses_the_stream",
)
LATE_DATA = _fix(
    "DATA for a stream whose response is complete is dropped, the stream reset (hypercorn#329)",
    _SERVING + "late-data-pgjoneshypercorn329",
    _GRPC + "test_a_client_that_ignores_the_status_is_closed_after_a_linger",
)
FULL_TREE = _fix(
    "a stream the full scheduler cannot take gets REFUSED_STREAM",
    _SERVING + "a-full-tree-refuses-the-stream",
    _H2_STREAMS + "test_a_full_priority_tree_refuses_the_stream",
)
ROTATION = _fix(
    "rotation sends a graceful GOAWAY and finishes the streams in flight",
    _SERVING + "goaway-rotation",
    _H2_STREAMS + "test_rotation_sends_goaway_and_finishes_the_streams_in_flight",
)
RELEASED_ON_CLOSE = _fix(
    "a closed connection releases the streams still queued to send",
    _LIFECYCLE,
    "none: defensive; `_close_stream` has released every such stream the tests can make",
)
ENDED_AT_ONCE = _fix(
    "the end of a body or trailers end the stream in the app's task",
    _LIFECYCLE,
    "none: it saves a turn of the send task, which (round robin) would end the stream next",
)
LAST_BYTE = _fix(
    "END_STREAM goes with the last byte of the body",
    _LIFECYCLE,
    _FIXES + "test_the_last_data_frame_ends_the_stream",
)
CLOSED_STREAM = _fix(
    "a stream leaves the send side however it ends; an unfinished one is reset",
    _LIFECYCLE,
    _H2_STREAMS + "test_an_app_failing_mid_body_resets_its_stream",
)
ANSWERED_EARLY = _feature(
    "on a limited listener, a stream answered before its body arrived is reset with NO_ERROR",
    _SERVING + "request-body-time---request-body-timeout-ms-default-30000",
    _LIMITS_E2E + "test_an_http2_stream_whose_body_stalls_is_answered_408_and_reset",
)
PRIORITY = _fix(
    "PRIORITY for a stream that is not open parks nothing in the scheduler",
    _LIFECYCLE,
    _FIXES + "test_priority_frames_for_streams_that_are_not_open_park_nothing",
)
BACK_PRESSURE = _fix(
    "a writer paused at the high-water mark waits until the buffer has drained",
    _SERVING + "back-pressure-on-http2",
    _GRPC + "test_send_blocks_once_a_client_stops_reading",
)
HEAD_WITH_BODY = _cost(
    "a head marked BODY_FOLLOWS is written with the next body message",
    _SERVING + "head-with-the-body",
    _FIXES + "test_a_head_marked_body_follows_is_written_with_the_body",
)
CHUNKS_FRAMED = _cost(
    "a body message in the middle of a chunked HTTP/1.1 body is framed and written at once",
    _SERVING + "chunks-of-a-streamed-body",
    _FIXES + "test_chunks_of_a_streamed_body_are_framed_without_h11",
)
HEAD_AT_END = _cost(
    "a held head is written when the app ends without its body",
    _SERVING + "head-with-the-body",
    _FIXES + "test_a_held_head_is_written_when_the_app_ends_without_its_body",
)
STRICT_FRAMING = _fix(
    "a bare LF or CR in the head, or Content-Length with Transfer-Encoding, is a 400",
    _SERVING + "strict-framing",
    "tests/unit/test_http_framing.py::test_a_badly_framed_head_is_a_400",
)
COUNTED = _feature(
    "a limited listener's connections are counted; past the cap, probes only, then answered "
    "full and closed by a deadline",
    _CONNECTIONS,
    _LIMITS_E2E + "test_a_connection_flood_leaves_the_probes_served",
)
REFUSED_PAST_CAP = _feature(
    "an HTTP/2 connection past the cap and the reserve gets REFUSED_STREAM and GOAWAY(0)",
    _CONNECTIONS,
    _LIMITS_E2E + "test_past_twice_the_computed_cap_every_client_gets_an_answer",
)
CONTAINED = _fix(
    "an error escaping a connection's task closes only that connection",
    _SERVING + "contained-connection-errors",
    _H2_STREAMS + "test_a_failing_connection_task_closes_only_its_connection",
)
WRITE_AT_ONCE = _cost(
    "a write the socket takes whole is one write(2), without the scheduler",
    _SERVING + "writes",
    _FIXES + "test_a_write_the_socket_takes_whole_does_not_go_through_the_scheduler",
)
SEND_DURING_CLOSE = _fix(
    "a send racing the connection's close is a send on a closed connection",
    _SERVING + "a-send-racing-the-close",
    _LIMITS + "test_many_stalled_bodies_at_once_are_answered_408_without_a_traceback",
)
FIRST_REQUEST = _fix(
    "at the drain, a connection without a request yet keeps its first-request deadline",
    _SERVING + "a-connection-accepted-before-the-drain",
    "tests/unit/test_accept_queue.py::"
    "test_a_connection_accepted_before_the_drain_gets_its_first_request_served",
)
UNCOUNTED_AT_CLOSE = _feature(
    "a counted connection frees its slot when its socket closes, not when its task ends",
    _CONNECTIONS,
    _LIMITS + "test_a_connection_stops_counting_when_its_socket_closes",
)
READS = _cost(
    "a read has no generator-based timeout around it, and on plain TCP waits before it reads",
    _SERVING + "reads",
    _FIXES + "test_reads_enter_no_generator_based_timeout",
)
CLIENT_CLOSED = _feature(
    "a counted connection its client closed does not wait for the keep-alive timer",
    _CONNECTIONS,
    _LIMITS_E2E + "test_a_connection_flood_leaves_the_probes_served",
)
TIMER_RESTART = _cost(
    "the keep-alive timer restarts without a lock or nursery.start",
    _SERVING + "keep-alive-timer",
    _FIXES + "test_the_keep_alive_timer_restarts_and_stops_without_the_scheduler",
)
TIMER_STOP = _cost(
    "the keep-alive timer stops without a lock",
    _SERVING + "keep-alive-timer",
    _FIXES + "test_stopping_the_keep_alive_timer_does_not_go_through_the_scheduler",
)
ACCEPT_QUEUED = _cost(
    "every connection the kernel has queued is accepted in one pass of the scheduler",
    "docs/performance.md#side-by-side-with-the-peers",
    "tests/unit/test_accept_drain.py::"
    "test_every_queued_connection_is_started_before_the_first_handler_runs",
)
DISCONNECT_HOOK = _feature(
    "every HTTP exchange has a DisconnectHook, fired where http.disconnect is queued",
    _SERVING + "disconnect-hook",
    _FIXES + "test_a_client_leaving_fires_the_hook_without_a_task_in_receive",
)

# --- the table: one row per target ---------------------------------------------------------------

_H2 = "hypercorn.protocol.h2:H2Protocol."
_TCP = "hypercorn.trio.tcp_server:TCPServer."
_TIMER = "hypercorn.trio.worker_context:TrioSingleTask."
WRAPS, REPLACES = Mode.WRAPS, Mode.REPLACES

PATCHES: tuple[Patch, ...] = (
    # HTTP/2: h2.py
    Patch(_H2 + "__init__", WRAPS, "h2.init", "d577a96e2eb647a4", (SEND_ORDER,)),
    Patch(
        _H2 + "_handle_events",
        WRAPS,
        "h2.handle_events",
        "3378aef0a2348f0d",
        (LATE_DATA, FULL_TREE, ROTATION, REFUSED_PAST_CAP),
    ),
    Patch(_H2 + "handle", WRAPS, "h2.handle", "c67e89eb79af9032", (RELEASED_ON_CLOSE,)),
    Patch(_H2 + "stream_send", WRAPS, "h2.stream_send", "d8fc824e2770ba5c", (ENDED_AT_ONCE,)),
    Patch(_H2 + "_send_data", REPLACES, "h2.send_data", "a89ce4286f369820", (LAST_BYTE,)),
    Patch(
        _H2 + "_close_stream",
        WRAPS,
        "h2.close_stream",
        "a292549791640b65",
        (CLOSED_STREAM, ANSWERED_EARLY),  # in this order: h2.close_stream
    ),
    Patch(
        _H2 + "_priority_updated", REPLACES, "h2.priority_updated", "a02ffc3670a3292e", (PRIORITY,)
    ),
    Patch(
        "hypercorn.protocol.h2:StreamBuffer.pop",
        REPLACES,
        "h2.pop",
        "9eb73c8833891346",
        (BACK_PRESSURE,),
    ),
    # HTTP/1.1: h11.py, framing.py
    Patch(
        "hypercorn.protocol.http_stream:HTTPStream.app_send",
        WRAPS,
        "h11.app_send",
        "c806044b99736985",
        (CHUNKS_FRAMED, HEAD_WITH_BODY),
    ),
    Patch(
        "hypercorn.protocol.h11:H11Protocol._send_h11_event",
        WRAPS,
        "h11.send_h11_event",
        "5e40283daa303ec7",
        (HEAD_WITH_BODY,),
    ),
    Patch(
        "hypercorn.protocol.h11:H11Protocol.stream_send",
        WRAPS,
        "h11.stream_send",
        "56a36254a368d71a",
        (HEAD_AT_END,),
    ),
    Patch(
        "h11._readers:READERS[CLIENT, IDLE]",
        WRAPS,
        "framing.read_request_head",
        "b0ae12d92b2c4db9",
        (STRICT_FRAMING,),
    ),
    # The connection: tcp.py, limits.py
    Patch(
        _TCP + "run",
        WRAPS,
        "tcp.run",
        "fd34b021d1a86c98",
        (COUNTED, CONTAINED),  # in this order: tcp.run
    ),
    Patch(
        _TCP + "protocol_send",
        WRAPS,
        "tcp.protocol_send",
        "225856426bff7be0",
        (WRITE_AT_ONCE, SEND_DURING_CLOSE),  # in this order: tcp.protocol_send
    ),
    Patch(
        _TCP + "_idle_timeout", REPLACES, "tcp.idle_timeout", "210ce1014d98e1cb", (FIRST_REQUEST,)
    ),
    Patch(_TCP + "_close", WRAPS, "limits.close", "bc73c4ae25a1ceec", (UNCOUNTED_AT_CLOSE,)),
    Patch(
        _TCP + "_read_data",
        REPLACES,
        "tcp.read_data",
        "7ca747d922c65cf1",
        (READS, CLIENT_CLOSED),
    ),
    Patch(_TIMER + "restart", REPLACES, "tcp.restart", "0170ab8e4418dc0e", (TIMER_RESTART,)),
    Patch(_TIMER + "stop", REPLACES, "tcp.stop", "044ad384dfd2f565", (TIMER_STOP,)),
    # The app: app.py
    Patch(
        "hypercorn.trio.task_group:TaskGroup.spawn_app",
        WRAPS,
        "app.spawn_app",
        "b4c1131427529801",
        (DISCONNECT_HOOK,),
    ),
    # The accept loop under Hypercorn's listeners (trio's): accept.py
    Patch(
        "trio._highlevel_serve_listeners:_serve_one_listener",
        REPLACES,
        "accept.serve_one_listener",
        "9367ae038290927f",
        (ACCEPT_QUEUED,),
    ),
)


def fingerprint(source: str) -> str:
    """The fingerprint of a target's source (`inspect.getsource` of the original)."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def version_tuple(version: str) -> tuple[int, ...]:
    """The release numbers of a version: "0.18.0" -> (0, 18, 0); "0.19.0rc1" -> (0, 19, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def _range(low: str, high: str) -> str:
    return f">={low},<{high}"


def mismatches(
    patches: Sequence[Patch],
    written_for: Mapping[str, tuple[str, str]],
    installed: Mapping[str, str | None],
    fingerprints: Mapping[str, str | None],
) -> list[str]:
    """What the table was not written for: an installed version outside its range (None: not
    installed), a target whose source has another fingerprint (None: no source, or the target
    is gone). One line each; empty when everything matches."""
    problems: list[str] = []
    for name, (low, high) in written_for.items():
        version = installed.get(name)
        if version is None:
            problems.append(
                f"{name} is not installed; the table was written for {name} {_range(low, high)}"
            )
        elif not version_tuple(low) <= version_tuple(version) < version_tuple(high):
            problems.append(
                f"{name} {version} is installed; the table was written for {name} "
                f"{_range(low, high)}"
            )
    for patch in patches:
        found = fingerprints.get(patch.target)
        if found is None:
            problems.append(f"{patch.target} is gone, or its source cannot be read")
        elif found != patch.fingerprint:
            problems.append(
                f"{patch.target} has changed since the table was written (its fingerprint is "
                f"{found}, the table has {patch.fingerprint})"
            )
    return problems


def refusal(problems: Sequence[str], written_for: Mapping[str, tuple[str, str]]) -> str:
    """The start-up error for `problems` (from `mismatches`): what differs, and what to do."""
    pins = " ".join(f"'{name}{_range(*bounds)}'" for name, bounds in written_for.items())
    lines = "\n".join(f"  - {problem}" for problem in problems)
    return (
        "refusing to start: stargate's patches of the HTTP stack "
        "(stargate/hypercorn_patches/table.py) were not written for what is installed:\n"
        f"{lines}\n"
        f"Either install the versions they were written for (pip install {pins}; pyproject.toml "
        "pins the same), or port the table: re-read each target named above in the new source, "
        "check the replacement still does what its row says (each behaviour names the doc "
        "section that explains it and the test that fails without it), run those tests, then "
        f"record the new versions and fingerprints with `{UPDATE_COMMAND}` (and the new ranges "
        "in pyproject.toml)."
    )
