"""Readiness warmup on a mock clock, with an in-memory backend count.

`autojump_clock` (a `MockClock` with autojump threshold 0) advances virtual time
whenever every task is blocked, so a 60 s warmup runs in milliseconds and times are exact.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
from prometheus_client import CollectorRegistry
from trio.testing import MockClock

from stargate.config import WarmupConfig
from stargate.lifecycle import Lifecycle, Phase
from stargate.metrics import ReadinessMetrics
from stargate.readiness import Readiness
from stargate.warmup import PromotionReason


class FakeBackends:
    """An in-memory stand-in for the routing state's total active backend count."""

    def __init__(self, count: int = 0) -> None:
        self.count = count
        self.reads: list[float] = []

    def read(self) -> int:
        self.reads.append(trio.current_time())
        return self.count


def _metric(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(f"stargate_{name}", labels or None)


def _readiness(
    warmup_ms: int = 60_000, interval_ms: int = 1_000, window: int = 5
) -> tuple[Readiness, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = ReadinessMetrics.create(registry, "stargate_")
    return Readiness(WarmupConfig(warmup_ms, interval_ms, window), metrics), registry


async def _run_warmup(
    readiness: Readiness, read: Callable[[], int], nursery: trio.Nursery
) -> trio.Event:
    done = trio.Event()

    async def sampler() -> None:
        await readiness.run_warmup(read)
        done.set()

    nursery.start_soon(sampler)
    return done


async def test_promotes_after_exactly_window_stable_samples(
    autojump_clock: MockClock,
) -> None:
    readiness, registry = _readiness(window=5)
    backends = FakeBackends(3)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        await _run_warmup(readiness, backends.read, nursery)
        await readiness.wait_warm()
        assert trio.current_time() - start == 5.0
    assert readiness.ready
    assert readiness.promotion is not None
    assert readiness.promotion.reason is PromotionReason.STABILIZED
    assert readiness.promotion.samples == 5
    assert [t - start for t in backends.reads] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert _metric(registry, "readiness_ready") == 1.0
    assert _metric(registry, "readiness_warmup_promotions_total", reason="stabilized") == 1.0
    assert _metric(registry, "readiness_time_to_ready_seconds") == 5.0
    assert _metric(registry, "readiness_stable_samples") == 5.0
    assert _metric(registry, "readiness_sampled_backend_count") == 3.0


async def test_not_ready_before_the_streak_completes(autojump_clock: MockClock) -> None:
    readiness, _ = _readiness(window=5)
    backends = FakeBackends(2)
    async with trio.open_nursery() as nursery:
        await _run_warmup(readiness, backends.read, nursery)
        await trio.sleep(4.5)
        assert not readiness.ready
        assert readiness.state().stable_samples == 4
        await readiness.wait_warm()


async def test_changing_count_never_promotes_before_the_deadline(
    autojump_clock: MockClock,
) -> None:
    readiness, registry = _readiness(warmup_ms=20_000, window=3)
    backends = FakeBackends(1)

    def read_and_grow() -> int:
        value = backends.read()
        backends.count += 1
        return value

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        await _run_warmup(readiness, read_and_grow, nursery)
        await trio.sleep(19.9)
        assert not readiness.ready
        await readiness.wait_warm()
        assert trio.current_time() - start == 20.0
    assert readiness.promotion is not None
    assert readiness.promotion.reason is PromotionReason.DEADLINE
    assert _metric(registry, "readiness_warmup_promotions_total", reason="deadline") == 1.0
    assert _metric(registry, "readiness_warmup_promotions_total", reason="stabilized") == 0.0


async def test_zero_backends_promote_at_the_deadline(autojump_clock: MockClock) -> None:
    readiness, _ = _readiness(warmup_ms=7_500)
    backends = FakeBackends(0)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        await _run_warmup(readiness, backends.read, nursery)
        await readiness.wait_warm()
        assert trio.current_time() - start == 7.5
    assert readiness.ready
    assert readiness.promotion is not None
    assert readiness.promotion.reason is PromotionReason.DEADLINE
    assert len(backends.reads) == 7


async def test_warmup_zero_is_ready_at_start_without_sampling(
    autojump_clock: MockClock,
) -> None:
    readiness, registry = _readiness(warmup_ms=0)
    assert readiness.ready
    backends = FakeBackends(1)
    start = trio.current_time()
    await readiness.run_warmup(backends.read)
    assert trio.current_time() == start  # returned at once: there is no sampler loop
    await trio.sleep(100)
    assert backends.reads == []
    assert readiness.promotion is not None
    assert readiness.promotion.reason is PromotionReason.DISABLED
    assert _metric(registry, "readiness_warmup_promotions_total", reason="disabled") == 1.0
    assert _metric(registry, "readiness_ready") == 1.0


async def test_shutdown_during_warmup_stops_the_sampler_and_stays_unready(
    autojump_clock: MockClock,
) -> None:
    readiness, registry = _readiness(warmup_ms=60_000, window=5)
    backends = FakeBackends(0)
    async with trio.open_nursery() as nursery:
        sampler_done = await _run_warmup(readiness, backends.read, nursery)
        await trio.sleep(3.5)
        readiness.lifecycle.begin_draining()
        with trio.fail_after(0.001):  # virtual time: the sampler ends without waiting
            await sampler_done.wait()
    reads_at_shutdown = len(backends.reads)
    await trio.sleep(120)
    assert len(backends.reads) == reads_at_shutdown == 3
    assert readiness.warm  # nothing waiting on warmup is left hanging
    assert not readiness.ready
    assert readiness.state().phase == "draining"
    assert readiness.promotion is not None
    assert readiness.promotion.reason is PromotionReason.SHUTDOWN
    assert _metric(registry, "readiness_warmup_promotions_total", reason="shutdown") == 1.0
    assert _metric(registry, "readiness_ready") == 0.0
    assert _metric(registry, "readiness_time_to_ready_seconds") == 0.0


async def test_shutdown_before_the_sampler_starts_means_it_never_samples(
    autojump_clock: MockClock,
) -> None:
    readiness, _ = _readiness()
    readiness.lifecycle.begin_draining()
    backends = FakeBackends(4)
    await readiness.run_warmup(backends.read)
    assert backends.reads == []
    assert not readiness.ready


async def test_promotion_is_latched_when_backends_drop_to_zero(
    autojump_clock: MockClock,
) -> None:
    readiness, registry = _readiness(window=2)
    backends = FakeBackends(2)
    async with trio.open_nursery() as nursery:
        await _run_warmup(readiness, backends.read, nursery)
        await readiness.wait_warm()
    backends.count = 0
    reads = len(backends.reads)
    await trio.sleep(60)
    assert readiness.ready
    assert len(backends.reads) == reads  # the sampler is gone after promotion
    assert _metric(registry, "readiness_ready") == 1.0


async def test_draining_after_promotion_turns_unready_and_keeps_the_reason(
    autojump_clock: MockClock,
) -> None:
    readiness, registry = _readiness(window=1)
    async with trio.open_nursery() as nursery:
        await _run_warmup(readiness, FakeBackends(1).read, nursery)
        await readiness.wait_warm()
    readiness.lifecycle.begin_draining()
    readiness.lifecycle.begin_draining()  # idempotent
    assert not readiness.ready
    assert readiness.promotion is not None
    assert readiness.promotion.reason is PromotionReason.STABILIZED
    assert _metric(registry, "readiness_warmup_promotions_total", reason="shutdown") == 0.0
    assert _metric(registry, "readiness_ready") == 0.0


@pytest.mark.parametrize("counts", [[0, 0, 3, 3, 0, 3, 3, 3]])
async def test_streak_restarts_after_a_zero(autojump_clock: MockClock, counts: list[int]) -> None:
    readiness, _ = _readiness(window=3)
    remaining = list(counts)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        await _run_warmup(readiness, lambda: remaining.pop(0), nursery)
        await readiness.wait_warm()
    assert trio.current_time() - start == 8.0
    assert remaining == []


async def test_readiness_reads_the_lifecycle_it_is_given(autojump_clock: MockClock) -> None:
    """The runtime drives one `Lifecycle`; readiness only reads it and reacts to its changes, so
    `/readyz`, gRPC health and the gauge follow each phase without being told twice: leaving is
    503 with its own phase and ends warmup, draining follows, and the drain finishing (`done`)
    changes nothing a probe reads."""
    registry = CollectorRegistry()
    lifecycle = Lifecycle()
    readiness = Readiness(
        WarmupConfig(warmup_ms=0),
        ReadinessMetrics.create(registry, "stargate_"),
        lifecycle=lifecycle,
    )
    assert readiness.lifecycle is lifecycle and lifecycle.phase is Phase.READY
    assert readiness.ready and readiness.accepting_work

    changed = readiness.next_change()
    assert lifecycle.begin_leaving()
    assert changed.is_set()
    state = readiness.state()
    assert (state.phase, state.ready) == ("leaving", False)
    assert readiness.leaving and not readiness.draining and not readiness.accepting_work
    assert _metric(registry, "readiness_ready") == 0.0

    changed = readiness.next_change()
    assert lifecycle.begin_draining()
    assert changed.is_set() and readiness.state().phase == "draining" and readiness.draining

    changed = readiness.next_change()
    assert lifecycle.drained()
    assert not changed.is_set()
    assert readiness.state().phase == "draining" and not readiness.ready


async def test_leaving_during_warmup_ends_the_sampler_and_latches(
    autojump_clock: MockClock,
) -> None:
    """A SIGTERM during warmup: the sampler stops at once (nothing waits on a warmup that cannot
    finish), warmup counts as ended by the shutdown, and no later sample can promote."""
    readiness, registry = _readiness(warmup_ms=60_000, window=2)
    backends = FakeBackends(3)
    async with trio.open_nursery() as nursery:
        sampler_done = await _run_warmup(readiness, backends.read, nursery)
        await trio.sleep(1.5)
        readiness.lifecycle.begin_leaving()
        with trio.fail_after(0.001):
            await sampler_done.wait()
    assert readiness.state().phase == "leaving"
    assert readiness.warm and not readiness.ready
    assert readiness.promotion is not None
    assert readiness.promotion.reason is PromotionReason.SHUTDOWN
    assert not readiness.lifecycle.promote()  # a shutdown ended warmup: nothing left to promote
    assert _metric(registry, "readiness_warmup_promotions_total", reason="shutdown") == 1.0
