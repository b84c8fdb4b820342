"""The `process` member controller: one local engine process per pool, swapped on demand.

docs/decisions.md, D7: for single-machine model swapping a pool's members are engine commands (vLLM,
llama.cpp's server, ...) started and stopped on this host, and each running engine is registered in
the routing state directly, with no Pylon in between. A member is Ready exactly when its
registration holds an active route, so the activator waits for availability through the routing
state like for any other backend; this controller never reports availability itself.

Lifecycle of one member (an `_Engine`):

* `activate` stops every other member of the pool first (the slot holds one engine: on one GPU
  two engines would not fit), picks a free loopback port, starts the command and returns. It does
  not wait for health: a swap is bounded by the activator's deadline, not by this call.
* A supervisor task (in the nursery passed in, so the owner sees every task) polls the engine's
  health endpoint until it answers 2xx, then registers it; afterwards it keeps probing every
  `health_interval`, removing the route on a failed probe and restoring it on the next success.
  An engine that never becomes healthy within `startup_timeout` is stopped: leaving it running
  would hold the slot (and the GPU) with nothing routable.
* Stopping removes the routes *before* the SIGTERM, so no new request is routed to an engine that
  is shutting down; after `stop_grace` the supervisor sends SIGKILL. The escalation lives in the
  supervisor, not in the caller, so a `deactivate` cancelled by the activator's timeout still ends
  with the process gone.
* An engine that exits on its own is unregistered and forgotten (WARNING with its exit code); the
  next `activate` starts it again.

Each engine runs in its own session (so its own process group): signals go to the whole group,
which also reaches the workers a wrapper script or a multi-process engine spawns. An engine gets
SIGTERM from the kernel when the replica dies, however it dies
(stargate/activator/engine_process.py). stdin is /dev/null; stdout and stderr are inherited, so
engine logs land in the router's own output, which is where an operator of a single-machine setup
looks first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
import trio

from stargate.activator.engine_process import EngineProcess, spawn_engine
from stargate.health_probe import ProbeFailed, http_health_probe, httpx_get
from stargate.routing.state import (
    AlreadyRegistered,
    BackendRoute,
    Registration,
    RegistrationIdentity,
    RoutingState,
)
from stargate.routing.stats import ModelStats

__all__ = ["MemberCommand", "ProcessController"]

log = logging.getLogger(__name__)

PORT_PLACEHOLDER = "{port}"
STARTUP_POLL_SECONDS = 0.1  # how often a starting engine is probed (swap latency, not load)
REAP_AFTER_KILL_SECONDS = 5.0  # bound on waiting for a SIGKILLed process during abrupt shutdown
_NO_HEADERS: Mapping[str, str] = {}  # engine probes carry no routing headers


@dataclass(frozen=True, slots=True)
class MemberCommand:
    """How to run one member's engine.

    `command` is the argv; every occurrence of `{port}` in every argument is replaced by the port
    chosen at start (plain substitution, not `str.format`, so other braces such as JSON arguments
    pass through untouched). `health_path` is probed on `http://host:port` and must answer 2xx once
    the engine can serve.
    """

    command: tuple[str, ...]
    health_path: str = "/health"

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command:
            raise ValueError("a member command needs at least the program")
        if not self.health_path.startswith("/"):
            raise ValueError(f"health_path must start with '/': {self.health_path!r}")

    def argv(self, port: int) -> list[str]:
        return [arg.replace(PORT_PLACEHOLDER, str(port)) for arg in self.command]


class _Engine:
    """One started process of one member, from spawn until it has exited and been reaped."""

    __slots__ = (
        "healthy",
        "member",
        "port",
        "process",
        "registration",
        "routed",
        "stop_requested",
        "stopped",
        "term_sent",
        "url",
    )

    def __init__(self, member: str, port: int, url: str) -> None:
        self.member = member
        self.port = port
        self.url = url
        self.process: EngineProcess | None = None  # None only while the spawn is in progress
        self.registration: Registration | None = None
        self.healthy = False  # registered at least once (phase "Running")
        self.routed = False  # the registration holds an active route right now
        self.term_sent = False
        self.stop_requested = trio.Event()
        self.stopped = trio.Event()  # set once the process exited and its routes are gone

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()


class ProcessController:
    """A `MemberController` (with `phase`) that runs each member of one pool as a local process.

    `members` maps member (model id) to its `MemberCommand`. Every task runs in `nursery`, which
    the activator/runtime owns; call `aclose` before cancelling it for a graceful stop (cancelling
    it directly SIGKILLs whatever still runs).

    Concurrency: activations are serialized by a lock, which is what makes the slot exclusive (two
    concurrent activations of different members would otherwise both start). `deactivate` takes
    no lock: it stops the engine at once and only then waits, so it is never stuck behind an
    activation that is itself waiting for an incumbent to exit.
    """

    def __init__(
        self,
        pool_name: str,
        members: Mapping[str, MemberCommand],
        routing: RoutingState,
        nursery: trio.Nursery,
        *,
        health_client: httpx.AsyncClient,
        host: str = "127.0.0.1",
        stop_grace: float = 10.0,
        health_interval: float = 1.0,
        startup_timeout: float = 300.0,
        probe_timeout: float = 5.0,
    ) -> None:
        self.pool_name = pool_name
        self._members = dict(members)
        self._routing = routing
        self._nursery = nursery
        self._get = httpx_get(health_client)
        self._host = host
        self._stop_grace = stop_grace
        self._health_interval = health_interval
        self._startup_timeout = startup_timeout
        self._probe_timeout = probe_timeout
        self._engines: dict[str, _Engine] = {}
        self._activate_lock = trio.Lock()
        self._closed = False

    # ---- the MemberController protocol -----------------------------------------------------------

    async def activate(self, member: str) -> None:
        """Start `member`'s engine unless it is already starting or running (idempotent by check).

        Every other member of the pool is stopped and reaped first. Returns once the process is
        spawned; it becomes routable (Ready) later, when its health endpoint answers.
        """
        command = self._command(member)
        async with self._activate_lock:
            if self._closed:
                raise RuntimeError(f"process controller for pool {self.pool_name!r} is closed")
            current = self._engines.get(member)
            if current is not None and not current.stopping:
                return
            for engine in list(self._engines.values()):
                if engine.member != member:
                    log.info(
                        "stopping %s to make room for %s",
                        engine.member,
                        member,
                        extra={"pool": self.pool_name, "member": engine.member},
                    )
                    self._request_stop(engine)
            # Also waits for a same-member engine that a deactivate is still stopping.
            for engine in list(self._engines.values()):
                await engine.stopped.wait()
            await self._spawn(member, command)

    async def deactivate(self, member: str) -> None:
        """Unregister and stop `member`'s engine; a no-op when it is not running.

        The routes go and SIGTERM is sent before the first checkpoint, so a caller that times out
        while waiting has still stopped the engine; SIGKILL follows after `stop_grace` either way.
        """
        self._command(member)
        engine = self._engines.get(member)
        if engine is None:
            await trio.lowlevel.checkpoint()
            return
        self._request_stop(engine)
        await engine.stopped.wait()

    async def phase(self, member: str) -> str | None:
        """Phase: "Starting" (spawned, not yet healthy), "Running" (registered at least once),
        "Stopping" (signalled, not yet exited) or "Stopped". Diagnostic only."""
        await trio.lowlevel.checkpoint()
        if member not in self._members:
            return None
        engine = self._engines.get(member)
        if engine is None:
            return "Stopped"
        if engine.stopping:
            return "Stopping"
        return "Running" if engine.healthy else "Starting"

    # ---- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop every engine and wait until all have exited (graceful shutdown).

        Later activations raise; the nursery stays the caller's to cancel."""
        self._closed = True
        engines = list(self._engines.values())
        for engine in engines:
            self._request_stop(engine)
        for engine in engines:
            await engine.stopped.wait()

    # ---- diagnostics -----------------------------------------------------------------------------

    def pid(self, member: str) -> int | None:
        """The PID of `member`'s current process, if one is spawned."""
        engine = self._engines.get(member)
        if engine is None or engine.process is None:
            return None
        return engine.process.pid

    def url(self, member: str) -> str | None:
        """The base URL `member`'s current engine serves (and is registered) on."""
        engine = self._engines.get(member)
        return None if engine is None else engine.url

    def registration_id(self, member: str) -> str:
        return f"process:{self.pool_name}:{member}"

    # ---- internals -------------------------------------------------------------------------------

    def _command(self, member: str) -> MemberCommand:
        command = self._members.get(member)
        if command is None:
            raise ValueError(f"{member!r} is not a member of process pool {self.pool_name!r}")
        return command

    async def _spawn(self, member: str, command: MemberCommand) -> None:
        port = _free_port(self._host)
        engine = _Engine(member, port, f"http://{_url_host(self._host)}:{port}")
        argv = command.argv(port)
        # Recorded before the spawn's await: a concurrent deactivate finds it and marks it
        # stopping; the supervisor then signals the process as soon as it exists.
        self._engines[member] = engine
        log.info(
            "starting %s on port %d: %s",
            member,
            port,
            " ".join(argv),
            extra={"pool": self.pool_name, "member": member},
        )
        try:
            # Synchronous, so a spawned process is always recorded; it dies with the replica
            # (stargate/activator/engine_process.py).
            process = spawn_engine(argv)
        except BaseException:
            self._forget(engine)
            engine.stopped.set()
            raise
        engine.process = process
        if engine.stopping:
            self._signal(engine, signal.SIGTERM)
        self._nursery.start_soon(self._supervise, engine, command)

    async def _supervise(self, engine: _Engine, command: MemberCommand) -> None:
        """Own one process until it exits: health, registration, stop escalation, cleanup."""
        process = engine.process
        assert process is not None
        returncode: int | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._health_loop, engine, command)
                nursery.start_soon(self._escalate, engine)
                returncode = await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._unregister(engine)
            if returncode is None:
                # Cancelled (the owner's nursery is going away without aclose): no time for a
                # grace period. Kill the group and reap it, shielded and bounded.
                self._signal(engine, signal.SIGKILL)
                with trio.CancelScope(shield=True), trio.move_on_after(REAP_AFTER_KILL_SECONDS):
                    returncode = await process.wait()
            else:
                # Workers the leader left behind would keep the port (and the GPU) busy. The group
                # id cannot be reused while any of them lives; once the group is empty this is
                # ESRCH (reuse of the id within these microseconds is not a practical concern).
                self._signal_group(process.pid, signal.SIGKILL)
            if engine.stopping:
                log.info(
                    "%s stopped (exit code %s)",
                    engine.member,
                    returncode,
                    extra={"pool": self.pool_name, "member": engine.member},
                )
            else:
                log.warning(
                    "%s exited on its own with exit code %s; unregistered",
                    engine.member,
                    returncode,
                    extra={"pool": self.pool_name, "member": engine.member},
                )
                engine.stop_requested.set()
            self._forget(engine)
            engine.stopped.set()

    async def _escalate(self, engine: _Engine) -> None:
        """SIGTERM once a stop is requested (if not sent already), SIGKILL after the grace."""
        await engine.stop_requested.wait()
        self._signal(engine, signal.SIGTERM)
        await trio.sleep(self._stop_grace)
        log.warning(
            "%s ignored SIGTERM for %.1fs; sending SIGKILL",
            engine.member,
            self._stop_grace,
            extra={"pool": self.pool_name, "member": engine.member},
        )
        self._signal(engine, signal.SIGKILL)

    async def _health_loop(self, engine: _Engine, command: MemberCommand) -> None:
        """Wait for the first healthy answer, register, then follow health until stopped."""
        url = engine.url + command.health_path  # for the log line
        deadline = trio.current_time() + self._startup_timeout
        while True:
            remaining = deadline - trio.current_time()
            rtt_ns = await self._probe(
                engine.url, command.health_path, min(self._probe_timeout, max(remaining, 0.01))
            )
            if engine.stop_requested.is_set():
                return  # stopped while starting: an engine slow to exit must not register
            if rtt_ns is not None:
                break
            if trio.current_time() >= deadline:
                log.error(
                    "%s did not answer %s with 2xx within %.1fs; stopping it",
                    engine.member,
                    url,
                    self._startup_timeout,
                    extra={"pool": self.pool_name, "member": engine.member},
                )
                self._request_stop(engine)
                return
            await trio.sleep(min(STARTUP_POLL_SECONDS, self._health_interval, remaining))
        self._route(engine, rtt_ns)
        while not engine.stopping:
            await trio.sleep(self._health_interval)
            rtt_ns = await self._probe(engine.url, command.health_path, self._probe_timeout)
            if engine.stop_requested.is_set():
                return  # routes were removed with the stop request; never put them back
            self._route(engine, rtt_ns)

    async def _probe(self, base_url: str, health_path: str, limit: float) -> int | None:
        """One `GET base_url + health_path` within `limit` seconds: the round trip in ns on 2xx,
        else None (refused, timed out, non-2xx; a 404 too, there being no fallback path). Sent
        without the replica's probe headers, as an engine of our own needs none."""
        try:
            return await http_health_probe(
                self._get, base_url, limit, (health_path,), headers=_NO_HEADERS
            )
        except ProbeFailed:
            return None

    def _route(self, engine: _Engine, rtt_ns: int | None) -> None:
        """Publish the engine's health in the routing state (register on first success).

        A failed probe keeps the member advertised without a route, so requests for it get a 503
        rather than a 404 while it recovers."""
        if engine.stop_requested.is_set():
            return  # its routes went with the stop request and must stay gone
        if engine.registration is None:
            if rtt_ns is None:
                return
            identity = RegistrationIdentity(
                inference_server_id=self.registration_id(engine.member),
                cluster_id=self.registration_id(engine.member),
                url=engine.url,
                routing_key=None,
            )
            try:
                engine.registration = self._routing.begin(identity)
            except AlreadyRegistered:
                log.error(
                    "cannot register %s: %s is already registered by someone else",
                    engine.member,
                    identity.inference_server_id,
                    extra={"pool": self.pool_name, "member": engine.member},
                )
                return  # retried on the next probe
            engine.healthy = True
            log.info(
                "%s is healthy at %s; registered",
                engine.member,
                engine.url,
                extra={"pool": self.pool_name, "member": engine.member},
            )
        else:
            if rtt_ns is None and engine.routed:
                log.warning(
                    "%s failed its health check; route removed until it recovers",
                    engine.member,
                    extra={"pool": self.pool_name, "member": engine.member},
                )
            elif rtt_ns is not None and not engine.routed:
                log.info(
                    "%s is healthy again; route restored",
                    engine.member,
                    extra={"pool": self.pool_name, "member": engine.member},
                )
        route = None if rtt_ns is None else BackendRoute(ModelStats(), rtt_ns, trio.current_time())
        self._routing.apply(engine.registration, {engine.member: route})
        engine.routed = route is not None

    def _request_stop(self, engine: _Engine) -> None:
        """Synchronously: unregister, mark stopping, SIGTERM (if spawned). Idempotent."""
        self._unregister(engine)
        engine.stop_requested.set()
        if engine.process is not None:
            self._signal(engine, signal.SIGTERM)

    def _unregister(self, engine: _Engine) -> None:
        if engine.registration is not None:
            self._routing.end(engine.registration)
            engine.registration = None
        engine.routed = False

    def _forget(self, engine: _Engine) -> None:
        if self._engines.get(engine.member) is engine:
            del self._engines[engine.member]

    def _signal(self, engine: _Engine, sig: signal.Signals) -> None:
        """Signal the engine's process group while its leader is unreaped (so the id is ours)."""
        process = engine.process
        if process is None or process.returncode is not None:
            return
        if sig == signal.SIGTERM:
            if engine.term_sent:
                return
            engine.term_sent = True
        self._signal_group(process.pid, sig)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def _free_port(host: str) -> int:
    """A port free on `host` a moment ago. The engine binds it shortly after; another process
    could take it in between, in which case the engine fails and exits (and is unregistered)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
