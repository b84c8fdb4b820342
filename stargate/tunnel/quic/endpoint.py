"""UDP endpoints for `QuicConnection`: dialing (`connect`) and listening (`serve`).

A client connection gets a fresh UDP socket of the target's family, connected to the target (so
an ICMP "port unreachable" fails the dial at once instead of after the timeout). A server owns
one socket for all its connections and routes each datagram by its destination connection id,
as `aioquic.asyncio.server.QuicServer` does: an unknown id on a full-sized Initial packet starts
a new connection (with a configuration from the factory, so a reloaded TLS identity applies to
new connections only), a version we do not speak gets a Version Negotiation packet, anything
else unknown is dropped. A terminated connection's ids are forgotten.

Sockets are plain non-blocking sockets: the endpoint's task waits for readability with trio and
drains a batch, while writes happen synchronously from wherever `transmit` is called (a datagram
the kernel cannot take is dropped and recovered by QUIC, like any loss).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import trio
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported untyped
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
from aioquic.quic.connection import NetworkAddress
from aioquic.quic.packet import (
    QuicPacketType,
    QuicProtocolVersion,
    encode_quic_version_negotiation,
    pull_quic_header,
)

from .driver import QuicConnection
from .errors import ConnectFailed
from .flow import FlowQuic

__all__ = ["QuicServer", "connect", "serve"]

logger = logging.getLogger("stargate.tunnel")

MAX_UDP_PAYLOAD = 65_535
RECEIVE_BATCH = 64
"""Datagrams drained per wake-up before the touched connections transmit."""
SOCKET_BUFFER = 4 * 1024 * 1024
"""Requested SO_RCVBUF/SO_SNDBUF (the kernel caps it at its maximum)."""
CONNECTION_ID_LENGTH = 8
"""Our connection ids' length (aioquic's default), which the server needs to parse headers."""
SUPPORTED_VERSIONS = [QuicProtocolVersion.VERSION_1, QuicProtocolVersion.VERSION_2]


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


# Dialing.


async def connect(
    nursery: trio.Nursery,
    host: str,
    port: int,
    configuration: QuicConfiguration,
    *,
    timeout: float,  # noqa: ASYNC109 - bounds the dial only, and failing it is ConnectFailed
) -> QuicConnection:
    """Dial `host:port` and return the established connection, whose task (socket and timer)
    runs in `nursery` until the connection is terminated; cancelling `nursery` aborts it.

    Raises `ConnectFailed` when the name does not resolve, the peer refuses, the handshake fails
    (certificate, server name, ALPN) or nothing is established within `timeout` seconds; the
    half-made connection is then gone. Cancellation aborts the dial the same way.
    """
    if not configuration.is_client:
        raise ValueError("connect() needs a client configuration")
    target = f"{host}:{port}"
    connection: QuicConnection | None = None
    with trio.move_on_after(timeout):
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError as error:
            raise ConnectFailed(f"QUIC connection to {target} failed: {error}") from None
        family, _, _, _, addr = min(infos, key=lambda info: info[0] != socket.AF_INET)
        sock = _client_socket(family, addr, target)
        try:
            quic = FlowQuic(configuration=configuration)
            connection = QuicConnection(quic, send_datagram=_connected_sender(sock))
            quic.connect(addr, now=trio.current_time())
            await nursery.start(_run_client, connection, sock, addr)  # owns the socket from now
        except BaseException:
            sock.close()
            raise
        try:
            await connection.wait_established()
        except ConnectFailed as error:
            raise ConnectFailed(f"QUIC connection to {target} failed: {error}") from None
        finally:
            if not connection.is_open:
                connection.abort("dial failed")
        return connection
    if connection is not None:
        connection.abort("dial timed out")
    raise ConnectFailed(f"QUIC connection to {target} timed out after {timeout:g} s")


def _client_socket(family: int, addr: NetworkAddress, target: str) -> socket.socket:
    """A non-blocking UDP socket on an ephemeral port of `family`, connected to `addr`."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        _tune(sock)
        sock.bind(("::", 0) if family == socket.AF_INET6 else ("0.0.0.0", 0))
        sock.connect(addr)
    except OSError as error:
        sock.close()
        raise ConnectFailed(f"QUIC connection to {target} failed: {error}") from None
    return sock


def _connected_sender(sock: socket.socket) -> Callable[[bytes, NetworkAddress], None]:
    def send(data: bytes, addr: NetworkAddress) -> None:
        try:
            sock.send(data)  # only ever to the connected peer (no migration on a dial)
        except OSError as error:
            logger.debug("QUIC datagram to %s not sent: %s", addr, error)

    return send


async def _run_client(
    connection: QuicConnection,
    sock: socket.socket,
    addr: NetworkAddress,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_receive_connected, connection, sock, addr)
            connection.transmit()  # the first flight
            task_status.started()
            await connection.run()
            nursery.cancel_scope.cancel()
    finally:
        connection.abort("connection task ended")
        sock.close()


async def _receive_connected(
    connection: QuicConnection, sock: socket.socket, addr: NetworkAddress
) -> None:
    while True:
        await trio.lowlevel.wait_readable(sock)
        received = False
        for _ in range(RECEIVE_BATCH):
            try:
                data = sock.recv(MAX_UDP_PAYLOAD)
            except BlockingIOError:
                break
            except ConnectionRefusedError:
                if not connection.established:
                    connection.abort("connection refused")
                    return
                continue  # quinn ignores ICMP on an established connection, so do we
            except OSError as error:
                logger.debug("QUIC socket to %s: %s", addr, error)
                continue
            connection.receive_datagram(data, addr)
            received = True
        if received:
            connection.transmit()


# Listening.


class QuicServer:
    """A listening UDP endpoint and its connections (made by `serve`).

    Established connections go to `on_connection` (each call a task in the server's nursery), or
    else into a queue of `backlog` read with `connections()`; when that is full the new
    connection is closed ("server busy"). Initial packets beyond `max_connections` live
    connections are dropped.
    """

    def __init__(
        self,
        sock: socket.socket,
        configuration_factory: Callable[[], QuicConfiguration],
        *,
        on_connection: Callable[[QuicConnection], Awaitable[Any]] | None,
        backlog: int,
        max_connections: int,
    ) -> None:
        self._sock = sock
        self._factory = configuration_factory
        self._on_connection = on_connection
        self._max_connections = max_connections
        self._routes: dict[bytes, QuicConnection] = {}
        self._ids: dict[QuicConnection, set[bytes]] = {}
        self._established_send, self._established_receive = trio.open_memory_channel[
            QuicConnection
        ](backlog)
        self._nursery: trio.Nursery | None = None
        self.address: NetworkAddress = sock.getsockname()
        self.port: int = self.address[1]

    @classmethod
    async def serve(
        cls,
        host: str,
        port: int,
        configuration_factory: Callable[[], QuicConfiguration],
        on_connection: Callable[[QuicConnection], Awaitable[Any]] | None = None,
        *,
        task_status: trio.TaskStatus[QuicServer] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """`serve` as a task for `nursery.start`: started with the bound server, it listens
        until cancelled (then closes every connection, as `serve` does on exit)."""
        async with serve(host, port, configuration_factory, on_connection=on_connection) as server:
            task_status.started(server)
            await trio.sleep_forever()

    @property
    def connection_count(self) -> int:
        """Live connections (handshaking, open or closing)."""
        return len(self._ids)

    def connections(self) -> trio.MemoryReceiveChannel[QuicConnection]:
        """The established connections, in order (iteration ends when the server closes)."""
        if self._on_connection is not None:
            raise RuntimeError("this server hands its connections to on_connection")
        return self._established_receive

    # The endpoint task.

    async def _receive_loop(self) -> None:
        sock = self._sock
        while True:
            await trio.lowlevel.wait_readable(sock)
            touched: dict[QuicConnection, None] = {}
            for _ in range(RECEIVE_BATCH):
                try:
                    data, addr = sock.recvfrom(MAX_UDP_PAYLOAD)
                except BlockingIOError:
                    break
                except OSError as error:
                    logger.debug("QUIC server socket: %s", error)
                    continue
                connection = self._route(data, addr)
                if connection is not None:
                    connection.receive_datagram(data, addr)
                    touched[connection] = None
            for connection in touched:
                connection.transmit()

    def _send(self, data: bytes, addr: NetworkAddress) -> None:
        try:
            self._sock.sendto(data, addr)
        except OSError as error:
            logger.debug("QUIC datagram to %s not sent: %s", addr, error)

    def _route(self, data: bytes, addr: NetworkAddress) -> QuicConnection | None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CONNECTION_ID_LENGTH)
        except ValueError:
            return None
        # Never answer a Version Negotiation packet with another (a reflection loop).
        if (
            header.packet_type != QuicPacketType.VERSION_NEGOTIATION
            and header.version is not None
            and header.version not in SUPPORTED_VERSIONS
        ):
            self._send(
                encode_quic_version_negotiation(
                    source_cid=header.destination_cid,
                    destination_cid=header.source_cid,
                    supported_versions=list(SUPPORTED_VERSIONS),
                ),
                addr,
            )
            return None
        connection = self._routes.get(header.destination_cid)
        if (
            connection is None
            and header.packet_type == QuicPacketType.INITIAL
            and len(data) >= SMALLEST_MAX_DATAGRAM_SIZE
        ):
            connection = self._accept(header.destination_cid)
        return connection

    def _accept(self, original_cid: bytes) -> QuicConnection | None:
        if len(self._ids) >= self._max_connections or self._nursery is None:
            logger.debug("QUIC server at its connection limit; Initial packet dropped")
            return None
        try:
            configuration = self._factory()
        except Exception:
            logger.exception("QUIC server configuration failed; Initial packet dropped")
            return None
        if configuration.is_client:
            raise ValueError("the QUIC server's configuration factory made a client one")
        configuration.connection_id_length = CONNECTION_ID_LENGTH
        quic = FlowQuic(
            configuration=configuration, original_destination_connection_id=original_cid
        )
        connection = QuicConnection(quic, send_datagram=self._send)
        connection.on_established = self._established
        connection.on_terminated = self._forget
        connection.on_cid_issued = lambda cid: self._add_route(connection, cid)
        connection.on_cid_retired = lambda cid: self._drop_route(connection, cid)
        self._ids[connection] = set()
        self._add_route(connection, original_cid)
        self._add_route(connection, quic.host_cid)
        self._nursery.start_soon(self._connection_task, connection)
        return connection

    def _add_route(self, connection: QuicConnection, cid: bytes) -> None:
        ids = self._ids.get(connection)
        if ids is not None:
            ids.add(cid)
            self._routes[cid] = connection

    def _drop_route(self, connection: QuicConnection, cid: bytes) -> None:
        if self._routes.get(cid) is connection:
            del self._routes[cid]
        ids = self._ids.get(connection)
        if ids is not None:
            ids.discard(cid)

    def _forget(self, connection: QuicConnection) -> None:
        for cid in self._ids.pop(connection, ()):
            if self._routes.get(cid) is connection:
                del self._routes[cid]

    async def _connection_task(self, connection: QuicConnection) -> None:
        try:
            await connection.run()
        finally:
            self._forget(connection)

    def _established(self, connection: QuicConnection) -> None:
        if self._on_connection is not None:
            assert self._nursery is not None
            self._nursery.start_soon(self._on_connection, connection)
            return
        try:
            self._established_send.send_nowait(connection)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            logger.warning("QUIC server backlog full; closing a new connection")
            connection.close(0, "server busy")

    def _shutdown(self) -> None:
        for connection in list(self._ids):
            connection.close(0, "shutdown")
        self._established_send.close()


@asynccontextmanager
async def serve(
    host: str,
    port: int,
    configuration_factory: Callable[[], QuicConfiguration],
    *,
    on_connection: Callable[[QuicConnection], Awaitable[Any]] | None = None,
    backlog: int = 64,
    max_connections: int = 4096,
) -> AsyncIterator[QuicServer]:
    """Listen on UDP `host:port` (port 0: any; `server.port` tells which) for the body's
    duration. The factory is called once per new connection. On exit every connection is closed
    ("shutdown", code 0) and its task cancelled. An error of the body or of an `on_connection`
    task propagates (a single one as itself, several as an exception group).
    """
    infos = await trio.socket.getaddrinfo(
        host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        _tune(sock)
        sock.bind(addr)
        server = QuicServer(
            sock,
            configuration_factory,
            on_connection=on_connection,
            backlog=backlog,
            max_connections=max_connections,
        )
        try:
            async with trio.open_nursery() as nursery:
                server._nursery = nursery
                nursery.start_soon(server._receive_loop)
                try:
                    yield server
                finally:
                    server._shutdown()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    finally:
        sock.close()
