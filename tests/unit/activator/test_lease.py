"""The pure lease rules (stargate/activator/lease.py) with plain numbers: the record and its JSON,
lease names, and client-go's election rules (docs/pool-ownership.md, "Leases")."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from stargate.activator.lease import (
    OWNER_URL_ANNOTATION,
    Action,
    Decision,
    LeaseFormatError,
    LeaseRecord,
    LeaseTimings,
    current_holder,
    decide,
    expires_at,
    format_micro_time,
    lease_name,
    observe,
    parse_micro_time,
    released_record,
    written_record,
)

T = LeaseTimings(lease_duration=15, renew_deadline=10, retry_period=2)
WALL = datetime(2026, 12, 1, 15, 4, 5, 123456, tzinfo=UTC)
ME = "replica-a"
OTHER = "replica-b"


def held(
    holder: str = OTHER, *, duration: int | None = 15, rv: str = "7", **kw: Any
) -> LeaseRecord:
    return LeaseRecord(
        holder, f"http://{holder}:8000", duration, WALL, WALL, kw.pop("transitions", 3), rv, **kw
    )


# ---- MicroTime -----------------------------------------------------------------------------------


def test_micro_time_has_six_fractional_digits_in_utc() -> None:
    assert format_micro_time(WALL) == "2026-12-01T15:04:05.123456Z"
    assert format_micro_time(WALL.replace(microsecond=0)) == "2026-12-01T15:04:05.000000Z"
    plus_two = WALL.astimezone(timezone(timedelta(hours=2)))
    assert format_micro_time(plus_two) == "2026-12-01T15:04:05.123456Z"
    with pytest.raises(ValueError, match="aware"):
        format_micro_time(datetime(2026, 1, 1))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-12-01T15:04:05.123456Z", WALL),
        ("2026-12-01T15:04:05Z", WALL.replace(microsecond=0)),
        ("2026-12-01T15:04:05.123456789Z", WALL),  # nanoseconds: cut to microseconds
        ("2026-12-01T17:04:05.123456+02:00", WALL),
    ],
)
def test_micro_time_parses_rfc3339(text: str, expected: datetime) -> None:
    assert parse_micro_time(text) == expected
    assert parse_micro_time(text).tzinfo is UTC


@pytest.mark.parametrize("text", ["yesterday", "2026-12-01T15:04:05", ""])
def test_micro_time_refuses_garbage_and_naive_times(text: str) -> None:
    with pytest.raises(LeaseFormatError):
        parse_micro_time(text)


# ---- the record and its JSON ---------------------------------------------------------------------


def test_record_round_trips_through_the_lease_json() -> None:
    record = LeaseRecord("replica-a", "http://10.0.0.7:8000", 15, WALL, WALL, 4, "812")
    lease = record.to_lease("stargate-pool-gpu0", "models")
    assert lease == {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": "stargate-pool-gpu0",
            "namespace": "models",
            "annotations": {"stargate.dev/owner-url": "http://10.0.0.7:8000"},
            "resourceVersion": "812",
        },
        "spec": {
            "holderIdentity": "replica-a",
            "leaseDurationSeconds": 15,
            "acquireTime": "2026-12-01T15:04:05.123456Z",
            "renewTime": "2026-12-01T15:04:05.123456Z",
            "leaseTransitions": 4,
        },
    }
    assert LeaseRecord.from_lease(lease) == record


def test_a_new_record_has_no_resource_version_and_a_released_one_no_url() -> None:
    lease = LeaseRecord("", None, 1, WALL, WALL, 2).to_lease("n", "ns")
    assert "resourceVersion" not in lease["metadata"]
    assert "annotations" not in lease["metadata"]
    assert lease["spec"]["holderIdentity"] == ""  # released: present and empty, as client-go


def test_an_update_keeps_foreign_metadata_and_replaces_ours() -> None:
    observed_meta = {
        "name": "n",
        "namespace": "ns",
        "uid": "u-1",
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "managedFields": [{"manager": "kubectl"}],
        "resourceVersion": "old",
        "labels": {"team": "ml"},
        "annotations": {OWNER_URL_ANNOTATION: "http://old:8000", "note": "keep me"},
    }
    record = LeaseRecord(ME, "http://new:8000", 15, WALL, WALL, 1, "9")
    meta = record.to_lease("n", "ns", metadata=observed_meta)["metadata"]
    assert meta == {
        "name": "n",
        "namespace": "ns",
        "resourceVersion": "9",
        "labels": {"team": "ml"},
        "annotations": {OWNER_URL_ANNOTATION: "http://new:8000", "note": "keep me"},
    }
    freed = LeaseRecord("", None, 1, WALL, WALL, 1, "9").to_lease("n", "ns", metadata=meta)
    assert freed["metadata"]["annotations"] == {"note": "keep me"}
    assert observed_meta["resourceVersion"] == "old"  # the caller's mapping is not modified


def test_a_sparse_lease_reads_as_free() -> None:
    record = LeaseRecord.from_lease({"metadata": {"name": "n", "resourceVersion": "3"}, "spec": {}})
    assert record == LeaseRecord("", None, None, None, None, 0, "3")
    assert LeaseRecord.from_lease({"metadata": {}}).holder == ""


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "ConfigMap", "metadata": {}, "spec": {}},
        {"metadata": "x", "spec": {}},
        {"metadata": {}, "spec": {"holderIdentity": 7}},
        {"metadata": {}, "spec": {"leaseDurationSeconds": "15"}},
        {"metadata": {}, "spec": {"leaseDurationSeconds": True}},
        {"metadata": {}, "spec": {"renewTime": "soon"}},
        {"metadata": {"annotations": ["x"]}, "spec": {}},
    ],
)
def test_a_malformed_lease_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(LeaseFormatError):
        LeaseRecord.from_lease(body)


# ---- names ---------------------------------------------------------------------------------------

DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def test_a_clean_pool_name_is_used_as_is() -> None:
    assert lease_name("stargate", "gpu0") == "stargate-pool-gpu0"
    assert lease_name("llm-router", "heavy-slot") == "llm-router-pool-heavy-slot"


@pytest.mark.parametrize(
    "pool",
    ["GPU0", "gpu_0", "gpu.0", "gpu 0/a", "-gpu-", "ü", "", "x" * 64, "a" * 300, "heavy_slot."],
)
def test_other_pool_names_become_valid_and_get_a_hash(pool: str) -> None:
    name = lease_name("stargate", pool)
    assert DNS1123_SUBDOMAIN.fullmatch(name), name
    assert len(name) <= 253
    assert len(name) <= len("stargate-pool-") + 63
    assert re.search(r"[0-9a-f]{8}$", name), name


def test_pools_that_differ_only_in_spelling_never_share_a_lease() -> None:
    pools = ["gpu0", "GPU0", "Gpu0", "gpu_0", "gpu.0", "gpu-0", "x" * 64, "x" * 65, "x" * 63 + "y"]
    names = [lease_name("stargate", p) for p in pools]
    assert len(set(names)) == len(pools)
    assert lease_name("stargate", "GPU0") == lease_name("stargate", "GPU0")  # deterministic


# ---- timings -------------------------------------------------------------------------------------


def test_timings_must_let_the_holder_stop_first() -> None:
    assert LeaseTimings.from_ms(15_000, 10_000, 2_000) == T
    for bad in [(10, 10, 2), (15, 16, 2), (15, 10, 10), (15, 10, 0)]:
        with pytest.raises(ValueError, match="retry_period < renew_deadline < lease_duration"):
            LeaseTimings(*bad)


def test_the_written_duration_is_rounded_up() -> None:
    assert T.lease_duration_seconds == 15
    assert LeaseTimings(1.5, 1.0, 0.5).lease_duration_seconds == 2
    assert LeaseTimings(0.3, 0.2, 0.1).lease_duration_seconds == 1


# ---- observing -----------------------------------------------------------------------------------


def test_an_unchanged_record_keeps_the_time_it_was_first_seen() -> None:
    first = held()
    assert observe(None, None, first, 100.0) == (first, 100.0)
    assert observe(first, 100.0, held(), 130.0) == (first, 100.0)
    renewed = held(rv="8")  # any write bumps the resourceVersion
    assert observe(first, 100.0, renewed, 131.0) == (renewed, 131.0)
    assert observe(renewed, 131.0, None, 140.0) == (None, 140.0)  # deleted
    assert observe(None, 140.0, None, 150.0) == (None, 140.0)
    assert observe(None, None, None, 5.0) == (None, 5.0)  # first read: absent is known now


# ---- deciding ------------------------------------------------------------------------------------


def test_absent_lease_is_created_unless_not_acquiring() -> None:
    assert decide(None, 0.0, 0.0, ME, T) == Decision(Action.CREATE, "absent")
    assert decide(None, 0.0, 0.0, ME, T, acquiring=False).action is Action.WAIT


def test_our_own_lease_is_renewed_with_the_observed_version() -> None:
    ours = held(ME, rv="41")
    for now in (0.0, 14.9, 15.0, 1000.0):  # even "expired": nobody wrote since we read it
        assert decide(ours, 0.0, now, ME, T) == Decision(Action.RENEW, "ours", "41")
    assert decide(ours, 0.0, 5.0, ME, T, acquiring=False, holding=True).action is Action.RENEW
    # A leaving replica does not re-take a lease it already stopped deciding for.
    assert decide(ours, 0.0, 5.0, ME, T, acquiring=False, holding=False).action is Action.WAIT


def test_a_released_lease_is_taken_at_once() -> None:
    free = held("", duration=1, rv="50")
    assert decide(free, 100.0, 100.0, ME, T) == Decision(Action.TAKE_OVER, "released", "50")
    assert decide(free, 100.0, 100.0, ME, T, acquiring=False).action is Action.WAIT


@pytest.mark.parametrize(
    ("observed_at", "now", "expected"),
    [
        (100.0, 100.0, Action.WAIT),
        (100.0, 107.5, Action.WAIT),
        (100.0, 114.999, Action.WAIT),
        (100.0, 115.0, Action.TAKE_OVER),  # exactly the duration after we saw it change
        (100.0, 500.0, Action.TAKE_OVER),
    ],
)
def test_another_holders_lease_is_taken_only_after_its_duration_on_our_clock(
    observed_at: float, now: float, expected: Action
) -> None:
    decision = decide(held(rv="9"), observed_at, now, ME, T)
    assert decision.action is expected
    if expected is Action.WAIT:
        assert decision == Decision(Action.WAIT, "held", expires_at=115.0)
    else:
        assert decision == Decision(Action.TAKE_OVER, "expired", "9")
    lapsed = decide(held(), observed_at, now, ME, T, acquiring=False)
    assert lapsed.action is Action.WAIT


def test_the_records_own_duration_counts() -> None:
    short = held(duration=4)
    assert decide(short, 10.0, 13.9, ME, T).action is Action.WAIT
    assert decide(short, 10.0, 14.0, ME, T).action is Action.TAKE_OVER
    for missing in (None, 0, -3):  # no usable duration: ours stands in
        record = held(duration=missing)
        assert expires_at(record, 10.0, T) == 25.0
        assert decide(record, 10.0, 24.0, ME, T).action is Action.WAIT


@pytest.mark.parametrize("skew", [timedelta(days=-3650), timedelta(0), timedelta(days=3650)])
def test_the_renew_time_written_by_another_clock_is_never_trusted(skew: timedelta) -> None:
    record = LeaseRecord(OTHER, "http://b:8000", 15, WALL + skew, WALL + skew, 1, "3")
    assert decide(record, 50.0, 64.0, ME, T).action is Action.WAIT
    assert decide(record, 50.0, 65.0, ME, T).action is Action.TAKE_OVER
    assert current_holder(record, 50.0, 64.0, T) == record
    assert current_holder(record, 50.0, 65.0, T) is None


def test_the_owner_seen_by_a_follower() -> None:
    assert current_holder(None, 0.0, 0.0, T) is None
    assert current_holder(held(""), 0.0, 0.0, T) is None
    assert current_holder(held(), 0.0, 14.0, T) == held()


# ---- what is written -----------------------------------------------------------------------------


def test_a_created_record_names_us_from_now() -> None:
    decision = decide(None, 0.0, 0.0, ME, T)
    record = written_record(decision, None, ME, "http://a:8000", T, WALL)
    assert record == LeaseRecord(ME, "http://a:8000", 15, WALL, WALL, 0, None)


def test_a_renewal_keeps_the_term_and_a_takeover_starts_one() -> None:
    later = WALL + timedelta(seconds=2)
    ours = held(ME, rv="5", transitions=3)
    renewal = written_record(decide(ours, 0, 1, ME, T), ours, ME, "http://a2:8000", T, later)
    assert renewal == LeaseRecord(ME, "http://a2:8000", 15, WALL, later, 3, "5")
    theirs = held(OTHER, rv="6", transitions=3)
    takeover = written_record(decide(theirs, 0, 15, ME, T), theirs, ME, "http://a:8000", T, later)
    assert takeover == LeaseRecord(ME, "http://a:8000", 15, later, later, 4, "6")
    free = held("", rv="7", transitions=4)
    assert written_record(decide(free, 0, 0, ME, T), free, ME, "u", T, later).transitions == 5
    no_acquire_time = LeaseRecord(ME, "u", 15, None, None, 0, "8")
    renewed = written_record(
        Decision(Action.RENEW, "ours", "8"), no_acquire_time, ME, "u", T, later
    )
    assert renewed.acquire_time == later
    with pytest.raises(ValueError, match="nothing to write"):
        written_record(Decision(Action.WAIT, "held"), theirs, ME, "u", T, later)


def test_a_release_is_client_gos() -> None:
    later = WALL + timedelta(seconds=9)
    released = released_record(held(ME, rv="12", transitions=2), later)
    assert released == LeaseRecord("", None, 1, later, later, 2, "12")
    assert decide(released, 0.0, 0.0, OTHER, T).action is Action.TAKE_OVER
