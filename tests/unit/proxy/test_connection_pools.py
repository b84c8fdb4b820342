"""The replica's connections to backends as its flags set them (`upstream_config`,
`upstream_ca_file`), and their upkeep as one (`ConnectionPools`: idle expiry on a clock, the idle
connections of departed backends, closing), on fake pools and virtual time."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import trio
from trio.testing import MockClock

from stargate.config import ProxyConfig
from stargate.upstream import ConnectionPool, ConnectionPools, upstream_ca_file, upstream_config


def test_the_proxy_flags_set_the_backend_connections() -> None:
    proxy = ProxyConfig(
        connect_timeout_ms=1_500,
        response_header_timeout_ms=4_000,
        max_connections_per_backend=7,
        upstream_ca_file=Path("/etc/ca.pem"),
    )
    config = upstream_config(proxy)
    assert (config.connect_timeout, config.response_head_timeout) == (1.5, 4.0)
    assert (config.max_connections_per_origin, config.ca_file) == (7, "/etc/ca.pem")
    assert upstream_ca_file(proxy) == "/etc/ca.pem"
    assert upstream_ca_file(ProxyConfig()) is None
    assert upstream_config(ProxyConfig()).ca_file is None


def test_a_user_that_bounds_heads_itself_replaces_the_head_timeout() -> None:
    relayed = upstream_config(ProxyConfig(connect_timeout_ms=2_000), response_head_timeout=math.inf)
    assert relayed.response_head_timeout == math.inf
    assert relayed.connect_timeout == 2.0


class _FakePool:
    """Records the upkeep asked of it."""

    def __init__(self) -> None:
        self.expired = 0
        self.kept: list[set[str]] = []
        self.closed = False

    def close_expired(self) -> int:
        self.expired += 1
        return 0

    def close_idle_except(self, urls: Iterable[str]) -> int:
        self.kept.append(set(urls))
        return 0

    async def aclose(self) -> None:
        self.closed = True


def _pools(*fakes: _FakePool) -> list[ConnectionPool]:
    return [cast(ConnectionPool, fake) for fake in fakes]


async def test_idle_connections_expire_in_every_pool_on_the_clock(
    autojump_clock: MockClock,
) -> None:
    """A pool added after the clock started (the owner relay's) joins the next round."""
    proxy, probes, relay = _FakePool(), _FakePool(), _FakePool()
    pools = ConnectionPools(*_pools(proxy, probes))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pools.expire_idle, 60.0)
        await trio.sleep(61)
        assert (proxy.expired, probes.expired) == (1, 1)
        pools.add(*_pools(relay))
        await trio.sleep(60)
        assert (proxy.expired, probes.expired, relay.expired) == (2, 2, 1)
        nursery.cancel_scope.cancel()


def test_only_the_backend_pools_lose_the_idle_connections_of_departed_backends() -> None:
    """The relay's origins are other replicas, not backends: no backend URL would keep them."""
    proxy, probes, relay = _FakePool(), _FakePool(), _FakePool()
    pools = ConnectionPools(*_pools(proxy, probes))
    pools.add(*_pools(relay))
    pools.close_idle_except(url for url in ["http://a:1", "http://b:2"])  # read once, for both
    assert proxy.kept == probes.kept == [{"http://a:1", "http://b:2"}]
    assert relay.kept == []


async def test_every_pool_closes_with_the_others() -> None:
    proxy, probes, relay = _FakePool(), _FakePool(), _FakePool()
    pools = ConnectionPools(*_pools(proxy, probes))
    pools.add(*_pools(relay))
    await pools.aclose()
    assert proxy.closed and probes.closed and relay.closed
