"""The mock engine's admission core (stargate/mock/scheduler.py), pure: FIFO order, running
slots, KV reservations, head-of-line blocking, leaving from the queue, resizing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stargate.mock
from stargate.mock.prefix_cache import Lookup, capacity_within_kv, tokens_per_block
from stargate.mock.prefix_cache import uncached_tokens as uncached
from stargate.mock.scheduler import Scheduler


def test_unlimited_admits_everything_at_once() -> None:
    scheduler = Scheduler()
    assert all(scheduler.submit(ticket, 10**9) for ticket in range(100))
    assert (scheduler.running, scheduler.waiting, scheduler.kv_used) == (100, 0, 100 * 10**9)
    assert scheduler.kv_free is None
    assert scheduler.leave(5) == []
    assert scheduler.running == 99


def test_slots_queue_the_rest_in_arrival_order() -> None:
    scheduler = Scheduler(max_num_seqs=2)
    assert [scheduler.submit(ticket, 1) for ticket in (1, 2, 3, 4, 5)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert (scheduler.running, scheduler.waiting) == (2, 3)
    assert not scheduler.can_admit_now(0)
    assert scheduler.leave(2) == [3]
    assert scheduler.is_running(3) and scheduler.is_waiting(4)
    assert scheduler.leave(1) == [4]
    assert scheduler.leave(3) == [5]
    assert scheduler.leave(4) == []
    assert scheduler.leave(5) == []
    assert (scheduler.running, scheduler.waiting, scheduler.kv_used) == (0, 0, 0)
    assert scheduler.can_admit_now(0)


def test_a_waiting_ticket_that_leaves_frees_its_place_and_unblocks_the_queue() -> None:
    scheduler = Scheduler(max_num_seqs=1, kv_cache_tokens=100)
    assert scheduler.submit(1, 50)
    assert not scheduler.submit(2, 60)  # blocked by KV (50 + 60 > 100)
    assert not scheduler.submit(3, 10)  # would fit, but FIFO: behind 2, and no slot
    assert scheduler.leave(2) == []  # 2 gives up; 3 is now the head but there is no slot
    assert scheduler.waiting == 1
    assert scheduler.leave(1) == [3]
    assert (scheduler.running, scheduler.kv_used, scheduler.kv_free) == (1, 10, 90)
    # Leaving twice, or an unknown ticket, changes nothing.
    assert scheduler.leave(1) == [] and scheduler.leave(99) == []
    assert scheduler.kv_used == 10


def test_kv_admission_is_strict_fifo_with_head_of_line_blocking() -> None:
    scheduler = Scheduler(kv_cache_tokens=100)
    assert scheduler.submit(1, 70)
    assert not scheduler.submit(2, 40)  # 70 + 40 > 100
    assert not scheduler.submit(3, 5)  # fits, but waits behind 2
    assert not scheduler.can_admit_now(1)
    assert scheduler.kv_used == 70
    # When 1 leaves, 2 and 3 both fit (40 + 5): admitted in order.
    assert scheduler.leave(1) == [2, 3]
    assert (scheduler.running, scheduler.kv_used, scheduler.kv_free) == (2, 45, 55)


def test_a_reservation_larger_than_the_cache_never_fits_and_is_refused() -> None:
    scheduler = Scheduler(kv_cache_tokens=100)
    assert scheduler.fits_at_all(100) and not scheduler.fits_at_all(101)
    with pytest.raises(ValueError, match="exceed"):
        scheduler.submit(1, 101)
    assert (scheduler.running, scheduler.waiting) == (0, 0)
    assert scheduler.submit(1, 100)
    with pytest.raises(ValueError, match="already"):
        scheduler.submit(1, 1)
    with pytest.raises(ValueError):
        scheduler.submit(2, -1)
    assert Scheduler().fits_at_all(10**12)


def test_more_slots_admit_waiters_and_fewer_preempt_nothing() -> None:
    scheduler = Scheduler(max_num_seqs=1)
    for ticket in (1, 2, 3, 4):
        scheduler.submit(ticket, 1)
    assert scheduler.set_max_num_seqs(3) == [2, 3]
    assert scheduler.set_max_num_seqs(1) == []
    assert (scheduler.running, scheduler.waiting) == (3, 1)
    assert scheduler.leave(1) == [] and scheduler.leave(2) == []  # still 1 running >= 1 slot
    assert scheduler.leave(3) == [4]
    assert scheduler.set_max_num_seqs(0) == []
    assert scheduler.max_num_seqs == 0
    with pytest.raises(ValueError):
        scheduler.set_max_num_seqs(-1)
    with pytest.raises(ValueError):
        Scheduler(max_num_seqs=-1)
    with pytest.raises(ValueError):
        Scheduler(kv_cache_tokens=-1)


def test_uncached_tokens_round_up_on_integers() -> None:
    # 30 % uncached of 100 tokens is 30 exactly (100 * (1 - 0.7) is 30.000000000000004).
    assert uncached(100, Lookup(prompt_chars=1000, hit_blocks=7, hit_chars=700)) == 30
    assert uncached(10, Lookup(prompt_chars=300, hit_blocks=2, hit_chars=128)) == 6  # 5.73
    assert uncached(10, Lookup(prompt_chars=256, hit_blocks=4, hit_chars=256)) == 0
    assert uncached(10, Lookup(prompt_chars=256, hit_blocks=0, hit_chars=0)) == 10
    assert uncached(7, Lookup(prompt_chars=0, hit_blocks=0, hit_chars=0)) == 7


def test_the_prefix_cache_capacity_within_the_kv_cache() -> None:
    assert tokens_per_block(64) == 16
    assert tokens_per_block(65) == 17
    assert tokens_per_block(1) == 1
    assert capacity_within_kv(100, 64, None) == 100  # unbounded KV: the flag alone
    assert capacity_within_kv(100, 64, 160) == 10  # 160 free tokens: ten 16-token blocks
    assert capacity_within_kv(100, 64, 175) == 10
    assert capacity_within_kv(5, 64, 160) == 5
    assert capacity_within_kv(100, 64, 0) == 0
    assert capacity_within_kv(0, 64, 10_000) == 0  # off stays off


@pytest.mark.parametrize("name", ["scheduler.py", "engine_metrics.py", "prefix_cache.py"])
def test_the_pure_cores_import_no_event_loop_or_io(name: str) -> None:
    path = Path(stargate.mock.__file__).parent / name
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported & {"trio", "socket", "httpx", "h11", "hypercorn", "asyncio", "time"} == set()
