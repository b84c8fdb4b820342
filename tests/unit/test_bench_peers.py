"""benchmarks/peers.py without its routers: the ratios, the goals and the comparison table, the
pooling of bursts; and benchmarks/sse.py's pieces the part adds (a stream's length from its
request's `max_tokens`, the connection burst of the client) against a real SSE engine process."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from benchmarks import peers
from benchmarks.common import ROOT, read_line
from benchmarks.peers import Figures, Settings, StreamRun
from benchmarks.sse import ClientSpec, Engine, StreamClient

SETTINGS = Settings(
    connections=16,
    seconds=1.0,
    warmup_seconds=0.5,
    latency_seconds=1.0,
    latency_rounds=1,
    stream_levels=((200, 100), (1000, 50)),
    stream_window=1.0,
    stream_warmup=0.5,
    stream_ramp=0.5,
    burst_levels=((200, 100), (1000, 50)),
    bursts=1,
    budget=60.0,
)


def _figures(**overrides: dict[str, float]) -> Figures:
    """Figures where stargate meets every goal; `overrides` replaces whole rows."""
    figures: Figures = {
        "cpu_us": {"stargate": 600.0, "sglang-router": 200.0, "vllm-router": 150.0, "nginx": 30.0},
        "added_p50_ms": {"stargate": 0.4, "sglang-router": 0.3, "nginx": 0.1},
        "added_p99_ms": {"stargate": 0.9, "sglang-router": 0.6},
        "chunks_per_core_200": {"stargate": 16_000.0, "sglang-router": 25_000.0},
        "chunks_per_core_1000": {"stargate": 15_000.0, "sglang-router": 24_000.0},
        "burst_ttft_p50_200": {"stargate": 60.0, "sglang-router": 100.0, "direct": 50.0},
        "burst_ttft_p99_200": {"stargate": 170.0, "sglang-router": 130.0, "direct": 70.0},
        "burst_ttft_p50_1000": {"stargate": 200.0, "direct": 150.0},
        "burst_ttft_p99_1000": {"stargate": 290.0, "direct": 200.0},
    }
    figures.update(overrides)
    return figures


def test_ratio_is_nan_without_both_sides() -> None:
    assert peers.ratio(600.0, 200.0) == 3.0
    assert math.isnan(peers.ratio(600.0, math.nan))
    assert math.isnan(peers.ratio(math.nan, 200.0))
    assert math.isnan(peers.ratio(600.0, 0.0))


def test_every_goal_met() -> None:
    found = peers.goals(_figures(), SETTINGS)
    assert [goal.met for goal in found] == [True] * 6
    by_text = {goal.text: goal for goal in found}
    cpu = by_text["CPU per request ≤ 4x sglang-router's"]
    assert cpu.measured == pytest.approx(3.0)
    burst = by_text["first chunk p99, 200 new streams ≤ sglang-router's + 50 ms"]
    assert (burst.measured, burst.bound) == (170.0, 180.0)
    large = by_text["first chunk p99, 1,000 new streams ≤ the engine direct + 100 ms"]
    assert (large.measured, large.bound) == (290.0, 300.0)


@pytest.mark.parametrize(
    ("row", "values", "missed"),
    [
        ("cpu_us", {"stargate": 900.0, "sglang-router": 200.0}, 0),
        ("added_p50_ms", {"stargate": 0.51}, 1),
        ("chunks_per_core_200", {"stargate": 14_000.0, "sglang-router": 25_000.0}, 2),
        ("chunks_per_core_1000", {"stargate": 14_000.0, "sglang-router": 24_000.0}, 3),
        ("burst_ttft_p99_200", {"stargate": 181.0, "sglang-router": 130.0}, 4),
        ("burst_ttft_p99_1000", {"stargate": 301.0, "direct": 200.0}, 5),
    ],
)
def test_each_goal_missed_alone(row: str, values: dict[str, float], missed: int) -> None:
    found = peers.goals(_figures(**{row: values}), SETTINGS)
    assert [goal.met for goal in found] == [index != missed for index in range(6)]


def test_a_goal_with_a_side_unmeasured_is_neither_met_nor_missed() -> None:
    found = peers.goals(_figures(cpu_us={"stargate": 600.0}, burst_ttft_p99_1000={}), SETTINGS)
    assert found[0].met is None
    assert found[5].met is None
    assert "| - |" in peers.goals_table(found)


def test_the_comparison_table_has_every_target_and_a_ratio_per_peer() -> None:
    table = peers.comparison_table(_figures(), peers.figure_rows(SETTINGS))
    lines = table.splitlines()
    assert lines[0] == (
        "| Figure | stargate | sglang-router | vllm-router | nginx | direct | "
        "stargate / sglang-router | stargate / vllm-router | stargate / nginx |"
    )
    cpu = next(line for line in lines if line.startswith("| CPU µs per request"))
    assert cpu.split(" | ")[1:] == ["600", "200", "150", "30", "-", "3.00", "4.00", "20.00 |"]
    assert len(lines) == 2 + len(peers.figure_rows(SETTINGS))
    assert any("1,000 new streams at once" in line for line in lines)


def test_bursts_pool_their_first_chunks() -> None:
    first = StreamRun("stargate", 3, 10, True, ttft_ms=[1.0, 5.0, 9.0], router_cpu_seconds=0.5)
    second = StreamRun("stargate", 3, 10, True, ttft_ms=[2.0, 3.0, 100.0], errors=1)
    second.router_cpu_seconds = 0.25
    pooled = peers.merge_bursts([first, second])
    assert pooled.ttft_ms == [1.0, 2.0, 3.0, 5.0, 9.0, 100.0]
    assert pooled.ttft_p50_ms == 3.0
    assert pooled.ttft_p99_ms == 100.0
    assert pooled.errors == 1
    assert pooled.router_cpu_seconds == 0.75


def test_the_engine_takes_a_streams_length_from_max_tokens() -> None:
    engine = Engine("m", events=50, interval=0.02)
    assert engine._events_asked(b'{"model":"m","stream":true,"max_tokens":7}') == 7
    assert engine._events_asked(b'{"max_completion_tokens": 12, "stream": true}') == 12
    assert engine._events_asked(b'{"model":"m","stream":true}') == 50


@pytest.fixture
def sse_engine() -> Iterator[int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.sse", "engine", "--interval-ms", "5"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = read_line(process.stdout, 20)
        assert line.startswith("listening on "), line
        yield int(line.rsplit(":", 1)[1])
    finally:
        process.terminate()
        process.wait(10)


def test_a_burst_opens_one_connection_per_stream_and_times_it_from_the_connect(
    sse_engine: int,
) -> None:
    start = time.monotonic() + 0.2
    spec = ClientSpec(
        port=sse_engine,
        slots=20,
        start_at=start,
        ramp=0.0,
        window_start=start - 1.0,
        window_end=start + 0.5,
        hard_stop=start + 10.0,
        events=4,
        once=True,
    )
    result = trio.run(StreamClient(spec).run)
    assert result.errors == 0, result.first_error
    assert result.connections == 20
    assert result.streams_done == 20
    assert result.short_streams == 0  # 4 events each, as asked, not the engine's 50
    assert len(result.ttft) == len(result.connect_seconds) == len(result.head_seconds) == 20
    assert all(
        0 < c <= h <= t
        for c, h, t in zip(
            sorted(result.connect_seconds),
            sorted(result.head_seconds),
            sorted(result.ttft),
            strict=True,
        )
    )


def test_the_engine_answers_a_request_it_cannot_parse_and_stays_up(sse_engine: int) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", sse_engine), timeout=5) as sock:
        # HTTP/2's preface: its first line reads as an unknown request (404), its second as none.
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        answers = b""
        while data := sock.recv(4096):  # until the engine closes the connection
            answers += data
        assert answers.startswith(b"HTTP/1.1 404")
        assert b"HTTP/1.1 400 Bad Request" in answers
    with socket.create_connection(("127.0.0.1", sse_engine), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200")


def test_the_part_is_in_the_default_suite() -> None:
    from benchmarks.__main__ import DEFAULT_PARTS

    assert "peers" in DEFAULT_PARTS
    assert Path(peers.__file__).name == "peers.py"


def test_the_stream_table_tells_sustained_loads_from_bursts() -> None:
    sustained = StreamRun("stargate", 200, 100, False, chunks=40_000, window=4.0)
    sustained.router_cpu_seconds = 3.2
    burst = StreamRun("vllm-router", 200, 100, True, ttft_ms=[20.0, 1030.0], window=3.0)
    burst.connect_ms = [1.0, 1010.0]
    burst.router_cpu_seconds = 0.3
    lines = peers.stream_table([sustained, burst]).splitlines()
    assert lines[2].split(" | ")[:5] == ["| 200 x 100 streams", "stargate", "10,000", "3.20", "80"]
    assert lines[3].split(" | ")[2] == "-"  # a burst delivers no steady chunks/s
    assert lines[3].split(" | ")[7] == "1,010"  # its connect p99: a SYN retried
