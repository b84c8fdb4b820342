"""A process's connection pools, kept up and closed as one (`ConnectionPools`).

A pool never polls its idle connections: a request skips one past `idle_expiry` when it reaches
it, and an origin that gets no more requests would keep its idle connections (in CLOSE_WAIT once
the server gives up on them) and its origin state until the process exits. So something has to
call `ConnectionPool.close_expired` every so often (`expire_idle`), and, for pools whose origins
are backends, `ConnectionPool.close_idle_except` when backends leave (`close_idle_except`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NoReturn

import trio

from stargate.upstream.connection_pool import ConnectionPool

__all__ = ["ConnectionPools"]


class ConnectionPools:
    """The connection pools of one process.

    The `backends` pools reach backends by their registered URL, so the idle connections of a
    backend that left can be closed in each at once (`close_idle_except`). A pool `add`ed later
    reaches something else (the owner relay's, other replicas): its idle connections only expire,
    and it closes with the others.
    """

    def __init__(self, *backends: ConnectionPool) -> None:
        self._backends = backends
        self._others: list[ConnectionPool] = []

    def add(self, pool: ConnectionPool) -> None:
        """Keep up and close `pool` with the others, from the next round of `expire_idle` on."""
        self._others.append(pool)

    async def expire_idle(self, interval: float) -> NoReturn:
        """Every `interval` seconds, close each pool's idle connections past their expiry, so an
        origin that gets no more traffic does not keep sockets open until shutdown. Runs until
        cancelled."""
        while True:
            await trio.sleep(interval)
            for pool in (*self._backends, *self._others):
                pool.close_expired()

    def close_idle_except(self, urls: Iterable[str]) -> None:
        """Close, in every backend pool, the idle connections of backends none of `urls` (the
        live backends' URLs) belongs to; connections still carrying a stream finish first."""
        live = set(urls)
        for pool in self._backends:
            pool.close_idle_except(live)

    async def aclose(self) -> None:
        """Close every pool (`ConnectionPool.aclose`)."""
        for pool in (*self._backends, *self._others):
            await pool.aclose()
