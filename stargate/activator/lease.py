"""Pool leases, the pure part: the Lease record, its JSON, its name, and the election rules.

One `coordination.k8s.io/v1` Lease per pool says which replica decides for the pool
(docs/pool-ownership.md, "Leases"). The rules are client-go's leaderelection, so their safety
argument carries over:

* Expiry is judged by the *follower's own monotonic clock*, from the moment it last saw the record
  change, never by the record's `renewTime`: that was written by another machine's clock, and
  trusting it would let clock skew make two owners. Clocks then only need to run at about the
  same *rate*.
* A holder renews every retry period and counts itself owner only while its last successful
  write is younger than the renew deadline, measured from when that write was *sent*. A
  follower sees the write after the server applied it, so it cannot take over before
  `sent + lease_duration`, and `renew_deadline < lease_duration` makes the holder stop first.
* Every write carries the resourceVersion it was decided on; the API server refuses a stale one
  (409), so of two replicas deciding on the same observation only one write succeeds.
* A released lease (empty holderIdentity) may be taken at once.

Nothing here does I/O or reads a clock: times are passed in (`now` is monotonic seconds, `wall` a
datetime only written into the record for people and tools to read), so every rule is
unit-tested with plain numbers (tests/unit/activator/test_lease.py).
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Self

__all__ = [
    "API_VERSION",
    "OWNER_URL_ANNOTATION",
    "Action",
    "Decision",
    "LeaseFormatError",
    "LeaseRecord",
    "LeaseTimings",
    "current_holder",
    "decide",
    "expires_at",
    "format_micro_time",
    "lease_name",
    "observe",
    "parse_micro_time",
    "released_record",
    "written_record",
]

API_VERSION: Final = "coordination.k8s.io/v1"
#: The holder's HTTP base URL, where the other replicas send it the pool's requests.
OWNER_URL_ANNOTATION: Final = "stargate.dev/owner-url"


class LeaseFormatError(ValueError):
    """The object at the lease's name is not a Lease we can read."""


# ---- MicroTime -----------------------------------------------------------------------------------


def format_micro_time(value: datetime) -> str:
    """Kubernetes `MicroTime`: RFC 3339 in UTC with exactly six fractional digits."""
    if value.tzinfo is None:
        raise ValueError("a MicroTime needs an aware datetime")
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(text: str) -> datetime:
    """Read a `MicroTime`; like the API server, also accept plain RFC 3339 (no fraction, an
    offset, nanoseconds)."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise LeaseFormatError(f"{text!r} is not an RFC 3339 time") from None
    if value.tzinfo is None:
        raise LeaseFormatError(f"{text!r} has no time zone")
    return value.astimezone(UTC)


# ---- timings -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseTimings:
    """client-go's three leader-election timings, in seconds.

    `retry_period`: how often a holder renews and a follower re-reads. `renew_deadline`: a holder
    whose last successful renewal is this old stops deciding. `lease_duration`: how long a
    follower waits, on its own clock, after the record last changed before it may take over.
    `retry_period < renew_deadline < lease_duration` is what makes the holder stop first.
    """

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not (0 < self.retry_period < self.renew_deadline < self.lease_duration):
            raise ValueError(
                "lease timings must satisfy 0 < retry_period < renew_deadline < lease_duration, "
                f"got {self.retry_period:g} / {self.renew_deadline:g} / {self.lease_duration:g}"
            )

    @classmethod
    def from_ms(cls, lease_duration_ms: int, renew_deadline_ms: int, retry_period_ms: int) -> Self:
        return cls(lease_duration_ms / 1000, renew_deadline_ms / 1000, retry_period_ms / 1000)

    @property
    def lease_duration_seconds(self) -> int:
        """`spec.leaseDurationSeconds` is whole seconds: round up, never promising less."""
        return max(1, math.ceil(self.lease_duration))


# ---- the record ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What a Lease says, as client-go's `LeaderElectionRecord` plus the owner's URL.

    `holder` is `spec.holderIdentity`, "" when released or never held. `owner_url` lives in the
    annotation `stargate.dev/owner-url` (the Lease spec has no field for it). `lease_duration`
    (`spec.leaseDurationSeconds`) is None when absent. `resource_version` is the one the API
    server answered with (None on a record not yet written); equality includes it, so two reads
    of the same record compare equal and any write makes them differ.
    """

    holder: str
    owner_url: str | None = None
    lease_duration: int | None = None
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0
    resource_version: str | None = None

    def to_lease(
        self, name: str, namespace: str, *, metadata: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The Lease object to POST or PUT.

        `metadata` is the observed object's metadata: a PUT replaces the whole object, so labels,
        other annotations and owner references someone else put there are carried over.
        """
        meta: dict[str, Any] = dict(metadata or {})
        for generated in ("uid", "creationTimestamp", "managedFields", "generation"):
            meta.pop(generated, None)  # the server's own fields; it keeps them on a PUT
        meta["name"] = name
        meta["namespace"] = namespace
        annotations = {
            str(k): str(v)
            for k, v in dict(meta.get("annotations") or {}).items()
            if k != OWNER_URL_ANNOTATION
        }
        if self.owner_url is not None:
            annotations[OWNER_URL_ANNOTATION] = self.owner_url
        if annotations:
            meta["annotations"] = annotations
        else:
            meta.pop("annotations", None)
        if self.resource_version is not None:
            meta["resourceVersion"] = self.resource_version
        else:
            meta.pop("resourceVersion", None)
        spec: dict[str, Any] = {"holderIdentity": self.holder}
        if self.lease_duration is not None:
            spec["leaseDurationSeconds"] = self.lease_duration
        if self.acquire_time is not None:
            spec["acquireTime"] = format_micro_time(self.acquire_time)
        if self.renew_time is not None:
            spec["renewTime"] = format_micro_time(self.renew_time)
        spec["leaseTransitions"] = self.transitions
        return {"apiVersion": API_VERSION, "kind": "Lease", "metadata": meta, "spec": spec}

    @classmethod
    def from_lease(cls, body: Mapping[str, Any]) -> LeaseRecord:
        """Read a Lease object; raise `LeaseFormatError` when it is not one."""
        if body.get("kind", "Lease") != "Lease":
            raise LeaseFormatError(f"expected a Lease, got kind {body.get('kind')!r}")
        meta = body.get("metadata")
        spec = body.get("spec", {})
        if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
            raise LeaseFormatError("a Lease needs metadata and spec objects")
        annotations = meta.get("annotations") or {}
        if not isinstance(annotations, Mapping):
            raise LeaseFormatError("metadata.annotations is not an object")
        url = annotations.get(OWNER_URL_ANNOTATION)
        version = meta.get("resourceVersion")
        return cls(
            holder=_string(spec, "holderIdentity") or "",
            owner_url=str(url) if url else None,
            lease_duration=_integer(spec, "leaseDurationSeconds"),
            acquire_time=_time(spec, "acquireTime"),
            renew_time=_time(spec, "renewTime"),
            transitions=_integer(spec, "leaseTransitions") or 0,
            resource_version=str(version) if version else None,
        )


def _string(spec: Mapping[str, Any], key: str) -> str | None:
    value = spec.get(key)
    if value is not None and not isinstance(value, str):
        raise LeaseFormatError(f"spec.{key} is not a string: {value!r}")
    return value


def _integer(spec: Mapping[str, Any], key: str) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise LeaseFormatError(f"spec.{key} is not an integer: {value!r}")
    return value


def _time(spec: Mapping[str, Any], key: str) -> datetime | None:
    value = _string(spec, key)
    return None if not value else parse_micro_time(value)


# ---- names ---------------------------------------------------------------------------------------

_INVALID = re.compile(r"[^a-z0-9-]")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_POOL_PART_MAX: Final = 63  # a DNS label's length: a readable name, far below the 253 limit
_HASH_LEN: Final = 8


def lease_name(prefix: str, pool: str) -> str:
    """`<prefix>-pool-<pool>` as a valid DNS-1123 subdomain.

    The pool part is lower-cased with every character outside `[a-z0-9-]` replaced by `-`. If
    that changed the name, or the part is longer than 63 characters or does not start and end
    with a letter or digit, it is cut and a short hash of the *original* pool name appended, so
    two pools that differ only in case or punctuation never share a lease (and so never share an
    owner). `prefix` is a DNS label (`PoolOwnershipConfig` checks it).
    """
    part = _INVALID.sub("-", pool.lower())
    if part != pool or len(part) > _POOL_PART_MAX or not _LABEL.fullmatch(part):
        digest = hashlib.sha256(pool.encode()).hexdigest()[:_HASH_LEN]
        head = part[: _POOL_PART_MAX - _HASH_LEN - 1].strip("-")
        part = f"{head}-{digest}" if head else digest
    return f"{prefix}-pool-{part}"


# ---- the rules -----------------------------------------------------------------------------------


class Action(enum.Enum):
    CREATE = "create"  # no Lease yet: create it naming us
    RENEW = "renew"  # the Lease names us: write a fresh renewTime
    TAKE_OVER = "take_over"  # released, or expired on our clock: write it naming us
    WAIT = "wait"  # someone else holds it, or we may not acquire


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do now. `resource_version` is the observed one, which a RENEW or TAKE_OVER write
    must carry. `expires_at` (monotonic, our clock): when another holder's lease lapses for us,
    set when waiting on a held lease. `why` is a short word for logs and tests."""

    action: Action
    why: str
    resource_version: str | None = None
    expires_at: float | None = None


def expires_at(observed: LeaseRecord, observed_at: float, timings: LeaseTimings) -> float:
    """When `observed` lapses on our clock: its duration after we saw it change.

    The record's own `leaseDurationSeconds` counts (the holder promised to renew within it, and
    a release writes 1), as in client-go; ours only stands in when the record has none.
    """
    duration = observed.lease_duration
    seconds = float(duration) if duration is not None and duration > 0 else timings.lease_duration
    return observed_at + seconds


def observe(
    previous: LeaseRecord | None,
    previous_at: float | None,
    fresh: LeaseRecord | None,
    now: float,
) -> tuple[LeaseRecord | None, float]:
    """The record to judge by and when it was observed: a record that did not change keeps the
    time it was first seen, so a holder that stopped renewing lapses."""
    if previous_at is not None and fresh == previous:
        return previous, previous_at
    return fresh, now


def decide(
    observed: LeaseRecord | None,
    observed_at: float,
    now: float,
    identity: str,
    timings: LeaseTimings,
    *,
    acquiring: bool = True,
    holding: bool = False,
) -> Decision:
    """The next step for `identity` given the last observation (None: no Lease exists).

    `acquiring`: may create or take over (False for a replica that is leaving, or after it
    released the pool). `holding`: this replica currently counts itself the owner; a replica
    that is no longer acquiring renews only what it still holds, and lets a lease it already
    stopped deciding for lapse.
    """
    if observed is None:
        return Decision(Action.CREATE, "absent") if acquiring else Decision(Action.WAIT, "absent")
    version = observed.resource_version
    if observed.holder == identity:
        # The record names us and nobody has written since we read it (the write below carries
        # that resourceVersion), so renewing cannot displace anyone.
        if acquiring or holding:
            return Decision(Action.RENEW, "ours", version)
        return Decision(Action.WAIT, "ours, not acquiring")
    if not observed.holder:
        if acquiring:
            return Decision(Action.TAKE_OVER, "released", version)
        return Decision(Action.WAIT, "released, not acquiring")
    lapse = expires_at(observed, observed_at, timings)
    if now < lapse:
        return Decision(Action.WAIT, "held", expires_at=lapse)
    if acquiring:
        return Decision(Action.TAKE_OVER, "expired", version)
    return Decision(Action.WAIT, "expired, not acquiring")


def written_record(
    decision: Decision,
    observed: LeaseRecord | None,
    identity: str,
    owner_url: str,
    timings: LeaseTimings,
    wall: datetime,
) -> LeaseRecord:
    """The record a CREATE, RENEW or TAKE_OVER writes (client-go's bookkeeping: a renewal keeps
    acquireTime and the transition count, a takeover starts a new term and counts one more)."""
    if decision.action is Action.CREATE:
        return LeaseRecord(identity, owner_url, timings.lease_duration_seconds, wall, wall, 0)
    if decision.action is Action.WAIT or observed is None:
        raise ValueError(f"nothing to write for {decision}")
    if decision.action is Action.RENEW:
        acquired = observed.acquire_time or wall
        transitions = observed.transitions
    else:
        acquired = wall
        transitions = observed.transitions + 1
    return LeaseRecord(
        identity,
        owner_url,
        timings.lease_duration_seconds,
        acquired,
        wall,
        transitions,
        decision.resource_version,
    )


def released_record(observed: LeaseRecord, wall: datetime) -> LeaseRecord:
    """client-go's ReleaseOnCancel: no holder, a one-second duration, renewed now, same term
    count, carrying the observed resourceVersion (so a release never frees a lease that someone
    else took in the meantime)."""
    return LeaseRecord("", None, 1, wall, wall, observed.transitions, observed.resource_version)


def current_holder(
    observed: LeaseRecord | None, observed_at: float, now: float, timings: LeaseTimings
) -> LeaseRecord | None:
    """The observed record if someone holds it and it has not lapsed on our clock, else None."""
    if observed is None or not observed.holder:
        return None
    return observed if now < expires_at(observed, observed_at, timings) else None
