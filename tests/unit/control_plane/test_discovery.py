"""Discovery rules and the `WatchStargates` publisher.

Publisher tests run on `autojump_clock` (virtual time that jumps whenever every task is blocked)
with an in-memory resolver and peer checker, so poll, heartbeat and peer-absence timing is exact
and no test touches DNS or sleeps for real. Only `test_real_resolver_resolves_localhost` uses
the system resolver; the static peers end to end, with real replicas, are in
tests/e2e/test_discovery.py.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from stargate.config import DiscoveryConfig
from stargate.control_plane.discovery import (
    DiscoveryMode,
    PublisherConfig,
    StargateInfo,
    WatchPublisher,
    WatchSnapshot,
    WatchSubscription,
    build_snapshot,
    dns_entries,
    next_tick,
    normalize_remote_urls,
    parse_peer,
    peer_entries,
    resolve_ips,
    should_publish,
)
from stargate.control_plane.peer_health import PeerHealthMonitor, PeerStatus, next_status

SELF_IP = "10.0.0.1"
SELF = f"{SELF_IP}:50071"
SELF_HTTP = f"{SELF_IP}:8000"
DNS_NAME = "stargate-headless.llm.svc.cluster.local"
LOGGER = "stargate.control_plane.discovery"


def make_config(**overrides: Any) -> PublisherConfig:
    settings: dict[str, Any] = {
        "stargate_id": "sg-0",
        "advertise_addr": SELF,
        "http_advertise_addr": SELF_HTTP,
        "dns_name": DNS_NAME,
        "dns_poll_ms": 1000,
        "watch_heartbeat_ms": 60_000,
    }
    settings.update(overrides)
    own = {
        key: settings.pop(key) for key in ("stargate_id", "advertise_addr", "http_advertise_addr")
    }
    return PublisherConfig(**own, discovery=DiscoveryConfig(**settings))


def ids(snapshot: WatchSnapshot | None) -> list[str]:
    assert snapshot is not None
    return [entry.stargate_id for entry in snapshot.stargates]


@dataclass
class FakeResolver:
    """In-memory A/AAAA answers; set `error` or `hang` to simulate an outage."""

    ips: list[str] = field(default_factory=lambda: [SELF_IP])
    error: OSError | None = None
    hang: bool = False
    names: list[str] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.names)

    async def __call__(self, name: str) -> list[str]:
        self.names.append(name)
        await trio.lowlevel.checkpoint()
        if self.hang:
            await trio.sleep_forever()
        if self.error is not None:
            raise self.error
        return list(self.ips)


async def collect(
    subscription: WatchSubscription,
    into: list[tuple[float, WatchSnapshot]],
    delay: float = 0.0,
) -> None:
    """Record (virtual time, snapshot) for each delivery; `delay` makes a slow reader."""
    async for snapshot in subscription:
        into.append((trio.current_time(), snapshot))
        if delay:
            await trio.sleep(delay)


def times(received: list[tuple[float, WatchSnapshot]]) -> list[float]:
    return [round(at, 6) for at, _ in received]


# --------------------------------------------------------------------------------------------
# Snapshot building


def test_build_snapshot_dedupes_by_address_and_named_entries_win() -> None:
    entries = [
        StargateInfo("", "10.0.0.2:50071"),
        StargateInfo("first", "10.0.0.2:50071"),
        StargateInfo("", "10.0.0.2:50071"),  # an anonymous entry never replaces a named one
        StargateInfo("later", "10.0.0.2:50071"),  # a later named entry wins
        StargateInfo("", "10.0.0.3:50071"),
        StargateInfo("", "10.0.0.3:50071", http_advertise_addr="ignored"),  # first anonymous kept
    ]
    snapshot = build_snapshot(entries, remote_urls=(), grpc_pylon_dial_addr=None)
    assert snapshot.stargates == (
        StargateInfo("", "10.0.0.3:50071"),
        StargateInfo("later", "10.0.0.2:50071"),
    )


def test_build_snapshot_sorts_by_id_or_address_and_collapses_shared_ids() -> None:
    entries = [
        StargateInfo("sg-b", "10.0.0.9:50071"),
        StargateInfo("sg-a", "10.0.0.8:50071"),
        StargateInfo("", "10.0.0.5:50071"),
        StargateInfo("sg-a", "10.0.0.7:50071"),  # same id, smaller address: loses
    ]
    snapshot = build_snapshot(entries, remote_urls=("r:1",), grpc_pylon_dial_addr=None)
    assert [(e.stargate_id, e.advertise_addr) for e in snapshot.stargates] == [
        ("", "10.0.0.5:50071"),  # keyed by its address, which sorts before "sg-"
        ("sg-a", "10.0.0.8:50071"),
        ("sg-b", "10.0.0.9:50071"),
    ]
    assert snapshot.watch_stargate_urls == ("r:1",)
    shuffled = build_snapshot(reversed(entries), remote_urls=("r:1",), grpc_pylon_dial_addr=None)
    assert shuffled == snapshot


@pytest.mark.parametrize(("dial", "expected"), [("lb.example:443", "lb.example:443"), (None, "")])
def test_build_snapshot_overwrites_grpc_pylon_dial_addr(dial: str | None, expected: str) -> None:
    entries = [StargateInfo("a", "10.0.0.2:1"), StargateInfo("b", "10.0.0.3:1", "", "")]
    snapshot = build_snapshot(entries, remote_urls=(), grpc_pylon_dial_addr=dial)
    assert [e.grpc_pylon_dial_addr for e in snapshot.stargates] == [expected, expected]


def test_snapshot_is_empty_only_without_stargates_and_urls() -> None:
    assert WatchSnapshot().is_empty
    assert not WatchSnapshot(watch_stargate_urls=("r:1",)).is_empty
    assert not WatchSnapshot(stargates=(StargateInfo("a", "10.0.0.2:1"),)).is_empty


# --------------------------------------------------------------------------------------------
# DNS and peer entries


def test_dns_entries_self_gets_id_and_http_others_use_their_address() -> None:
    config = make_config()
    entries = dns_entries(
        ["10.0.0.3", SELF_IP, "10.0.0.2", "10.0.0.2", "fd00::7%eth0", "not-an-ip"],
        config=config,
    )
    assert entries == [
        StargateInfo("10.0.0.2:50071", "10.0.0.2:50071"),
        StargateInfo("10.0.0.3:50071", "10.0.0.3:50071"),
        StargateInfo("[fd00::7]:50071", "[fd00::7]:50071"),
        StargateInfo("sg-0", SELF, SELF_HTTP),
    ]


def test_dns_entries_skip_foreign_loopback_and_unspecified_but_keep_self() -> None:
    config = make_config(advertise_addr="127.0.0.1:50071", http_advertise_addr="127.0.0.1:8000")
    entries = dns_entries(["127.0.0.1", "127.0.0.2", "::1", "0.0.0.0", "::"], config=config)
    assert entries == [StargateInfo("sg-0", "127.0.0.1:50071", "127.0.0.1:8000")]


def test_dns_entries_always_include_self() -> None:
    config = make_config()
    assert dns_entries([], config=config) == [config.self_entry]
    assert [e.stargate_id for e in dns_entries(["10.0.0.2"], config=config)] == [
        "10.0.0.2:50071",
        "sg-0",
    ]


def test_dns_entries_match_self_in_ipv6_canonical_form() -> None:
    config = make_config(advertise_addr="[fd00:0::0001]:50071", http_advertise_addr="")
    assert config.advertise_addr == "[fd00::1]:50071"
    assert dns_entries(["fd00::1"], config=config) == [StargateInfo("sg-0", "[fd00::1]:50071")]


def test_peer_entries_include_self_and_fold_self_references() -> None:
    config = make_config(
        dns_name=None,
        peers=(
            "10.0.0.3:50071",
            " sg-2 = 10.0.0.2:50071 ",
            "10.0.0.2:50071",  # same peer without id: the named spelling wins
            "sg-0=stargate-0.local:50071",  # this replica by id (shared peer list)
            SELF,  # this replica by address
            "Stargate-4.Example:50071",
            "10.0.0.3:50071",  # exact repeat
        ),
    )
    assert peer_entries(config) == [
        StargateInfo("10.0.0.3:50071", "10.0.0.3:50071"),
        StargateInfo("sg-0", SELF, SELF_HTTP),
        StargateInfo("sg-2", "10.0.0.2:50071"),
        StargateInfo("stargate-4.example:50071", "stargate-4.example:50071"),
    ]


def test_parse_peer() -> None:
    assert parse_peer("10.0.0.2:50071") == ("", "10.0.0.2:50071")
    assert parse_peer("a=[FD00::2]:1") == ("a", "[fd00::2]:1")
    assert parse_peer("a=b=host.example:7") == ("a=b", "host.example:7")


# --------------------------------------------------------------------------------------------
# Remote watch URLs


def test_remote_urls_are_trimmed_split_deduped_and_sorted() -> None:
    urls = normalize_remote_urls(
        [
            " b.region-b.example:50071 , ,a.region-b.example:50071",
            "",
            "http://B.region-b.example:50071/",  # same host:port as the first: dropped
            "https://c.example",
            "c.example:443",  # https default port: a duplicate
            "[fd00::0009]:50071",
            "[fd00::9]:50071",
        ],
        self_addresses=[SELF],
        dns_name=None,
    )
    assert urls == (
        "[fd00::0009]:50071",
        "a.region-b.example:50071",
        "b.region-b.example:50071",
        "https://c.example",
    )


def test_remote_urls_drop_this_replica_including_the_headless_variant() -> None:
    urls = normalize_remote_urls(
        [
            SELF,
            f"http://{SELF}",
            f"{DNS_NAME}:50071",
            "stargate.llm.svc.cluster.local:50071",  # `-headless.` -> `.` (docs/control-plane.md)
            "STARGATE.llm.svc.cluster.local.:9999",  # any port, case, trailing dot
            "stargate.other.svc.cluster.local:50071",
            "10.0.0.2:50071",
        ],
        self_addresses=[SELF],
        dns_name=DNS_NAME,
    )
    assert urls == ("10.0.0.2:50071", "stargate.other.svc.cluster.local:50071")


def test_publisher_normalises_remote_urls_from_config() -> None:
    config = make_config(
        remote_stargate_urls=(f"z:1, {SELF}", "y:2", "stargate.llm.svc.cluster.local:1")
    )
    assert WatchPublisher(config, FakeResolver()).remote_urls == ("y:2", "z:1")


# --------------------------------------------------------------------------------------------
# Pure publishing rules


def test_should_publish() -> None:
    a = WatchSnapshot(watch_stargate_urls=("a:1",))
    b = WatchSnapshot(watch_stargate_urls=("b:1",))
    assert should_publish(None, a, since_last_ms=None, heartbeat_ms=5000)
    assert should_publish(a, b, since_last_ms=0, heartbeat_ms=5000)
    assert not should_publish(a, a, since_last_ms=4000, heartbeat_ms=5000)
    assert should_publish(a, a, since_last_ms=5000, heartbeat_ms=5000)
    assert should_publish(a, a, since_last_ms=0, heartbeat_ms=0)


def test_next_tick_stays_on_the_grid_and_skips_missed_ticks() -> None:
    assert next_tick(0, elapsed_s=0.0, interval_s=1.0) == 1
    assert next_tick(3, elapsed_s=3.0000001, interval_s=1.0) == 4
    assert next_tick(3, elapsed_s=0.3 * 3, interval_s=0.3) == 4  # float noise
    assert next_tick(0, elapsed_s=2.5, interval_s=1.0) == 2  # overran: run the latest due tick


# --------------------------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dns_poll_ms": 0}, "greater than 0"),
        ({"watch_heartbeat_ms": -1}, "must not be negative"),
        ({"stargate_id": " "}, "stargate id"),
        ({"advertise_addr": "stargate-0:50071"}, "not an IP address"),
        ({"advertise_addr": "10.0.0.1:0"}, "port 0"),
        ({"http_advertise_addr": "10.0.0.1"}, "HTTP advertise address"),
        ({"dns_name": "stargate-headless:50071"}, "not a host name"),
        ({"peers": ("10.0.0.2:1",), "disable_dns_discovery": True, "dns_name": None}, "cannot"),
        ({"peers": ("10.0.0.2:1",)}, "--stargate-discovery-dns-name"),
        ({"peers": ("10.0.0.2",), "dns_name": None}, "HOST:PORT"),
        ({"peers": ("10.0.0.2:1,10.0.0.3:1",), "dns_name": None}, "once per peer"),
        ({"peers": ("=10.0.0.2:1",), "dns_name": None}, "must not be empty"),
        ({"peers": ("fd00::1:50071",), "dns_name": None}, "brackets"),
        ({"peers": ("10.0.0.2:70000",), "dns_name": None}, "port"),
        ({"peers": ("a=10.0.0.2:1", "b=10.0.0.2:1"), "dns_name": None}, "listed with ids"),
        ({"peers": ("a=10.0.0.2:1", "a=10.0.0.3:1"), "dns_name": None}, "peer id 'a'"),
        ({"peers": (f"sg-9={SELF}",), "dns_name": None}, "advertise address"),
    ],
)
def test_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_config_modes_and_canonical_values() -> None:
    dns = make_config(grpc_pylon_dial_addr="  ", remote_stargate_urls=["r:1"])
    assert dns.mode is DiscoveryMode.DNS
    assert dns.discovery.grpc_pylon_dial_addr is None
    assert dns.discovery.remote_stargate_urls == ("r:1",)
    disabled = make_config(disable_dns_discovery=True)
    assert disabled.mode is DiscoveryMode.SELF_ONLY
    assert disabled.discovery.dns_name == DNS_NAME  # still used to filter remote URLs
    assert not disabled.implicit_self_only
    nothing = make_config(dns_name="  ")
    assert nothing.discovery.dns_name is None
    assert nothing.mode is DiscoveryMode.SELF_ONLY
    assert nothing.implicit_self_only
    peers = make_config(dns_name=None, peers=["10.0.0.2:1"], grpc_pylon_dial_addr=" lb:1 ")
    assert peers.mode is DiscoveryMode.PEERS
    assert peers.discovery.grpc_pylon_dial_addr == "lb:1"


# --------------------------------------------------------------------------------------------
# Publisher


async def test_first_publication_happens_before_started(autojump_clock: MockClock) -> None:
    resolver = FakeResolver(ips=["10.0.0.2", SELF_IP])
    publisher = WatchPublisher(make_config(grpc_pylon_dial_addr="lb:50071"), resolver)
    assert publisher.current() is None
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        assert trio.current_time() == 0
        assert resolver.names == [DNS_NAME]
        snapshot = publisher.current()
        assert ids(snapshot) == ["10.0.0.2:50071", "sg-0"]
        assert snapshot is not None
        assert {e.grpc_pylon_dial_addr for e in snapshot.stargates} == {"lb:50071"}
        publisher.stop()


async def test_late_subscriber_gets_the_current_snapshot_at_once(
    autojump_clock: MockClock,
) -> None:
    publisher = WatchPublisher(make_config(), FakeResolver())
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        await trio.sleep(2.5)
        first = await publisher.subscribe().__anext__()
        assert trio.current_time() == 2.5
        assert first is publisher.current()
        publisher.stop()


async def test_early_subscriber_waits_for_the_first_discovery_result(
    autojump_clock: MockClock,
) -> None:
    resolver = FakeResolver(hang=True)  # first lookup times out after 1 s: self only
    publisher = WatchPublisher(make_config(), resolver)
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect, publisher.subscribe(), received)
        await nursery.start(publisher.run)
        await trio.sleep(0.1)
        publisher.stop()
    assert times(received) == [1.0]
    assert ids(received[0][1]) == ["sg-0"]


async def test_change_is_published_on_the_next_poll(autojump_clock: MockClock) -> None:
    resolver = FakeResolver()
    publisher = WatchPublisher(make_config(), resolver)
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        nursery.start_soon(collect, publisher.subscribe(), received)
        await trio.sleep(2.5)
        resolver.ips = [SELF_IP, "10.0.0.2"]
        await trio.sleep(2.0)
        publisher.stop()
    assert times(received) == [0.0, 3.0]
    assert ids(received[0][1]) == ["sg-0"]
    assert ids(received[1][1]) == ["10.0.0.2:50071", "sg-0"]
    assert resolver.calls == 5  # t = 0, 1, 2, 3, 4


async def test_leaving_publishes_at_once_without_self_and_keeps_streams_open(
    autojump_clock: MockClock,
) -> None:
    resolver = FakeResolver(ips=[SELF_IP, "10.0.0.2"])
    publisher = WatchPublisher(make_config(), resolver)
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        nursery.start_soon(collect, publisher.subscribe(), received)
        await trio.sleep(1.5)
        publisher.leave()
        publisher.leave()  # idempotent: no second publication
        await trio.lowlevel.checkpoint()
        assert ids(publisher.current()) == ["10.0.0.2:50071"]
        await trio.sleep(2.0)  # later polls still omit this replica (DNS still lists it)
        late = await publisher.subscribe().__anext__()
        publisher.stop()
    assert times(received) == [0.0, 1.5]
    assert ids(received[0][1]) == ["10.0.0.2:50071", "sg-0"]
    assert ids(received[1][1]) == ["10.0.0.2:50071"]
    assert ids(late) == ["10.0.0.2:50071"]


async def test_unchanged_snapshot_is_resent_only_at_heartbeat(autojump_clock: MockClock) -> None:
    publisher = WatchPublisher(make_config(watch_heartbeat_ms=3000), FakeResolver())
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        nursery.start_soon(collect, publisher.subscribe(), received)
        await trio.sleep(7.5)
        publisher.stop()
    assert times(received) == [0.0, 3.0, 6.0]
    assert len({snapshot for _, snapshot in received}) == 1  # identical, yet delivered again
    assert publisher.version == 3


async def test_heartbeat_is_checked_at_poll_ticks(autojump_clock: MockClock) -> None:
    publisher = WatchPublisher(make_config(watch_heartbeat_ms=2500), FakeResolver())
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        nursery.start_soon(collect, publisher.subscribe(), received)
        await trio.sleep(6.5)
        publisher.stop()
    assert times(received) == [0.0, 3.0, 6.0]


async def test_zero_heartbeat_publishes_every_poll(autojump_clock: MockClock) -> None:
    publisher = WatchPublisher(make_config(dns_poll_ms=250, watch_heartbeat_ms=0), FakeResolver())
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        nursery.start_soon(collect, publisher.subscribe(), received)
        await trio.sleep(1.1)
        publisher.stop()
    assert times(received) == [0.0, 0.25, 0.5, 0.75, 1.0]


async def test_slow_subscriber_skips_to_the_latest(autojump_clock: MockClock) -> None:
    class CountingResolver(FakeResolver):
        async def __call__(self, name: str) -> list[str]:
            self.ips = [SELF_IP, f"10.0.1.{self.calls}"]  # a new peer on every poll
            return await super().__call__(name)

    publisher = WatchPublisher(make_config(watch_heartbeat_ms=0), CountingResolver())
    fast: list[tuple[float, WatchSnapshot]] = []
    slow: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        nursery.start_soon(collect, publisher.subscribe(), fast)
        nursery.start_soon(collect, publisher.subscribe(), slow, 2.6)
        await trio.sleep(5.5)
        publisher.stop()
    assert times(fast) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert times(slow) == [0.0, 2.6, 5.2]
    # The slow reader got the t=0 value, then the latest at each wake-up (t=2 and t=5).
    assert [snapshot for _, snapshot in slow] == [fast[0][1], fast[2][1], fast[5][1]]


async def test_stop_ends_run_and_every_subscription(autojump_clock: MockClock) -> None:
    publisher = WatchPublisher(make_config(), FakeResolver())
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        nursery.start_soon(collect, publisher.subscribe(), received)
        nursery.start_soon(collect, publisher.subscribe(), received)
        await trio.sleep(2.5)
        publisher.stop()
    assert trio.current_time() == 2.5  # the nursery closed at once: run() and both readers ended
    assert times(received) == [0.0, 0.0]
    assert publisher.stopped
    assert [snapshot async for snapshot in publisher.subscribe()] == []
    publisher.stop()  # idempotent


async def test_stop_before_run_returns_at_once(autojump_clock: MockClock) -> None:
    resolver = FakeResolver()
    publisher = WatchPublisher(make_config(), resolver)
    publisher.stop()
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
    assert publisher.current() is None
    assert resolver.calls == 0
    with pytest.raises(RuntimeError, match="only once"):
        await publisher.run()


async def test_cancelled_run_ends_subscriptions(autojump_clock: MockClock) -> None:
    publisher = WatchPublisher(make_config(), FakeResolver())
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as outer:
        outer.start_soon(collect, publisher.subscribe(), received)
        async with trio.open_nursery() as inner:
            await inner.start(publisher.run)
            await trio.sleep(1.5)
            inner.cancel_scope.cancel()
    assert publisher.stopped
    assert times(received) == [0.0]


async def test_dns_failure_publishes_self_only_and_warns_once_per_streak(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    resolver = FakeResolver(ips=[SELF_IP, "10.0.0.2"])
    publisher = WatchPublisher(make_config(), resolver)
    received: list[tuple[float, WatchSnapshot]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        nursery.start_soon(collect, publisher.subscribe(), received)
        await trio.sleep(0.5)
        resolver.error = trio.socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        await trio.sleep(3.0)  # failures at t = 1, 2, 3
        resolver.error = None
        await trio.sleep(1.0)  # success at t = 4
        resolver.error = OSError("network unreachable")
        await trio.sleep(1.0)  # failure at t = 5
        publisher.stop()
    assert times(received) == [0.0, 1.0, 4.0, 5.0]
    assert [ids(snapshot) for _, snapshot in received] == [
        ["10.0.0.2:50071", "sg-0"],
        ["sg-0"],
        ["10.0.0.2:50071", "sg-0"],
        ["sg-0"],
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "Name or service not known" in warnings[0]
    assert "network unreachable" in warnings[1]
    assert any("succeeded again" in r.getMessage() for r in caplog.records)


async def test_dns_timeout_counts_as_failure(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = WatchPublisher(make_config(), FakeResolver(hang=True), resolve_timeout_ms=300)
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        assert trio.current_time() == pytest.approx(0.3)
        assert ids(publisher.current()) == ["sg-0"]
        publisher.stop()
    assert any("timed out" in r.getMessage() for r in caplog.records)


async def test_peer_mode_publishes_the_static_list_without_dns(
    autojump_clock: MockClock,
) -> None:
    resolver = FakeResolver()
    config = make_config(
        dns_name=None, peers=("sg-1=10.0.0.2:50071",), remote_stargate_urls=("r.example:1",)
    )
    publisher = WatchPublisher(config, resolver)
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        snapshot = publisher.current()
        assert snapshot is not None
        assert snapshot.stargates == (
            StargateInfo("sg-0", SELF, SELF_HTTP),
            StargateInfo("sg-1", "10.0.0.2:50071"),
        )
        assert snapshot.watch_stargate_urls == ("r.example:1",)
        publisher.stop()
    assert resolver.calls == 0


async def test_implicit_self_only_mode_warns_at_start(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = WatchPublisher(make_config(dns_name=None), FakeResolver())
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        assert ids(publisher.current()) == ["sg-0"]
        publisher.stop()
    assert any(
        r.levelno == logging.WARNING and "--disable-dns-discovery" in r.getMessage()
        for r in caplog.records
    )


async def test_real_resolver_resolves_localhost() -> None:
    ips = await resolve_ips("localhost")
    assert ips
    assert len(ips) == len(set(ips))
    assert {"127.0.0.1", "::1"} & set(ips)


# --------------------------------------------------------------------------------------------
# Static peers that can be absent

PEER_B = "10.0.0.2:50071"
PEER_C = "10.0.0.3:50071"


@dataclass
class FakeChecker:
    """Health checks answered from sets: `down` fail, `hang` never answer, `broken` raise."""

    down: set[str] = field(default_factory=set)
    hang: set[str] = field(default_factory=set)
    broken: set[str] = field(default_factory=set)
    calls: list[tuple[float, str]] = field(default_factory=list)

    async def __call__(self, address: str, seconds: float) -> bool:
        self.calls.append((trio.current_time(), address))
        await trio.lowlevel.checkpoint()
        if address in self.hang:
            await trio.sleep_forever()
        if address in self.broken:
            raise OSError("connection refused")
        return address not in self.down


def peer_config(**overrides: Any) -> PublisherConfig:
    settings: dict[str, Any] = {
        "dns_name": None,
        "peers": (f"sg-1={PEER_B}", PEER_C, f"sg-0={SELF}"),  # self is listed too, and folded
        "peer_absent_after_ms": 3000,
    }
    settings.update(overrides)
    return make_config(**settings)


def test_peer_status_becomes_absent_after_a_run_of_failures_and_present_on_a_success() -> None:
    status = PeerStatus()
    assert status.present
    status = next_status(status, ok=False, now=10.0, absent_after_s=3)
    assert status == PeerStatus(True, 10.0)  # the run starts at the first failed check
    status = next_status(status, ok=False, now=12.9, absent_after_s=3)
    assert status.present
    status = next_status(status, ok=False, now=13.0, absent_after_s=3)
    assert status == PeerStatus(False, 10.0)
    status = next_status(status, ok=False, now=100.0, absent_after_s=3)
    assert not status.present  # stays absent however long
    assert next_status(status, ok=True, now=101.0, absent_after_s=3) == PeerStatus()
    # A success in the middle of a run ends it: absence needs an unbroken run.
    interrupted = next_status(PeerStatus(True, 10.0), ok=True, now=12.0, absent_after_s=3)
    assert next_status(interrupted, ok=False, now=13.0, absent_after_s=3) == PeerStatus(True, 13.0)


def test_peer_monitor_logs_only_transitions(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stargate.control_plane.peer_health")
    monitor = PeerHealthMonitor(
        {PEER_B: "sg-1"}, absent_after_ms=1000, interval_ms=100, checker=FakeChecker()
    )
    for now in (0.0, 0.5, 1.0, 1.5):
        monitor.observe(PEER_B, ok=False, now=now)
    assert monitor.absent() == {PEER_B}
    monitor.observe(PEER_B, ok=True, now=2.0)
    monitor.observe(PEER_B, ok=True, now=2.5)
    assert monitor.absent() == frozenset()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(messages) == 2
    assert messages[0][0] == logging.WARNING and "sg-1 (10.0.0.2:50071)" in messages[0][1]
    assert messages[1][0] == logging.INFO and "answers again" in messages[1][1]


def test_peer_absence_config_validation() -> None:
    with pytest.raises(ValueError, match="--peer-absent-after-ms"):
        peer_config(peer_absent_after_ms=-1)
    assert make_config().discovery.peer_absent_after_ms == 0  # built in code: static means static
    assert WatchPublisher(make_config(peer_absent_after_ms=5000)).peer_health is None  # DNS mode


async def test_failing_peer_is_left_out_after_the_absent_period_and_back_on_success(
    autojump_clock: MockClock,
) -> None:
    checker = FakeChecker(down={PEER_B})
    publisher = WatchPublisher(peer_config(), FakeResolver(), peer_checker=checker)
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        start = trio.current_time()
        # Present at start, and through failures shorter than the absent period.
        assert ids(publisher.current()) == ["10.0.0.3:50071", "sg-0", "sg-1"]
        await trio.sleep(2.5)
        assert "sg-1" in ids(publisher.current())
        # First failure at 0 s, checks every poll (1 s): absent from the check at 3 s, published
        # at that poll or the next.
        await trio.sleep(2.0)
        assert ids(publisher.current()) == ["10.0.0.3:50071", "sg-0"]
        checker.down.clear()  # it answers again: listed from the next poll after the check
        await trio.sleep(2.0)
        assert ids(publisher.current()) == ["10.0.0.3:50071", "sg-0", "sg-1"]
        publisher.stop()
    assert {address for _, address in checker.calls} == {PEER_B, PEER_C}  # never self
    b_checks = [at - start for at, address in checker.calls if address == PEER_B]
    assert b_checks[:4] == [0.0, 1.0, 2.0, 3.0]  # one check per poll period


async def test_a_check_that_hangs_fails_at_its_timeout(autojump_clock: MockClock) -> None:
    checker = FakeChecker(hang={PEER_B})
    publisher = WatchPublisher(
        peer_config(), FakeResolver(), peer_checker=checker, peer_check_timeout_ms=1000
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        # Failures end at 1, 2, 3, 4 s (timeouts, back to back): absent at 4 s, not before.
        await trio.sleep(3.5)
        assert "sg-1" in ids(publisher.current())
        await trio.sleep(2.0)
        assert "sg-1" not in ids(publisher.current())
        assert "10.0.0.3:50071" in ids(publisher.current())  # others are checked meanwhile
        publisher.stop()


async def test_a_check_that_raises_is_a_failed_check_not_a_crash(autojump_clock: MockClock) -> None:
    checker = FakeChecker(broken={PEER_C})
    publisher = WatchPublisher(peer_config(), FakeResolver(), peer_checker=checker)
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        await trio.sleep(5)
        assert ids(publisher.current()) == ["sg-0", "sg-1"]
        publisher.stop()


async def test_zero_absent_period_never_checks(autojump_clock: MockClock) -> None:
    checker = FakeChecker(down={PEER_B, PEER_C})
    publisher = WatchPublisher(
        peer_config(peer_absent_after_ms=0), FakeResolver(), peer_checker=checker
    )
    assert publisher.peer_health is None
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        await trio.sleep(60)
        assert ids(publisher.current()) == ["10.0.0.3:50071", "sg-0", "sg-1"]
        publisher.stop()
    assert checker.calls == []
