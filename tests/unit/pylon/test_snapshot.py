"""The Pylon's decisions for following a fleet through restarts, tested with plain values and
virtual time: which registrations to start and stop, which replica a watch tries next, when a
retry sleep ends early, and the bound on how late a reconnect can be."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from stargate.pylon.backoff import (
    RECONNECT_POLL_SECONDS,
    RECONNECT_PROBE_TIMEOUT_SECONDS,
    WORST_RECONNECT_DELAY_SECONDS,
    RecoveryDetector,
)
from stargate.pylon.config import DialTarget
from stargate.pylon.sidecar import tcp_accepts, wait_for_retry
from stargate.pylon.snapshot import (
    ReplicaInfo,
    WatchResult,
    desired_replicas,
    next_watch_target,
    reachable_watches,
    reappeared,
    registration_changes,
    split_host_port,
    watch_candidates,
)


def replica(address: str) -> ReplicaInfo:
    return ReplicaInfo(address, DialTarget(address))


R0, R1, R2 = replica("10.0.0.1:50071"), replica("10.0.0.2:50071"), replica("10.0.0.3:50071")
SEED = DialTarget("10.0.0.1:50071")  # replica 0's own address
NAME_SEED = DialTarget("stargate-headless:50071")  # a name standing for the whole fleet


def result(*replicas: ReplicaInfo, urls: tuple[DialTarget, ...] = ()) -> WatchResult:
    return WatchResult(frozenset(replicas), frozenset(urls))


# ---- which registrations run -------------------------------------------------------------------


def test_a_listed_replica_gets_a_registration() -> None:
    start, stop = registration_changes(frozenset({R0, R1}), {R0}, set())
    assert start == {R1}
    assert stop == frozenset()


def test_an_unlisted_replica_is_kept_while_its_stream_is_up() -> None:
    """A leaving replica stops listing itself but keeps serving its registrations."""
    start, stop = registration_changes(frozenset({R1, R2}), {R0, R1, R2}, {R0, R1, R2})
    assert (start, stop) == (frozenset(), frozenset())


def test_an_unlisted_replica_whose_stream_is_gone_is_dropped() -> None:
    start, stop = registration_changes(frozenset({R1, R2}), {R0, R1, R2}, {R1, R2})
    assert start == frozenset()
    assert stop == {R0}


def test_a_replica_listed_under_a_new_dial_address_replaces_its_live_stream() -> None:
    """Same advertise address, new dial address: the old stream would hold the engine's id."""
    moved = ReplicaInfo(R0.authority, DialTarget("lb:7"))
    start, stop = registration_changes(frozenset({moved, R1}), {R0, R1}, {R0, R1})
    assert start == {moved}
    assert stop == {R0}


def test_a_listed_replica_without_a_stream_is_kept_retrying() -> None:
    """A killed replica is still listed by the kept snapshot: its task keeps retrying."""
    start, stop = registration_changes(frozenset({R0, R1, R2}), {R0, R1, R2}, {R1, R2})
    assert (start, stop) == (frozenset(), frozenset())


def test_kept_snapshots_still_list_every_replica() -> None:
    """The watch's stream ending removes nothing: the kept result is what counts."""
    results = {SEED: result(R0, R1, R2)}
    watches = reachable_watches([SEED], results)
    assert desired_replicas(watches, results) == {R0, R1, R2}


def test_reappeared_replicas() -> None:
    assert reappeared(None, result(R0, R1)) == {R0, R1}
    assert reappeared(result(R0, R1), result(R0, R1, R2)) == {R2}
    assert reappeared(result(R0, R1), result(R1)) == frozenset()


# ---- where a watch goes ------------------------------------------------------------------------


def test_a_seed_watch_tries_itself_then_its_fleet_then_everything_known() -> None:
    other_seed = DialTarget("10.9.0.1:50071")
    elsewhere = replica("10.8.0.1:50071")  # learned through another seed's watch
    results = {
        SEED: result(R0, R1, R2),
        other_seed: result(elsewhere),
    }
    candidates = watch_candidates(SEED, [SEED, other_seed], results)
    assert candidates == (SEED, R1.dial, R2.dial, other_seed, elsewhere.dial)


def test_a_name_seed_fails_over_to_the_replicas_it_announced() -> None:
    results = {NAME_SEED: result(R0, R1, R2)}
    assert watch_candidates(NAME_SEED, [NAME_SEED], results) == (
        NAME_SEED,
        R0.dial,
        R1.dial,
        R2.dial,
    )


def test_a_seed_without_a_snapshot_yet_tries_only_what_is_known() -> None:
    assert watch_candidates(SEED, [SEED], {}) == (SEED,)
    other = DialTarget("10.0.0.2:50071")
    assert watch_candidates(SEED, [SEED, other], {}) == (SEED, other)


def test_an_announced_region_watch_stays_within_its_own_snapshot() -> None:
    remote = DialTarget("other-region:50071")
    remote_replica = replica("10.5.0.1:50071")
    results = {SEED: result(R0, R1, urls=(remote,)), remote: result(remote_replica)}
    assert watch_candidates(remote, [SEED], results) == (remote, remote_replica.dial)


def test_next_watch_target_goes_round_once() -> None:
    candidates = (SEED, R1.dial, R2.dial)
    tried: set[DialTarget] = set()
    order: list[DialTarget] = []
    while (target := next_watch_target(candidates, tried)) is not None and len(order) < 10:
        tried.add(target)
        order.append(target)
    assert order == [SEED, R1.dial, R2.dial]


def test_split_host_port() -> None:
    assert split_host_port("127.0.0.1:50071") == ("127.0.0.1", 50071)
    assert split_host_port("[::1]:5") == ("::1", 5)
    assert split_host_port("stargate.example:1") == ("stargate.example", 1)
    assert split_host_port("dns:///stargate:50071") is None
    assert split_host_port("host") is None
    assert split_host_port("host:99999") is None


# ---- when a retry happens ----------------------------------------------------------------------


def test_recovery_detector_needs_a_refusal_first() -> None:
    detector = RecoveryDetector()
    assert not detector.observe(True)  # up and never seen down: no wake-up
    assert not detector.observe(False)
    assert not detector.observe(False)
    assert detector.observe(True)  # down, then up: wake once
    assert not detector.observe(True)
    detector.observe(False)
    detector.clear()  # a stream there was acknowledged
    assert not detector.observe(True)


class FakePeer:
    """A TCP peer that refuses until `up_at` (virtual time), like a restarting replica. A refusal
    takes the full probe timeout (the slow case: no RST); accepting is instant."""

    def __init__(self, up_at: float) -> None:
        self.up_at = up_at
        self.probes = 0

    async def probe(self, target: DialTarget) -> bool:
        self.probes += 1
        if trio.current_time() >= self.up_at:
            return True
        await trio.sleep(RECONNECT_PROBE_TIMEOUT_SECONDS)
        return False


TARGET = DialTarget("10.0.0.1:50071")


@pytest.mark.parametrize("up_after", [0.01, 0.2, 0.26, 0.49, 1.0, 1.74, 3.9])
async def test_a_refusing_peer_that_comes_back_wakes_the_sleep_within_the_bound(
    autojump_clock: MockClock, up_after: float
) -> None:
    start = trio.current_time()
    peer = FakePeer(start + up_after)
    detectors = {TARGET: RecoveryDetector()}
    why = await wait_for_retry(5.0, [TARGET], detectors, probe=peer.probe)
    woke = trio.current_time() - start
    assert why == "accepting"
    assert up_after <= woke <= up_after + WORST_RECONNECT_DELAY_SECONDS
    assert peer.probes <= woke / RECONNECT_POLL_SECONDS + 2  # one probe per period, no more


async def test_a_peer_that_accepts_from_the_start_does_not_cut_the_backoff(
    autojump_clock: MockClock,
) -> None:
    """Accepting TCP but failing the stream (a load balancer, a duplicate id): the timer decides,
    and the peer is probed once, not every period."""
    start = trio.current_time()
    peer = FakePeer(start)
    why = await wait_for_retry(3.0, [TARGET], {TARGET: RecoveryDetector()}, probe=peer.probe)
    assert why == "timer"
    assert trio.current_time() - start == pytest.approx(3.0)
    assert peer.probes == 1


async def test_a_refusal_seen_in_an_earlier_sleep_still_counts(autojump_clock: MockClock) -> None:
    detector = RecoveryDetector()
    peer = FakePeer(trio.current_time() + 10)
    assert await wait_for_retry(1.0, [TARGET], {TARGET: detector}, probe=peer.probe) == "timer"
    peer.up_at = trio.current_time()  # came back between two sleeps (during an attempt)
    start = trio.current_time()
    assert await wait_for_retry(5.0, [TARGET], {TARGET: detector}, probe=peer.probe) == (
        "accepting"
    )
    assert trio.current_time() == start  # the very first probe wakes it


async def test_a_snapshot_poke_ends_the_sleep(autojump_clock: MockClock) -> None:
    poked = trio.Event()
    peer = FakePeer(trio.current_time() + 100)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def poke_later() -> None:
            await trio.sleep(0.7)
            poked.set()

        nursery.start_soon(poke_later)
        why = await wait_for_retry(
            5.0, [TARGET], {TARGET: RecoveryDetector()}, poked=poked, probe=peer.probe
        )
    assert why == "snapshot"
    assert trio.current_time() - start == pytest.approx(0.7)


async def test_any_of_several_targets_coming_back_wakes_a_watch(autojump_clock: MockClock) -> None:
    targets = [DialTarget(f"10.0.0.{i}:50071") for i in range(1, 4)]
    start = trio.current_time()
    up_at = {targets[0]: start + 100, targets[1]: start + 1.1, targets[2]: start + 100}

    async def probe(target: DialTarget) -> bool:
        if trio.current_time() >= up_at[target]:
            return True
        await trio.sleep(0.01)
        return False

    detectors = {target: RecoveryDetector() for target in targets}
    assert await wait_for_retry(5.0, targets, detectors, probe=probe) == "accepting"
    assert 1.1 <= trio.current_time() - start <= 1.1 + RECONNECT_POLL_SECONDS


async def test_tcp_accepts_on_loopback() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    try:
        assert await tcp_accepts(DialTarget(f"127.0.0.1:{port}"))
    finally:
        await listener.aclose()
    assert not await tcp_accepts(DialTarget(f"127.0.0.1:{port}"))
    assert await tcp_accepts(DialTarget("dns:///not-probed"))  # not host:port: never probed
