"""Static peers that can be absent: health-check each `--peer`, and leave the ones that stopped
answering out of `WatchStargates` until they answer again (docs/discovery.md).

A static peer list never changes, so without this a Pylon would keep registering with a replica
that was removed, or is down for good, forever: every replica that lists it keeps telling every
Pylon to dial it. With `--peer-absent-after-ms` > 0, each peer other than this replica is asked
`grpc.health.v1.Health/Check` for the control-plane service every `--dns-poll-ms`:

* a peer is **present** at start (replicas started together must not hide each other while
  they come up) and while it answers SERVING;
* it becomes **absent** once its checks have failed for `--peer-absent-after-ms` without a
  success in between (refused, timed out, NOT_SERVING because it drains or leaves, NOT_FOUND
  because the address is some other gRPC port);
* it is **present** again on its first successful check.

A peer that answers UNIMPLEMENTED (a replica from before health checking) counts as answering:
the process is there and speaks gRPC. With `--peer-absent-after-ms=0` static means static:
nothing is checked and every peer is always listed.

The rule is `next_status` (pure); `PeerHealthMonitor` adds the clock and the checks, and
`grpc_health_check` is the real check. This replica itself is never checked: it is not a peer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import trio

__all__ = [
    "CONTROL_PLANE_SERVICE",
    "DEFAULT_PEER_CHECK_TIMEOUT_MS",
    "PeerChecker",
    "PeerHealthMonitor",
    "PeerStatus",
    "grpc_health_check",
    "next_status",
]

log = logging.getLogger(__name__)

CONTROL_PLANE_SERVICE = "stargate.StargateControlPlane"
"""The service a peer is checked for: what Pylons use it for, and what only its control-plane
port serves (so an address naming another port of a replica fails with NOT_FOUND)."""

DEFAULT_PEER_CHECK_TIMEOUT_MS = 1000
"""How long one check may take. A replica answers in milliseconds; a peer that needs a second is
as good as gone for the Pylons too. It fails one check, not the peer: absence needs a whole
`--peer-absent-after-ms` of failures."""

PeerChecker = Callable[[str, float], Awaitable[bool]]
"""`(address, seconds)` -> whether the replica there answered healthy within `seconds` (the
gRPC deadline to set). May raise; an exception counts as a failed check."""


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """One peer's state: listed or not, and since when its current run of failures lasts."""

    present: bool = True
    failing_since: float | None = None


def next_status(status: PeerStatus, *, ok: bool, now: float, absent_after_s: float) -> PeerStatus:
    """The peer's status after one check that ended at `now`.

    A success makes it present at once and ends the failure run. A failure starts a run (or
    continues it); the peer becomes absent when the run has lasted `absent_after_s`, measured
    from the first failed check, and stays absent until a success.
    """
    if ok:
        return PeerStatus()
    since = now if status.failing_since is None else status.failing_since
    return PeerStatus(status.present and now - since < absent_after_s, since)


async def grpc_health_check(address: str, seconds: float) -> bool:
    """`grpc.health.v1.Health/Check` of the control-plane service at `address` (plain text).

    grpcio's client blocks, so the call runs in a worker thread, abandoned on cancellation (its
    own deadline ends it soon after). A fresh channel per check, with subchannels of its own:
    grpcio otherwise shares a subchannel per address, whose reconnect backoff (up to two minutes
    after a long outage) would fail checks of a peer that is already back.
    """
    import grpc
    from grpc_health.v1 import health_pb2

    def call() -> bool:
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(address, options) as channel:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            request = health_pb2.HealthCheckRequest(service=CONTROL_PLANE_SERVICE)
            try:
                response = check(request, timeout=seconds)
            except grpc.RpcError as error:
                code = getattr(error, "code", None)  # the raised errors are also `grpc.Call`s
                return callable(code) and code() is grpc.StatusCode.UNIMPLEMENTED
            return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    return await trio.to_thread.run_sync(call, abandon_on_cancel=True)


class PeerHealthMonitor:
    """Checks every peer on its own schedule and keeps its `PeerStatus`; `absent()` is what the
    publisher leaves out of its next snapshot.

    One task per peer, so a peer whose check hangs until the timeout delays nobody else's. Each
    peer is checked every `interval_ms` (at once if a check took longer). Only transitions are
    logged: a WARNING when a peer becomes absent, INFO when it is back.
    """

    def __init__(
        self,
        peers: Mapping[str, str],
        *,
        absent_after_ms: int,
        interval_ms: int,
        checker: PeerChecker = grpc_health_check,
        check_timeout_ms: int = DEFAULT_PEER_CHECK_TIMEOUT_MS,
    ) -> None:
        """`peers` maps each peer's address to the id it is published under."""
        if absent_after_ms <= 0 or interval_ms <= 0 or check_timeout_ms <= 0:
            raise ValueError("peer absence, check interval and check timeout must be > 0")
        self._peers = dict(peers)
        self._absent_after_s = absent_after_ms / 1000
        self._interval_s = interval_ms / 1000
        self._timeout_s = check_timeout_ms / 1000
        self._checker = checker
        self._status = dict.fromkeys(self._peers, PeerStatus())

    @property
    def addresses(self) -> Iterable[str]:
        return self._peers.keys()

    def status(self, address: str) -> PeerStatus:
        return self._status[address]

    def absent(self) -> frozenset[str]:
        """Addresses of the peers that are absent now."""
        return frozenset(address for address, s in self._status.items() if not s.present)

    def observe(self, address: str, *, ok: bool, now: float) -> None:
        """Apply one check's outcome (the monitor's tasks call this; tests may too)."""
        before = self._status[address]
        after = next_status(before, ok=ok, now=now, absent_after_s=self._absent_after_s)
        self._status[address] = after
        name = self._peers[address] or address
        if before.present and not after.present:
            log.warning(
                "static peer %s (%s) has not answered a health check for %d ms; "
                "WatchStargates leaves it out until it answers again",
                name,
                address,
                round(self._absent_after_s * 1000),
            )
        elif not before.present and after.present:
            log.info("static peer %s (%s) answers again; WatchStargates lists it", name, address)

    async def run(self) -> None:
        """Check every peer until cancelled."""
        async with trio.open_nursery() as nursery:
            for address in self._peers:
                nursery.start_soon(self._watch, address)

    async def _watch(self, address: str) -> None:
        while True:
            started = trio.current_time()
            ok = await self._check(address)
            self.observe(address, ok=ok, now=trio.current_time())
            await trio.sleep_until(started + self._interval_s)

    async def _check(self, address: str) -> bool:
        """One check, bounded by the timeout even if the checker ignores it."""
        try:
            with trio.move_on_after(self._timeout_s):
                return await self._checker(address, self._timeout_s)
        except Exception as error:  # any failure of the check is a failed check, never a crash
            log.debug("health check of static peer %s failed: %r", address, error)
        return False
