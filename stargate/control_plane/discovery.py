"""Peer discovery and the `WatchStargates` publisher (docs/control-plane.md, WatchStargates).

A Pylon learns which replicas exist from `WatchStargates` and registers with every one of them,
so what this module publishes decides which replicas receive backends. Three discovery modes
(project decision; the Kubernetes SRV mode of the Rust replica is not needed):

* **DNS** (`--stargate-discovery-dns-name`): A/AAAA lookup polled every `--dns-poll-ms`. In
  Kubernetes the name is the headless Service, whose records are the pod IPs; with
  `publishNotReadyAddresses` warming pods are listed too, which is what lets Pylons register with
  a replica during its readiness warmup.
* **Static peers** (`--peer ADDR`, repeatable, `host:port` or `id=host:port`): a fixed list, for
  hosts without DNS-based discovery (docker compose, bare metal). With `--peer-absent-after-ms`
  > 0 each peer is health-checked and left out while it has not answered for that long
  (`stargate.control_plane.peer_health`), so Pylons stop dialling a replica that is gone.
* **Self only** (`--disable-dns-discovery`, or nothing configured): just this replica.

The module is split so that every rule can be tested without a clock or a network:

* pure functions (`normalize_remote_urls`, `build_snapshot`, `dns_entries`, `peer_entries`,
  `should_publish`, `next_tick`) hold the rules;
* `WatchPublisher` owns time and I/O: it polls, decides, and hands the latest snapshot to any
  number of `WatchSubscription`s with latest-value semantics;
* `replica_publisher` builds this replica's publisher from its serve config and bound ports (the
  advertise address rule is `publisher_config`'s).

The snapshots are plain dataclasses; the gRPC layer converts them to protobuf messages.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import trio

from stargate.addresses import (
    AddressError,
    AddressProblem,
    canonical_host,
    format_host_port,
    is_host_name,
    parse_host_port,
)
from stargate.config import (
    ConfigError,
    DiscoveryConfig,
    ListenAddress,
    ServeConfig,
    parse_listen_address,
)
from stargate.control_plane.peer_health import (
    DEFAULT_PEER_CHECK_TIMEOUT_MS,
    PeerChecker,
    PeerHealthMonitor,
    grpc_health_check,
)
from stargate.serving import StartupError

__all__ = [
    "DEFAULT_RESOLVE_TIMEOUT_MS",
    "DiscoveryMode",
    "PublisherConfig",
    "Resolver",
    "StargateInfo",
    "WatchPublisher",
    "WatchSnapshot",
    "WatchSubscription",
    "build_snapshot",
    "dns_entries",
    "host_address",
    "next_tick",
    "normalize_remote_urls",
    "parse_peer",
    "peer_entries",
    "publisher_config",
    "replica_publisher",
    "resolve_ips",
    "should_publish",
]

log = logging.getLogger(__name__)

DEFAULT_RESOLVE_TIMEOUT_MS = 1000
"""How long one DNS lookup may take before the poll counts as failed.

The Rust replica configures its resolver with a 1 s timeout and a single attempt; the system
resolver's own retries (5 s x attempts) would otherwise stall the publisher for several polls.
"""


# --------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True, slots=True)
class StargateInfo:
    """One replica as published in `WatchStargatesResponse.stargates`
    (`stargate/protocol/stargate.proto`).

    `advertise_addr` is the gRPC authority a Pylon uses; `grpc_pylon_dial_addr`, when set, is
    what it actually dials (e.g. a load balancer) while keeping `advertise_addr` as authority.
    `http_advertise_addr` is empty for every replica but the publishing one (per-peer HTTP
    addresses are not synthesized: docs/control-plane.md, WatchStargates).
    """

    stargate_id: str
    advertise_addr: str
    http_advertise_addr: str = ""
    grpc_pylon_dial_addr: str = ""

    @property
    def key(self) -> str:
        """The sort and identity key of a published entry: its id, or its address when blank."""
        return self.stargate_id or self.advertise_addr


@dataclass(frozen=True, slots=True)
class WatchSnapshot:
    """One `WatchStargatesResponse`: the replicas to register with, plus remote watch seeds.

    Equality is structural, which is how the publisher detects a change.
    """

    stargates: tuple[StargateInfo, ...] = ()
    watch_stargate_urls: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to tell a Pylon; such a snapshot is not sent on connect."""
        return not self.stargates and not self.watch_stargate_urls


class DiscoveryMode(enum.Enum):
    """Where the published replica list comes from."""

    DNS = "dns"
    PEERS = "peers"
    SELF_ONLY = "self-only"


# --------------------------------------------------------------------------------------------
# Address helpers


def _parse_authority(text: str, what: str) -> str:
    """Canonical `host:port` of a peer address; the host may be an IP literal or a DNS name.

    Peers may be host names (unlike `--advertise-addr`) because a Pylon only uses the address as
    a gRPC authority and dial target, and static deployments usually name their hosts.
    """
    try:
        return str(parse_host_port(text, names=True, min_port=1))
    except AddressError as error:
        problems = error.problems
        if AddressProblem.SYNTAX in problems:
            raise ConfigError(f"{what} {text!r} is not HOST:PORT (e.g. 10.0.0.2:50071)") from None
        if AddressProblem.PORT in problems:
            raise ConfigError(f"{what} {text!r}: port must be a number from 1 to 65535") from None
        if error.bracketed:
            raise ConfigError(
                f"{what} {text!r}: {f'[{error.host}]'!r} is not an IPv6 address"
            ) from None
        if AddressProblem.BRACKETS in problems:
            raise ConfigError(
                f"{what} {text!r}: an IPv6 address must be written in brackets"
            ) from None
        raise ConfigError(
            f"{what} {text!r}: {error.host!r} is neither an IP address nor a host name"
        ) from None


def _advertise_address(text: str, what: str) -> str:
    """Canonical `IP:port` (non-zero port) of an address this replica publishes about itself."""
    try:
        address = parse_listen_address(text)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    if address.port == 0:
        raise ConfigError(
            f"{what} {text!r} has port 0; build the discovery config after binding, with the "
            "bound port (an advertised port 0 is rewritten to the listener's port)"
        )
    return str(address)


def parse_peer(text: str) -> tuple[str, str]:
    """Parse one `--peer` value into `(id, canonical address)`; the id is "" when not given.

    `id=host:port` names the peer as its own `--stargate-id` would, so every replica publishes
    the same ids whichever of them a Pylon watches; a bare `host:port` is published with the
    address as its id, as DNS-discovered peers are.
    """
    value = text.strip()
    if "," in value:
        raise ConfigError(f"peer {text!r} contains ','; pass --peer once per peer")
    peer_id, sep, address = value.rpartition("=")
    if sep:
        peer_id = peer_id.strip()
        if not peer_id:
            raise ConfigError(f"peer {text!r}: the id before '=' must not be empty")
    return peer_id, _parse_authority(address.strip(), "peer")


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """What the `WatchStargates` publisher needs: the discovery settings (validated on their own,
    `stargate.config.DiscoveryConfig`) plus this replica's id and bound addresses, checked
    together so that bad input fails at start-up.

    Mode selection (see `mode`):

    * `peers` given: static peer list. Combining it with `dns_name` or `disable_dns_discovery` is
      an error (raised by the settings): the operator asked for two different replica lists and
      we would silently ignore one of them.
    * `disable_dns_discovery`: self only. A `dns_name` may still be given (Helm always passes
      it); it then only serves to filter this replica out of the remote watch URLs, as in Rust.
    * `dns_name` set: DNS polling.
    * nothing set: self only. Chosen over an error because that is what a single replica started
      by hand expects; the publisher logs a WARNING at start so that a multi-replica deployment
      that forgot its discovery name is visible (`implicit_self_only`).

    Addresses are stored canonically (`advertise_addr` and `http_advertise_addr` as `IP:port`
    with IPv6 in brackets), so equality checks against discovered IPs are exact.
    `advertise_addr` must carry the real port: build this config after the gRPC listener is
    bound when `--listen-addr` uses port 0.
    """

    stargate_id: str
    advertise_addr: str
    http_advertise_addr: str = ""
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # canonicalisation of a frozen dataclass
        if not self.stargate_id.strip():
            raise ConfigError("stargate id must not be empty")
        set_(self, "advertise_addr", _advertise_address(self.advertise_addr, "advertise address"))
        if self.http_advertise_addr.strip():
            set_(
                self,
                "http_advertise_addr",
                _advertise_address(self.http_advertise_addr, "HTTP advertise address"),
            )
        else:
            set_(self, "http_advertise_addr", "")
        dns_name = self.discovery.dns_name
        if dns_name is not None and not is_host_name(dns_name):
            raise ConfigError(
                f"discovery DNS name {dns_name!r} is not a host name "
                "(give the name only, without scheme or port)"
            )
        if self.discovery.peers:
            _merge_peers(self)  # raises on malformed or conflicting peers

    @property
    def mode(self) -> DiscoveryMode:
        settings = self.discovery
        if settings.peers:
            return DiscoveryMode.PEERS
        if settings.disable_dns_discovery or settings.dns_name is None:
            return DiscoveryMode.SELF_ONLY
        return DiscoveryMode.DNS

    @property
    def implicit_self_only(self) -> bool:
        """Self only because nothing was configured, rather than by `--disable-dns-discovery`."""
        settings = self.discovery
        return not (settings.peers or settings.disable_dns_discovery or settings.dns_name)

    @property
    def advertise_port(self) -> int:
        return int(self.advertise_addr.rpartition(":")[2])

    @property
    def self_entry(self) -> StargateInfo:
        """This replica: the only entry that carries an HTTP address."""
        return StargateInfo(self.stargate_id, self.advertise_addr, self.http_advertise_addr)


def _merge_peers(config: PublisherConfig) -> dict[str, str]:
    """Peers other than this replica, as `{address: id}` ("" = no explicit id).

    One peer list can be shared by every replica: an entry with this replica's advertise address
    or with its `--stargate-id` stands for this replica and is folded into the self entry (an
    id-matched entry's address is ignored, which allows host-name spellings of self). Exact
    repeats are dropped. Contradictions are errors because they would publish two replicas under
    one id, or one replica under two ids.
    """
    merged: dict[str, str] = {}
    owner_of_id: dict[str, str] = {}
    for text in config.discovery.peers:
        peer_id, address = parse_peer(text)
        if address == config.advertise_addr:
            if peer_id and peer_id != config.stargate_id:
                raise ConfigError(
                    f"peer {text!r} has this replica's advertise address but id {peer_id!r}, "
                    f"not its --stargate-id {config.stargate_id!r}"
                )
            continue
        if peer_id == config.stargate_id:
            continue
        known_id = merged.get(address)
        if known_id and peer_id and known_id != peer_id:
            raise ConfigError(
                f"peer address {address} is listed with ids {known_id!r} and {peer_id!r}"
            )
        if peer_id:
            owner = owner_of_id.setdefault(peer_id, address)
            if owner != address:
                raise ConfigError(f"peer id {peer_id!r} is listed with {owner} and {address}")
        merged[address] = peer_id or known_id or ""
    return merged


# --------------------------------------------------------------------------------------------
# Pure rules


def _endpoint(text: str) -> tuple[str | None, str]:
    """`(host, host:port key)` of a watch URL or address, for deduplication and self filtering.

    Accepts `host:port`, `scheme://host:port/...` and IPv6 in brackets; a missing port defaults
    by scheme (http 80, https 443) or is left out of the key. Unparseable text is its own key.
    """
    try:
        parts = urlsplit(text if "://" in text else f"//{text}")
        host = parts.hostname
        port = parts.port
    except ValueError:
        return None, text.lower()
    if not host:
        return None, text.lower()
    host = canonical_host(host)
    if port is None:
        port = {"http": 80, "https": 443}.get(parts.scheme.lower())
    if port is None:
        return host, f"[{host}]" if ":" in host else host
    return host, format_host_port(host, port)


def normalize_remote_urls(
    urls: Iterable[str], *, self_addresses: Iterable[str], dns_name: str | None
) -> tuple[str, ...]:
    """The remote `WatchStargates` seeds to re-publish as `watch_stargate_urls`.

    docs/control-plane.md, WatchStargates.

    Each value may hold several comma-separated URLs (the env variable and the flag both split).
    Entries are trimmed, blanks dropped, deduplicated by `host:port` (the first spelling is kept)
    and sorted, so the published list, and therefore change detection, does not depend on flag
    order. Entries pointing at this replica are dropped (docs/control-plane.md, WatchStargates): any
    of `self_addresses`, and any port on the discovery DNS name or its `-headless.` -> `.` variant
    (the headless Service's ClusterIP sibling), because a Pylon told to watch us through a remote
    seed would only learn what it already knows, and would lose it whenever that extra stream
    reconnects.
    """
    self_keys = {_endpoint(address.strip())[1] for address in self_addresses if address.strip()}
    own_hosts: set[str] = set()
    if dns_name and dns_name.strip():
        name = canonical_host(dns_name.strip())
        own_hosts = {name, name.replace("-headless.", ".")}
    kept: dict[str, str] = {}
    for value in urls:
        for part in value.split(","):
            url = part.strip()
            if not url:
                continue
            host, key = _endpoint(url)
            if key in self_keys or (host is not None and host in own_hosts):
                continue
            kept.setdefault(key, url)
    return tuple(sorted(kept.values()))


def build_snapshot(
    entries: Iterable[StargateInfo],
    *,
    remote_urls: tuple[str, ...],
    grpc_pylon_dial_addr: str | None,
) -> WatchSnapshot:
    """Turn discovered entries into the published response (docs/control-plane.md, WatchStargates).

    1. Deduplicate by `advertise_addr`: an entry with a non-empty id replaces the one seen before
       (so a named entry beats an anonymous one, and a later named one wins); an empty id never
       replaces anything.
    2. Key by id (address when the id is empty). If two addresses share an id, the one whose
       address sorts last wins, so the result never depends on resolver order.
    3. Emit sorted by key, with `grpc_pylon_dial_addr` overwritten on every entry when configured
       (a Pylon dials it but keeps `advertise_addr` as authority).
    """
    by_address: dict[str, StargateInfo] = {}
    for entry in entries:
        if entry.advertise_addr not in by_address or entry.stargate_id:
            by_address[entry.advertise_addr] = entry
    by_key: dict[str, StargateInfo] = {}
    for entry in sorted(by_address.values(), key=lambda e: (e.key, e.advertise_addr)):
        by_key[entry.key] = entry
    dial = (grpc_pylon_dial_addr or "").strip()
    stargates = tuple(by_key[key] for key in sorted(by_key))
    if dial:
        stargates = tuple(replace(entry, grpc_pylon_dial_addr=dial) for entry in stargates)
    return WatchSnapshot(stargates=stargates, watch_stargate_urls=tuple(remote_urls))


def _sorted_entries(entries: Iterable[StargateInfo]) -> list[StargateInfo]:
    """All modes list replicas sorted by id, then address (docs/control-plane.md)."""
    return sorted(entries, key=lambda e: (e.stargate_id, e.advertise_addr))


def dns_entries(ips: Iterable[str], *, config: PublisherConfig) -> list[StargateInfo]:
    """Entries for the IPs an A/AAAA lookup returned (docs/control-plane.md, WatchStargates).

    Each IP becomes `<ip>:<advertise port>`. The one equal to this replica's advertise address is
    the self entry (id and HTTP address); the others use the address as id and no HTTP address
    (docs/control-plane.md, WatchStargates). Loopback and unspecified IPs of others are skipped: a
    Pylon elsewhere cannot reach them. Self is always included, even when DNS does not list it yet
    (a pod's record can lag its start), so a Pylon watching this replica never loses it. IPv6 zone
    ids are dropped, since they mean nothing on another host; unparseable strings are ignored.
    """
    port = config.advertise_port
    entries = [config.self_entry]
    seen = {config.advertise_addr}
    for text in ips:
        try:
            ip = ipaddress.ip_address(text.strip().partition("%")[0])
        except ValueError:
            log.debug("ignoring unparseable DNS address %r", text)
            continue
        address = format_host_port(str(ip), port)
        if address in seen or ip.is_loopback or ip.is_unspecified:
            continue
        seen.add(address)
        entries.append(StargateInfo(stargate_id=address, advertise_addr=address))
    return _sorted_entries(entries)


def peer_entries(
    config: PublisherConfig, *, absent: AbstractSet[str] = frozenset()
) -> list[StargateInfo]:
    """Entries for the static `--peer` list, self included (see `_merge_peers` for the rules).

    Peers get no HTTP address (docs/control-plane.md, WatchStargates); a peer without an explicit id
    uses its address. Peers whose address is in `absent` (failing their health checks) are left out;
    self never is.
    """
    entries = [config.self_entry]
    for address, peer_id in _merge_peers(config).items():
        if address in absent:
            continue
        entries.append(StargateInfo(stargate_id=peer_id or address, advertise_addr=address))
    return _sorted_entries(entries)


def should_publish(
    previous: WatchSnapshot | None,
    snapshot: WatchSnapshot,
    *,
    since_last_ms: int | None,
    heartbeat_ms: int,
) -> bool:
    """Publish a new snapshot, or re-send an identical one when the heartbeat is due.

    `since_last_ms` is None before the first publication. A heartbeat of 0 publishes every poll.
    The heartbeat re-send matters: Pylons treat the stream as alive only while it talks.
    """
    if previous is None or since_last_ms is None or snapshot != previous:
        return True
    return since_last_ms >= heartbeat_ms


def next_tick(tick: int, *, elapsed_s: float, interval_s: float) -> int:
    """The poll tick to sleep until after finishing tick `tick`.

    Polls sit on a fixed grid (`origin + tick * interval`), so heartbeat arithmetic can count
    whole ticks instead of comparing jittery float times. If a poll overran (a slow lookup), the
    missed ticks are skipped and the latest due one runs at once: no burst of catch-up polls.
    """
    due = math.floor(elapsed_s / interval_s + 1e-9)
    return max(tick + 1, due)


# --------------------------------------------------------------------------------------------
# I/O


Resolver = Callable[[str], Awaitable[list[str]]]
"""Returns the IP addresses a name resolves to; raises OSError when the lookup fails."""


async def resolve_ips(name: str) -> list[str]:
    """A/AAAA lookup through the system resolver, unique IPs in resolver order.

    `trio.socket.getaddrinfo` runs the blocking call in a worker thread that is abandoned on
    cancellation, so the publisher's lookup timeout takes effect even if the OS call hangs.
    """
    infos = await trio.socket.getaddrinfo(name, None, type=trio.socket.SOCK_STREAM)
    ips: dict[str, None] = {}
    for *_, sockaddr in infos:
        host = sockaddr[0]
        if isinstance(host, str):
            ips.setdefault(host, None)
    return list(ips)


class WatchPublisher:
    """Polls discovery and publishes `WatchSnapshot`s to every `WatchStargates` stream.

    Latest-value channel: the publisher keeps one current snapshot and a version number; each
    publication swaps in a fresh `trio.Event` and sets the old one, waking every subscriber.
    Subscribers remember the version they last delivered, so a slow one skips intermediate
    values but always gets the latest, memory does not grow with slow readers, and no task is
    spawned per subscriber. Run it as a critical task; `stop()` (at shutdown) ends `run()` and
    every subscription, which ends the gRPC streams with OK.
    """

    def __init__(
        self,
        config: PublisherConfig,
        resolver: Resolver = resolve_ips,
        *,
        resolve_timeout_ms: int = DEFAULT_RESOLVE_TIMEOUT_MS,
        peer_checker: PeerChecker = grpc_health_check,
        peer_check_timeout_ms: int = DEFAULT_PEER_CHECK_TIMEOUT_MS,
    ) -> None:
        if resolve_timeout_ms <= 0:
            raise ValueError("DNS resolve timeout must be greater than 0")
        self._config = config
        self._peer_health: PeerHealthMonitor | None = None
        if config.mode is DiscoveryMode.PEERS and config.discovery.peer_absent_after_ms > 0:
            self._peer_health = PeerHealthMonitor(
                _merge_peers(config),
                absent_after_ms=config.discovery.peer_absent_after_ms,
                interval_ms=config.discovery.dns_poll_ms,
                checker=peer_checker,
                check_timeout_ms=peer_check_timeout_ms,
            )
        self._resolver = resolver
        self._resolve_timeout_s = resolve_timeout_ms / 1000
        self._remote_urls = normalize_remote_urls(
            config.discovery.remote_stargate_urls,
            self_addresses=(config.advertise_addr,),
            dns_name=config.discovery.dns_name,
        )
        self._snapshot: WatchSnapshot | None = None
        self._version = 0
        self._changed = trio.Event()
        self._stopped = False
        self._leaving = False
        self._ran = False
        self._run_scope: trio.CancelScope | None = None
        self._dns_failing = False

    @property
    def config(self) -> PublisherConfig:
        return self._config

    @property
    def remote_urls(self) -> tuple[str, ...]:
        """The normalised `watch_stargate_urls` every snapshot carries."""
        return self._remote_urls

    @property
    def version(self) -> int:
        """Number of publications so far (heartbeat re-sends included)."""
        return self._version

    @property
    def stopped(self) -> bool:
        return self._stopped

    def current(self) -> WatchSnapshot | None:
        """The latest published snapshot; None before the first discovery result."""
        return self._snapshot

    @property
    def peer_health(self) -> PeerHealthMonitor | None:
        """The static peers' health checks; None unless `peer_absent_after_ms` > 0 with peers."""
        return self._peer_health

    def subscribe(self) -> WatchSubscription:
        """A new subscription: `async for snapshot in publisher.subscribe(): ...`.

        A plain method returning an iterator object (not an async generator), so a consumer that
        stops iterating leaves nothing to finalize.
        """
        return WatchSubscription(self)

    def leave(self) -> None:
        """Stop announcing this replica: from now on every snapshot omits it (the leave phase of
        a shutdown, docs/rolling-restarts.md), so no Pylon starts a registration with a replica
        that is about to go. Streams stay open and keep receiving publications. Idempotent."""
        if self._leaving or self._stopped:
            return
        self._leaving = True
        if self._snapshot is not None:
            self._publish(self._announced(self._snapshot))

    def _announced(self, snapshot: WatchSnapshot) -> WatchSnapshot:
        if not self._leaving:
            return snapshot
        own = self._config.advertise_addr
        others = tuple(info for info in snapshot.stargates if info.advertise_addr != own)
        return replace(snapshot, stargates=others)

    def stop(self) -> None:
        """End `run()` and every subscription. Idempotent; safe before `run()` starts."""
        if self._stopped:
            return
        self._stopped = True
        if self._run_scope is not None:
            self._run_scope.cancel()
        self._changed.set()

    async def poll(self) -> WatchSnapshot:
        """One discovery round, without publishing."""
        config = self._config
        if config.mode is DiscoveryMode.PEERS:
            health = self._peer_health
            entries = peer_entries(
                config, absent=frozenset() if health is None else health.absent()
            )
        elif config.mode is DiscoveryMode.DNS:
            entries = await self._dns_round()
        else:
            entries = [config.self_entry]
        snapshot = build_snapshot(
            entries,
            remote_urls=self._remote_urls,
            grpc_pylon_dial_addr=config.discovery.grpc_pylon_dial_addr,
        )
        return self._announced(snapshot)

    async def _dns_round(self) -> list[StargateInfo]:
        """Resolve the discovery name; on failure publish self only (docs/control-plane.md).

        Falling back to self only (rather than keeping the last good list) is the Rust behaviour:
        Pylons watching only this replica then drop the other peers until DNS recovers. The
        WARNING is logged once per failure streak so a DNS outage does not flood the log.
        """
        config = self._config
        assert config.discovery.dns_name is not None
        try:
            with trio.fail_after(self._resolve_timeout_s):
                ips = await self._resolver(config.discovery.dns_name)
        except (OSError, trio.TooSlowError) as exc:
            if not self._dns_failing:
                self._dns_failing = True
                reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
                log.warning(
                    "DNS lookup of %r failed (%s); publishing only this replica until it succeeds",
                    config.discovery.dns_name,
                    reason,
                )
            return [config.self_entry]
        entries = dns_entries(ips, config=config)
        if self._dns_failing:
            self._dns_failing = False
            log.info(
                "DNS lookup of %r succeeded again; publishing %d replica(s)",
                config.discovery.dns_name,
                len(entries),
            )
        return entries

    def _publish(self, snapshot: WatchSnapshot) -> None:
        self._snapshot = snapshot
        self._version += 1
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    def _log_mode(self) -> None:
        config = self._config
        if config.mode is DiscoveryMode.DNS:
            log.info(
                "WatchStargates discovery: DNS name %r polled every %d ms",
                config.discovery.dns_name,
                config.discovery.dns_poll_ms,
            )
        elif config.mode is DiscoveryMode.PEERS:
            peers = len(_merge_peers(config))  # this replica, if listed, is not a peer
            if self._peer_health is not None:
                log.info(
                    "WatchStargates discovery: %d static peer(s), health-checked every %d ms, "
                    "left out after %d ms without an answer",
                    peers,
                    config.discovery.dns_poll_ms,
                    config.discovery.peer_absent_after_ms,
                )
            else:
                log.info("WatchStargates discovery: %d static peer(s)", peers)
        elif config.implicit_self_only:
            log.warning(
                "WatchStargates publishes only this replica: neither "
                "--stargate-discovery-dns-name nor --peer is set (pass --disable-dns-discovery "
                "if that is intended)"
            )
        else:
            log.info("WatchStargates discovery disabled; publishing only this replica")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll and publish until `stop()` or cancellation.

        The first poll runs immediately and `task_status.started()` is called after the first
        publication, so `await nursery.start(publisher.run)` returns with `current()` set and the
        first message every stream sends is a real discovery result (docs/control-plane.md,
        WatchStargates). Later polls run every `dns_poll_ms`; a snapshot is published when it
        changed or when `watch_heartbeat_ms` has passed since the last publication (measured in
        whole poll ticks). Static peers' health checks, when enabled, run alongside; each poll reads
        which peers are absent.
        """
        if self._ran:
            raise RuntimeError("a WatchPublisher can run only once")
        self._ran = True
        if self._stopped:
            task_status.started()
            return
        self._log_mode()
        config = self._config
        interval_s = config.discovery.dns_poll_ms / 1000
        started = False
        try:
            with trio.CancelScope() as scope:
                self._run_scope = scope
                async with trio.open_nursery() as nursery:
                    if self._peer_health is not None:
                        nursery.start_soon(self._peer_health.run)
                    origin = trio.current_time()
                    tick = 0
                    published_tick: int | None = None
                    while True:
                        snapshot = await self.poll()
                        since = None if published_tick is None else (tick - published_tick)
                        if should_publish(
                            self._snapshot,
                            snapshot,
                            since_last_ms=None
                            if since is None
                            else since * config.discovery.dns_poll_ms,
                            heartbeat_ms=config.discovery.watch_heartbeat_ms,
                        ):
                            self._publish(snapshot)
                            published_tick = tick
                        if not started:
                            started = True
                            task_status.started()
                        tick = next_tick(
                            tick, elapsed_s=trio.current_time() - origin, interval_s=interval_s
                        )
                        await trio.sleep_until(origin + tick * interval_s)
        finally:
            self._run_scope = None
            self._stopped = True
            self._changed.set()
        if not started:  # stopped during the first poll: let nursery.start() return
            task_status.started()


class WatchSubscription(AsyncIterator[WatchSnapshot]):
    """One stream's view of a `WatchPublisher`, with latest-value semantics.

    On creation it decides where to start: if the publisher already has a non-empty snapshot, the
    first `__anext__` returns it at once; otherwise the first value is the next publication.
    Afterwards each call returns the newest publication not yet delivered, waiting if there is
    none; identical heartbeat re-sends count as new. Iteration ends when the publisher stops.
    Use one task per subscription (concurrent `__anext__` calls on one object are not supported).
    """

    def __init__(self, publisher: WatchPublisher) -> None:
        self._publisher = publisher
        current = publisher.current()
        has_initial = current is not None and not current.is_empty
        self._delivered = publisher.version - 1 if has_initial else publisher.version

    def __aiter__(self) -> WatchSubscription:
        return self

    async def __anext__(self) -> WatchSnapshot:
        publisher = self._publisher
        await trio.lowlevel.checkpoint()
        while True:
            if publisher.stopped:
                raise StopAsyncIteration
            snapshot = publisher.current()
            if snapshot is not None and publisher.version > self._delivered:
                self._delivered = publisher.version
                return snapshot
            await publisher._changed.wait()


# --------------------------------------------------------------------------------------------
# This replica's publisher, from its serve config


def host_address() -> str:
    """This host's primary address, for advertising when the listener binds every interface."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def publisher_config(config: ServeConfig, *, grpc_port: int, http_port: int) -> PublisherConfig:
    """The publisher's config for this replica, with the ports its listeners actually bound.

    The advertise address is `--advertise-addr`, else the gRPC listener's host with its bound
    port; a listener on every interface (`0.0.0.0`, `::`) advertises this host's primary address
    instead, which peers and Pylons can dial. The HTTP address advertised beside it is the same
    host with the HTTP listener's port."""
    advertise = config.advertise_addr
    if advertise is None:
        host = config.listen_addr.host
        if ipaddress.ip_address(host).is_unspecified:
            host = host_address()
        advertise = ListenAddress(host, grpc_port)
    return PublisherConfig(
        stargate_id=config.stargate_id,
        advertise_addr=str(advertise),
        http_advertise_addr=str(ListenAddress(advertise.host, http_port)),
        discovery=config.discovery,
    )


def replica_publisher(config: ServeConfig, *, grpc_port: int, http_port: int) -> WatchPublisher:
    """This replica's `WatchStargates` publisher, built once its listeners are bound; discovery
    settings that do not hold together fail start-up (`StartupError`)."""
    try:
        return WatchPublisher(publisher_config(config, grpc_port=grpc_port, http_port=http_port))
    except ConfigError as error:
        raise StartupError(f"invalid discovery configuration: {error}") from error
