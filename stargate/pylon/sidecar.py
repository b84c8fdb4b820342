"""The Pylon sidecar: one inference engine behind every Stargate replica, in the request path.

Task tree (`Pylon.run`): an outer nursery serves the listener (`listener.py`, `hop.py`: the
replicas' requests, forwarded to the engine and measured into `stats`); inside it, the control
nursery holds everything else, so a graceful stop (`Pylon.stop`) cancels the control nursery
first (every registration closes: the replicas stop routing here) and only then lets the listener
drain its requests in flight:

- the side channels (`collector.py`): the stale sweep, the engine stats stream, KV polling or
  the engine's metrics; with `--kv-events-endpoint`, the engine's KV events (`kv_events.py`)
  into the block set (`kv_blocks.py`) whose deltas every registration message carries;
- bring-up (`bringup.py`): a calibration per new model when `--do-calibration`, the canaries;
- a health loop probing the engine every heartbeat (`http_health_probe` semantics);
- with no explicit `--model-name`, a loop re-reading the engine's `GET /v1/models`;
- one watch task per WatchStargates key: the seeds and, recursively, every `watch_stargate_urls`
  entry announced by a kept snapshot. A watch's latest snapshot is kept under its key until a
  newer one replaces it, also while the watch reconnects: a stream ending (a replica killed,
  or a rolling restart ending every stream with OK) says nothing about the other replicas. When
  its own target fails, a watch tries the other known replicas in turn (`watch_candidates`) and
  keeps the answer under its key; on a fallback it returns to its own target once that target,
  seen down, accepts connections again;
- one registration task per replica listed by a kept snapshot, kept while its stream is up
  even when no snapshot lists it any more (a leaving replica): a `RegisterInferenceServer`
  stream that sends the full snapshot (every admitted model with its stats) at once, every
  heartbeat, and as soon as the engine's health, a canary or the model set changes. It
  reconnects after a capped, jittered exponential backoff (the initial 0.1 s after a graceful,
  OK end), and early when the replica re-appears in a snapshot
  or, seen refusing connections, accepts them again (TCP probes every `RECONNECT_POLL_SECONDS`).
  A replica is dropped only when no latest snapshot lists it and its stream is gone.

grpcio calls are blocking: a worker thread per call drains its responses (`bridge.py`), and the
requests flow through a `queue.Queue` that grpcio's sender thread reads. Cancelling a task
cancels its call and joins its thread (bounded), so SIGTERM ends every stream promptly.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import httpx
import trio

from stargate.addresses import format_host_port
from stargate.health_probe import ProbeFailed, http_health_probe, httpx_get
from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from stargate.pylon.backoff import (
    RECONNECT_POLL_SECONDS,
    RECONNECT_PROBE_TIMEOUT_SECONDS,
    WORST_RECONNECT_DELAY_SECONDS,
    Backoff,
    RecoveryDetector,
)
from stargate.pylon.bridge import Outbox, ResponseReader, StreamEnded
from stargate.pylon.bringup import calibrate, run_canary
from stargate.pylon.collector import (
    engine_metrics_loop,
    engine_stream_loop,
    kv_cache_loop,
    sweep_loop,
)
from stargate.pylon.config import DialTarget, PylonConfig, advertise_host
from stargate.pylon.hop import HopConfig, PylonHop
from stargate.pylon.kv_blocks import KvBlockTracker
from stargate.pylon.listener import PylonApp
from stargate.pylon.snapshot import (
    ReplicaInfo,
    WatchResult,
    attach_kv_delta,
    build_registration,
    desired_replicas,
    next_watch_target,
    parse_model_list,
    parse_watch_response,
    reachable_watches,
    reappeared,
    registration_changes,
    split_host_port,
    watch_candidates,
)
from stargate.pylon.stats.aggregator import StatsAggregator, StatsConfig
from stargate.pylon.tunnel import EndpointWatch
from stargate.upstream import ConnectionPool, UpstreamConfig

__all__ = [
    "HEARTBEAT_METADATA",
    "WORST_RECONNECT_DELAY_SECONDS",
    "Pylon",
    "run_pylon",
    "tcp_accepts",
    "wait_for_retry",
]

if TYPE_CHECKING:  # aioquic loads only when a tunnel is served
    from stargate.tunnel.quic import QuicConnection

log = logging.getLogger("stargate.pylon")

HEARTBEAT_METADATA = "x-stargate-registration-heartbeat-ms"
BACKOFF_INITIAL_SECONDS = 0.1
BACKOFF_CAP_SECONDS = 5.0
STABLE_STREAM_SECONDS = 5.0
"""A stream that stayed up this long resets its backoff."""
PRIMARY_RETURN_POLL_SECONDS = RECONNECT_POLL_SECONDS
"""While a watch runs on a fallback replica, how often its own target is TCP-probed to go back
to it. As fast as a registration's probes: a seed replica that some other replica stopped
listing while it was down (an absent static peer) is rediscovered by this return, so the return
is bound by `WORST_RECONNECT_DELAY_SECONDS` too. A probe of a dead address is one refused (or,
after `RECONNECT_PROBE_TIMEOUT_SECONDS`, abandoned) connect."""
MAX_POLLED_TARGETS = 8
"""At most this many of a watch's candidates are TCP-probed while the watch backs off."""
HALF_CLOSE_GRACE_SECONDS = 0.5
"""On a deliberate close, how long the replica may take to end the stream after the half-close
before the call is cancelled."""
UPSTREAM_WAIT_POLL_SECONDS = 0.25
DRAIN_SECONDS = 30.0
"""On a graceful stop, how long requests in flight through the Pylon may take to finish once the
registrations are closed."""
CALIBRATION_RETRY_SECONDS = 1.0
KEEP_ALIVE_SECONDS = 75.0
ENGINE_CONNECT_TIMEOUT_SECONDS = 5.0
ENGINE_MAX_CONNECTIONS = 4096
"""Connections to the engine, so concurrent requests (each holds one to its end): an engine
batches hundreds of sequences, and every replica forwards through this one Pylon."""


def _listener_error_log() -> logging.Logger:
    return logging.getLogger("stargate.pylon.listener")


async def _stop_when(stop: trio.Event, scope: trio.CancelScope) -> None:
    await stop.wait()
    scope.cancel()


def _probe_timeout(config: PylonConfig) -> float:
    """Timeout of one engine request: twice the heartbeat, within [1 s, 5 s]."""
    return min(5.0, max(1.0, 2 * config.heartbeat_seconds))


async def probe_upstream(
    client: httpx.AsyncClient, base_url: str, paths: tuple[str, ...], seconds: float
) -> None:
    """Raise ProbeFailed unless the engine is healthy, judged exactly as the replica judges it."""
    await http_health_probe(httpx_get(client), base_url, seconds, paths)


def _channel(
    target: DialTarget,
    authority: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.Channel:
    """A channel to one replica: TLS with `credentials` (`--stargate-ca-file`) whatever the
    address says, else TLS with the system roots for an `https://` seed, else plaintext h2c.
    With TLS the replica's certificate must name `authority` (its advertise address) or, without
    one, the dialled host."""
    # A channel of its own per attempt, with its own subchannels: grpcio otherwise shares a
    # subchannel between channels to one address, and a shared one still in its reconnect
    # backoff (seconds) would fail a fresh attempt at once, undoing the fast reconnect.
    options: list[tuple[str, str | int]] = [("grpc.use_local_subchannel_pool", 1)]
    if authority:
        options.append(("grpc.default_authority", authority))
    if credentials is not None:
        return grpc.secure_channel(target.address, credentials, options)
    if target.secure:
        return grpc.secure_channel(target.address, grpc.ssl_channel_credentials(), options)
    return grpc.insecure_channel(target.address, options)


def stargate_credentials(ca_file: Path | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the CA certificates in `ca_file`, or None (plaintext) without
    one. The file is read once, at start-up."""
    if ca_file is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())


Probe = Callable[[DialTarget], Awaitable[bool]]


async def tcp_accepts(
    target: DialTarget, connect_seconds: float = RECONNECT_PROBE_TIMEOUT_SECONDS
) -> bool:
    """Whether a TCP connection to `target` opens within `connect_seconds` (then it is closed at
    once).

    Cheap evidence that a replica is listening again; a name is resolved on every call, as
    gRPC does. A target that is not `host:port` is reported as accepting (never probed)."""
    host_port = split_host_port(target.address)
    if host_port is None:
        return True
    with trio.move_on_after(connect_seconds):
        try:
            stream = await trio.open_tcp_stream(*host_port)
        except OSError:
            return False
        with trio.CancelScope(shield=True):
            await stream.aclose()
        return True
    return False


async def wait_for_retry(
    delay: float,
    targets: Sequence[DialTarget],
    detectors: Mapping[DialTarget, RecoveryDetector],
    *,
    poked: trio.Event | None = None,
    probe: Probe = tcp_accepts,
    poll_seconds: float = RECONNECT_POLL_SECONDS,
) -> str:
    """Sleep `delay` seconds before a retry, waking early; return why the sleep ended.

    `"timer"`: the delay passed. `"snapshot"`: `poked` was set (the replica re-appeared in a
    snapshot). `"accepting"`: a target whose detector had seen it refuse now accepts a TCP
    connection. Each target is probed at once and then every `poll_seconds` until it accepts;
    one that accepts without having been seen down is left alone (it refuses the stream, not
    the connection, and the timer decides)."""
    outcome = "timer"
    async with trio.open_nursery() as nursery:

        def finish(why: str) -> None:
            nonlocal outcome
            outcome = why
            nursery.cancel_scope.cancel()

        async def timer() -> None:
            await trio.sleep(delay)
            finish("timer")

        async def wait_poked(event: trio.Event) -> None:
            await event.wait()
            finish("snapshot")

        async def poll(target: DialTarget, detector: RecoveryDetector) -> None:
            next_probe = trio.current_time()
            while True:
                accepted = await probe(target)
                if detector.observe(accepted):
                    finish("accepting")
                    return
                if accepted:
                    return
                next_probe += poll_seconds
                await trio.sleep_until(next_probe)

        nursery.start_soon(timer)
        if poked is not None:
            nursery.start_soon(wait_poked, poked)
        for target in targets:
            detector = detectors.get(target)
            if detector is not None:
                nursery.start_soon(poll, target, detector)
    return outcome


@dataclass
class _Task:
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    poked: trio.Event = field(default_factory=trio.Event)
    """Set when the replica re-appears in a snapshot: its retry sleep ends at once."""


class Pylon:
    """One sidecar's state and tasks; `run` is the whole program.

    Models go through two sets: `models` are the engine's (the flag, or `GET /v1/models`), each
    with its stats state; `admitted` are those whose bring-up (calibration, when on) succeeded,
    the only ones advertised. A model whose canary fails stays advertised but INACTIVE."""

    def __init__(self, config: PylonConfig) -> None:
        self.config = config
        self.models: tuple[str, ...] = tuple(sorted(set(config.model_names)))
        self.admitted: set[str] = set()
        self.canary_failing: set[str] = set()
        self.healthy = False
        bringup = config.bringup
        self.stats = StatsAggregator(
            StatsConfig(
                initial_input_tps=bringup.initial_input_tps,
                pin_input_tps=bringup.pin_input_tps,
                fallback_from_start=config.side_channels.engine_stats_stream == "off",
            ),
            unix_ms=lambda: int(time.time() * 1000),
        )
        self.url = config.request_path.advertise_url or ""
        """The URL registered as `inference_server_url` (known once the listener is bound)."""
        channels = config.side_channels
        self.kv_blocks: KvBlockTracker | None = (
            KvBlockTracker(channels.kv_events_max_blocks)
            if channels.kv_events_endpoint is not None
            else None
        )
        """The engine's cached prefix blocks (`--kv-events-endpoint`), else None."""
        self._changed = trio.Event()
        self._results: dict[DialTarget, WatchResult] = {}
        self._watches: dict[DialTarget, _Task] = {}
        self._registrations: dict[ReplicaInfo, _Task] = {}
        self._closing: dict[ReplicaInfo, _Task] = {}  # cancelled, maybe still closing
        self._registered: set[ReplicaInfo] = set()
        self._listed: frozenset[ReplicaInfo] = frozenset()  # the union of the kept snapshots
        self._nursery: trio.Nursery | None = None
        self._pool: ConnectionPool | None = None
        self._bringing_up: set[str] = set()
        self._token: str | None = None
        self._models_failing = False
        self._credentials = stargate_credentials(config.stargate_ca_file)
        self._stop = trio.Event()
        self._hop: PylonHop | None = None
        self._reverse_connected: set[ReplicaInfo] = set()
        # The tunnels (docs/tunnels.md) live in the serving nursery, beside the HTTP listener, so
        # a graceful stop drains their streams as it drains the listener's requests.
        self._serving: trio.Nursery | None = None
        self._tunnel_scopes: dict[ReplicaInfo | None, trio.CancelScope] = {}
        self._reverse_watches: dict[ReplicaInfo, EndpointWatch] = {}
        self.tunnel_connections: set[QuicConnection] = set()
        """Tunnel connections being served (direct or reverse): what a graceful stop drains."""
        if config.tunnel.connectivity == "reverse":
            self.url = config.upstream_url  # the Rust Pylon registers its engine's URL

    # ------------------------------------------------------------------ public state

    @property
    def replicas(self) -> frozenset[ReplicaInfo]:
        """Replicas with a registration task (listed by a kept snapshot, or still registered)."""
        return frozenset(self._registrations)

    @property
    def registered(self) -> frozenset[ReplicaInfo]:
        """Replicas whose current stream has been acknowledged at least once."""
        return frozenset(self._registered)

    def registration(self, replica: ReplicaInfo | None = None) -> pb.InferenceServerRegistration:
        """The snapshot sent to `replica`. In reverse mode its models are INACTIVE there until
        its reverse tunnel is up (the Rust Pylon's rule: nothing routes to a Pylon the replica
        cannot reach)."""
        now = trio.current_time()
        reachable = self.config.tunnel.connectivity != "reverse" or (
            replica is not None and replica in self._reverse_connected
        )
        message = build_registration(
            inference_server_id=self.config.inference_server_id,
            inference_server_url=self.url,
            cluster_id=self.config.cluster_id,
            models={
                model: (
                    self.stats.snapshot(model, now),
                    reachable and self.healthy and model not in self.canary_failing,
                )
                for model in self.models
                if model in self.admitted
            },
        )
        if self.config.tunnel.connectivity == "reverse":
            message.reverse_tunnel = True
        return message

    def stop(self) -> None:
        """Begin a graceful stop: close every registration (the replicas stop routing here at
        once), then let the requests in flight finish (at most `DRAIN_SECONDS`) and return."""
        self._stop.set()

    def _notify_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _pending(self, model: str) -> bool:
        """A model of the engine's that is not admitted yet (its bring-up is running)."""
        return model in self.models and model not in self.admitted

    # ------------------------------------------------------------------ main

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Imported here so that `stargate --help` does not pay for Hypercorn's imports.
        from stargate.http_limits import raise_open_file_limit
        from stargate.serving import bind_listener, bound_address, hypercorn_config, serve_asgi

        # Every request in flight holds two descriptors (the replica's connection and the
        # engine's): the usual soft limit of 1,024 would stop the Pylon near 500 streams.
        descriptors = raise_open_file_limit()
        config = self.config
        path = config.request_path
        sock = bind_listener("pylon", path.listen_addr)
        try:
            bound = bound_address(sock)
            if not self.url and not config.tunnel.tunneled:
                self.url = f"http://{format_host_port(advertise_host(bound.host), bound.port)}"
            log.info(
                "pylon %r for %s: listening on %s, registered as %s; seeds %s, %s, heartbeat "
                "%d ms; open-file limit %s",
                config.inference_server_id,
                config.upstream_url,
                bound,
                self.url or "the direct tunnel's quic:// address (below)",
                ", ".join(str(seed) for seed in config.stargates),
                f"models {list(self.models)}" if self.models else "models from GET /v1/models",
                config.min_update_interval_ms,
                descriptors,
            )
            upstream = UpstreamConfig(
                connect_timeout=ENGINE_CONNECT_TIMEOUT_SECONDS,
                response_head_timeout=math.inf,  # a non-streamed answer's head comes at its end
                max_connections_per_origin=ENGINE_MAX_CONNECTIONS,
                max_idle_per_origin=ENGINE_MAX_CONNECTIONS,
            )
            hop_config = HopConfig(
                upstream_url=config.upstream_url,
                health_paths=config.upstream_health_paths,
                upstream_backend=path.upstream_backend,
                priority_ceiling=path.priority_ceiling,
                require_streaming=path.require_streaming,
                local_connect_failures_retryable=path.local_connect_failures_retryable,
                admission=path.admission,
            )
            timeout = _probe_timeout(config)
            async with (
                httpx.AsyncClient(timeout=timeout) as client,
                ConnectionPool(upstream) as pool,
                trio.open_nursery() as serving,
            ):
                self._pool = pool
                hop = PylonHop(hop_config, pool, self.stats, pending=self._pending)
                self._hop = hop
                self._serving = serving
                if config.tunnel.connectivity == "direct":
                    await serving.start(self._serve_direct_tunnel, hop)
                served = hypercorn_config(DRAIN_SECONDS)
                served.errorlog = _listener_error_log()
                # Longer than the replicas' idle expiry (60 s): they close an idle connection
                # before the Pylon does, so a request never races the Pylon's close.
                served.keep_alive_timeout = KEEP_ALIVE_SECONDS
                draining = trio.Event()
                await serving.start(serve_asgi, PylonApp(hop), sock, served, draining.wait)
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        nursery.start_soon(_stop_when, self._stop, nursery.cancel_scope)
                        await self._wait_for_upstream(client)
                        if not config.model_names:
                            await self._refresh_models(client)
                        self._models_changed()
                        self._start_side_channels(nursery, client)
                        nursery.start_soon(self._health_loop, client)
                        if not config.model_names:
                            nursery.start_soon(self._model_loop, client)
                        if config.bringup.canary_interval_ms > 0:
                            nursery.start_soon(self._canary_loop, pool)
                        self._reconcile()
                        task_status.started()
                finally:
                    draining.set()  # the registrations are closed: drain the listener
                    await self._drain_tunnels()
        finally:
            sock.close()

    async def _serve_direct_tunnel(
        self, hop: PylonHop, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The direct tunnel listener (docs/tunnels.md): registered as `quic://IP:port`, each
        connection's streams served through `hop`."""
        from stargate.pylon.tunnel import serve_connection
        from stargate.tunnel.identity import QuicIdentity
        from stargate.tunnel.quic import QuicServer

        tunnel = self.config.tunnel
        identity = QuicIdentity(tunnel.cert_path, tunnel.key_path)
        listen = tunnel.quic_listen_addr

        async def serve(connection: QuicConnection) -> None:
            self.tunnel_connections.add(connection)
            try:
                await serve_connection(connection, hop, tunnel.protocol)
            finally:
                self.tunnel_connections.discard(connection)

        async with trio.open_nursery() as nursery:
            self._tunnel_scopes[None] = nursery.cancel_scope
            server = await nursery.start(
                QuicServer.serve,
                listen.host,
                listen.port,
                lambda: identity.server_configuration(tunnel.protocol.alpn),
                serve,
            )
            host = advertise_host(listen.host)
            self.url = f"quic://{format_host_port(host, server.port)}"
            log.info(
                "direct tunnel (%s) listening on UDP port %d", tunnel.protocol.value, server.port
            )
            if tunnel.cert_path is not None:
                nursery.start_soon(identity.reload_every, 30_000)
            task_status.started()

    async def _drain_tunnels(self) -> None:
        """After the registrations closed: let the streams in flight on every tunnel finish (at
        most `DRAIN_SECONDS`; the replicas send no new ones), then close the tunnels."""
        with trio.move_on_after(DRAIN_SECONDS):
            while any(c.open_request_streams for c in self.tunnel_connections):  # noqa: ASYNC110
                await trio.sleep(0.1)
        for scope in self._tunnel_scopes.values():
            scope.cancel()

    def _start_side_channels(self, nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
        channels = self.config.side_channels
        base = self.config.upstream_url
        nursery.start_soon(sweep_loop, self.stats)
        if channels.engine_stats_stream != "off":
            nursery.start_soon(
                functools.partial(
                    engine_stream_loop,
                    client,
                    base + channels.engine_stats_stream_path,
                    self.stats,
                    required=channels.engine_stats_stream == "required",
                )
            )
        if channels.kv_events_endpoint is not None and self.kv_blocks is not None:
            from stargate.pylon.kv_events import kv_events_loop  # pyzmq, msgpack: only now

            nursery.start_soon(kv_events_loop, channels.kv_events_endpoint, self.kv_blocks)
        if channels.kv_cache_stats_path is not None:
            path = channels.kv_cache_stats_path.lstrip("/")
            nursery.start_soon(kv_cache_loop, client, f"{base}/{path}", self.stats)
        elif channels.engine_metrics_path is not None:
            nursery.start_soon(
                engine_metrics_loop, client, base + channels.engine_metrics_path, self.stats
            )

    # ------------------------------------------------------------------ bring-up

    def _models_changed(self) -> None:
        """The engine's model set changed: stats state follows it (a model that left starts
        over when it comes back), and every new model is brought up."""
        self.stats.set_models(self.models)
        self.admitted &= set(self.models)
        self.canary_failing &= set(self.models)
        for model in self.models:
            if model in self.admitted or model in self._bringing_up:
                continue
            if not self.config.bringup.do_calibration:
                self.admitted.add(model)
                continue
            if self._nursery is not None and self._pool is not None:
                self._bringing_up.add(model)
                self._nursery.start_soon(self._calibrate, model, self._pool)
        self._notify_changed()

    async def _calibrate(self, model: str, pool: ConnectionPool) -> None:
        """Calibrate `model` until it succeeds (retried every `CALIBRATION_RETRY_SECONDS`), then
        admit it; gives up if the engine drops the model meanwhile."""
        generation = 0
        try:
            while model in self.models:
                if await calibrate(
                    pool,
                    self.config.upstream_url,
                    self.stats,
                    model,
                    self.config.bringup.calibration,
                    generation=generation,
                ):
                    if model in self.models:
                        self.admitted.add(model)
                        self._notify_changed()
                    return
                generation += 1
                await trio.sleep(CALIBRATION_RETRY_SECONDS)
        finally:
            self._bringing_up.discard(model)

    async def _canary_loop(self, pool: ConnectionPool) -> None:
        """Every `--canary-interval-ms`, one canary per admitted model that produced no output
        since the previous round; a failing model is INACTIVE until its canary passes again.

        A model whose requests are producing output is working, and a canary sent to it would
        wait in the engine's queue behind them: on a busy engine it timed out and made a healthy
        model INACTIVE (measured with the routing benchmark; docs/pylon-data-path.md)."""
        bringup = self.config.bringup
        previous_round: float | None = None
        while True:
            started = trio.current_time()
            for model in sorted(self.admitted):
                last_output = self.stats.last_output_at(model)
                busy = previous_round is not None and (
                    last_output is not None and last_output >= previous_round
                )
                if busy and model not in self.canary_failing:
                    continue
                why = await run_canary(
                    pool, self.config.upstream_url, model, bringup.canary_timeout_ms / 1000
                )
                if why is not None and model not in self.canary_failing:
                    log.warning("canary of %s failed (%s): model now INACTIVE", model, why)
                    self.canary_failing.add(model)
                    self._notify_changed()
                elif why is None and model in self.canary_failing:
                    log.info("canary of %s passed: model ACTIVE again", model)
                    self.canary_failing.discard(model)
                    self._notify_changed()
            previous_round = started
            await trio.sleep(bringup.canary_interval_ms / 1000)

    # ------------------------------------------------------------------ the engine

    async def _probe(self, client: httpx.AsyncClient) -> bool:
        try:
            await probe_upstream(
                client,
                self.config.upstream_url,
                self.config.upstream_health_paths,
                _probe_timeout(self.config),
            )
        except ProbeFailed as error:
            if self.healthy:
                log.warning("upstream unhealthy, models now INACTIVE: %s", error)
                self.healthy = False
                self._notify_changed()
            return False
        if not self.healthy:
            log.info("upstream healthy, models now ACTIVE")
            self.healthy = True
            self._notify_changed()
        return True

    async def _wait_for_upstream(self, client: httpx.AsyncClient) -> None:
        wait = self.config.upstream_health_wait_ms / 1000
        deadline = trio.current_time() + wait
        if await self._probe(client):
            return
        if wait > 0:
            log.info("waiting up to %.1f s for the upstream to become healthy", wait)
        while trio.current_time() < deadline:
            await trio.sleep(min(UPSTREAM_WAIT_POLL_SECONDS, deadline - trio.current_time()))
            if await self._probe(client):
                return
        log.warning("upstream not healthy; registering its models as INACTIVE until it is")

    async def _health_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await trio.sleep(self.config.heartbeat_seconds)
            await self._probe(client)

    async def _refresh_models(self, client: httpx.AsyncClient) -> None:
        url = self.config.upstream_url + "/v1/models"
        try:
            with trio.fail_after(_probe_timeout(self.config)):
                response = await client.get(url)
                response.raise_for_status()
                models = parse_model_list(response.json())
        except (httpx.HTTPError, trio.TooSlowError, ValueError) as error:
            level = logging.DEBUG if self._models_failing else logging.WARNING
            log.log(level, "could not read the upstream's models from %s: %r", url, error)
            self._models_failing = True
            return
        self._models_failing = False
        if models != self.models:
            log.info("upstream models: %s", list(models))
            self.models = models
            self._models_changed()

    async def _model_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await trio.sleep(self.config.model_refresh_seconds)
            await self._refresh_models(client)

    # ------------------------------------------------------------------ discovery

    def _reconcile(self) -> None:
        """Start and stop watch and registration tasks to match the kept snapshots.

        Called whenever a kept snapshot changes; never because a watch stream ended (its
        snapshot is kept). A registration whose stream ends while its replica is unlisted drops
        itself (`_register`): that is the other moment the drop rule can start to hold."""
        nursery = self._nursery
        assert nursery is not None
        watches = reachable_watches(self.config.stargates, self._results)
        for url in list(self._watches):
            if url not in watches:
                log.info("no longer watching %s (not announced any more)", url)
                self._watches.pop(url).scope.cancel()
                self._results.pop(url, None)
        for url in sorted(watches - set(self._watches), key=str):
            task = self._watches[url] = _Task()
            nursery.start_soon(self._watch, url, task)
        self._listed = desired_replicas(watches, self._results)
        start, stop = registration_changes(self._listed, self._registrations, self._registered)
        for replica in sorted(stop, key=lambda r: r.authority):
            log.info("replica %s left discovery; closing its registration", replica.name)
            closing = self._closing[replica] = self._registrations.pop(replica)
            closing.scope.cancel()
        for replica in sorted(start, key=lambda r: r.authority):
            previous = self._closing.pop(replica, None)
            task = self._registrations[replica] = _Task()
            nursery.start_soon(self._register, replica, task, previous)

    def _detector(
        self, detectors: dict[DialTarget, RecoveryDetector], target: DialTarget
    ) -> RecoveryDetector:
        return detectors.setdefault(target, RecoveryDetector())

    async def _watch(self, key: DialTarget, task: _Task) -> None:
        """Keep the snapshot under `key` fresh: its own target first, then the fallbacks, one
        round after another with a backoff between rounds (cut short when a target comes back)."""
        backoff = Backoff(BACKOFF_INITIAL_SECONDS, BACKOFF_CAP_SECONDS)
        detectors: dict[DialTarget, RecoveryDetector] = {}
        tried: set[DialTarget] = set()
        current: DialTarget | None = None
        last_failure = ""
        try:
            with task.scope:
                while True:
                    candidates = watch_candidates(key, self.config.stargates, self._results)
                    target = next_watch_target(candidates, tried)
                    if target is None:
                        delay = backoff.next()
                        kept = self._results.get(key)
                        text = f"tried {len(tried)} address(es)"
                        level = logging.DEBUG if text == last_failure else logging.WARNING
                        log.log(
                            level,
                            "WatchStargates for %s: no replica answered (%s); keeping its last "
                            "snapshot (%s); next round in %.2f s",
                            key,
                            text,
                            "none yet" if kept is None else f"{len(kept.replicas)} replicas",
                            delay,
                        )
                        last_failure = text
                        polled = candidates[:MAX_POLLED_TARGETS]
                        for candidate in polled:
                            self._detector(detectors, candidate)
                        why = await wait_for_retry(delay, polled, detectors)
                        if why != "timer":
                            backoff.reset()
                        tried.clear()
                        continue
                    tried.add(target)
                    if target != key:
                        # A fallback is only worth a stream when it accepts connections: a
                        # dead replica's address could otherwise hold the round for a connect
                        # timeout.
                        accepted = await tcp_accepts(target)
                        self._detector(detectors, target).observe(accepted)
                        if not accepted:
                            continue
                    if target != current:
                        if target != key or current is not None:
                            log.info("WatchStargates for %s: watching %s", key, target)
                        current = target
                    started = trio.current_time()
                    outcome = await self._watch_target(key, target, detectors)
                    if outcome is None:
                        log.info("WatchStargates for %s: %s accepts again; returning", key, key)
                        tried.clear()
                        continue
                    end, received = outcome
                    text = end.describe()
                    if not received:
                        level = logging.DEBUG if text == last_failure else logging.WARNING
                        log.log(level, "WatchStargates on %s (for %s): %s", target, key, text)
                        last_failure = text
                        continue  # the next candidate, at once
                    last_failure = ""
                    tried.clear()
                    if trio.current_time() - started >= STABLE_STREAM_SECONDS:
                        backoff.reset()
                        delay = 0.0
                    else:
                        delay = backoff.next()  # a stream that keeps ending soon backs off
                    log.info(
                        "WatchStargates on %s (for %s): %s; keeping its last snapshot, "
                        "re-watching in %.2f s",
                        target,
                        key,
                        text,
                        delay,
                    )
                    await trio.sleep(delay)
        finally:
            task.done.set()

    async def _watch_target(
        self, key: DialTarget, target: DialTarget, detectors: dict[DialTarget, RecoveryDetector]
    ) -> tuple[StreamEnded, bool] | None:
        """Run one watch stream on `target` for `key`. On a fallback, also probe `key` and end
        the stream early (returning None) once `key`, seen down, accepts connections again: a
        seed may stand for a fleet the fallback does not see (another region), and a seed
        replica that its peers stopped listing while it was down is found again this way."""
        if target == key:
            return await self._watch_once(key, target)
        outcome: tuple[StreamEnded, bool] | None = None
        detector = self._detector(detectors, key)
        async with trio.open_nursery() as nursery:

            async def stream() -> None:
                nonlocal outcome
                outcome = await self._watch_once(key, target)
                nursery.cancel_scope.cancel()

            async def primary_back() -> None:
                next_probe = trio.current_time()
                while True:
                    accepted = await tcp_accepts(key)
                    if detector.observe(accepted):
                        nursery.cancel_scope.cancel()
                        return
                    if accepted:
                        # Up but never seen down: it failed the watch itself, so stay on the
                        # fallback (the next round tries `key` first anyway) and stop probing.
                        return
                    next_probe += PRIMARY_RETURN_POLL_SECONDS  # a fixed cadence, as in retries
                    await trio.sleep_until(next_probe)

            nursery.start_soon(stream)
            nursery.start_soon(primary_back)
        return outcome

    async def _watch_once(self, key: DialTarget, target: DialTarget) -> tuple[StreamEnded, bool]:
        """Run one watch stream on `target` until it ends, keeping what it sends under `key`;
        return how it ended, and whether anything arrived."""
        received = False
        channel = _channel(target, credentials=self._credentials)
        try:
            stub = pb_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            call = stub.WatchStargates(pb.WatchStargatesRequest())
            reader: ResponseReader[pb.WatchStargatesResponse] = ResponseReader(
                call, f"pylon-watch-{target}"
            )
            try:
                async for item in reader.receive:
                    if isinstance(item, StreamEnded):
                        return item, received
                    received = True
                    result = parse_watch_response(item)
                    previous = self._results.get(key)
                    if previous != result:
                        log.debug("WatchStargates on %s (for %s): %s", target, key, result)
                        self._results[key] = result
                        self._reconcile()
                        for replica in reappeared(previous, result):
                            registration = self._registrations.get(replica)
                            if registration is not None:
                                registration.poked.set()
                return StreamEnded(), received  # pragma: no cover - the reader always ends
            finally:
                await reader.close()
        finally:
            channel.close()

    # ------------------------------------------------------------------ registration

    def _metadata(self) -> list[tuple[str, str]]:
        metadata = [(HEARTBEAT_METADATA, str(self.config.min_update_interval_ms))]
        token_file = self.config.token_file
        if token_file is not None:
            try:
                self._token = Path(token_file).read_text().strip()
            except OSError as error:
                log.warning("cannot read the token file %s: %s", token_file, error.strerror)
            if self._token:
                metadata.append(("authorization", f"Bearer {self._token}"))
        metadata.extend(self.config.extra_metadata)
        return metadata

    async def _register(self, replica: ReplicaInfo, task: _Task, previous: _Task | None) -> None:
        """Keep one registration stream with `replica` until the replica is dropped.

        After a stream ends: a replica no snapshot lists any more is dropped (its stream is gone
        now, the second half of the drop rule); a graceful end (OK, a draining replica) retries
        after the initial backoff; other ends back off, woken early when the replica re-appears
        in a snapshot or, seen refusing connections, accepts them again."""
        backoff = Backoff(BACKOFF_INITIAL_SECONDS, BACKOFF_CAP_SECONDS)
        detectors = {replica.dial: RecoveryDetector()}
        last_failure = ""
        try:
            with task.scope:
                if previous is not None:
                    await previous.done.wait()  # one stream per replica at a time
                while True:
                    started = trio.current_time()
                    end, acked = await self._register_once(replica)
                    text = end.describe()
                    if acked:
                        detectors[replica.dial].clear()
                    if replica not in self._listed:
                        log.info(
                            "replica %s is no longer announced and its registration ended (%s); "
                            "dropping it",
                            replica.name,
                            text,
                        )
                        if self._registrations.get(replica) is task:
                            del self._registrations[replica]
                        self._drop_reverse(replica)
                        return
                    graceful = acked and end.error is None
                    if graceful or (
                        acked and trio.current_time() - started >= STABLE_STREAM_SECONDS
                    ):
                        backoff.reset()
                    if task.poked.is_set():  # re-announced while the stream was failing
                        task.poked = trio.Event()
                        backoff.reset()
                    delay = backoff.next()
                    if end.code == grpc.StatusCode.ALREADY_EXISTS:
                        text += " (another stream holds this id; it is free once that one ends)"
                    if graceful:
                        log.info(
                            "replica %s ended the registration (%s); re-dialling in %.2f s",
                            replica.name,
                            text,
                            delay,
                        )
                    elif acked:
                        log.warning(
                            "lost registration with replica %s: %s; reconnecting in %.2f s",
                            replica.name,
                            text,
                            delay,
                        )
                    elif text != last_failure:
                        log.warning(
                            "registration with replica %s failed: %s; retrying in %.2f s "
                            "(backing off up to %.0f s, sooner once it accepts connections)",
                            replica.name,
                            text,
                            delay,
                            BACKOFF_CAP_SECONDS,
                        )
                    else:
                        log.debug(
                            "registration with replica %s failed again: %s", replica.name, text
                        )
                    last_failure = "" if acked else text
                    why = await wait_for_retry(delay, [replica.dial], detectors, poked=task.poked)
                    if why != "timer":
                        log.debug("replica %s: retrying now (%s)", replica.name, why)
                        backoff.reset()
                    if why == "snapshot":
                        task.poked = trio.Event()
        finally:
            task.done.set()

    async def _register_once(self, replica: ReplicaInfo) -> tuple[StreamEnded, bool]:
        """Run one registration stream until it ends; return how it ended and whether it was
        ever acknowledged. Cancellation half-closes the stream, then cancels it."""
        channel = _channel(replica.dial, replica.authority, self._credentials)
        outbox: Outbox[pb.InferenceServerRegistration] = Outbox()
        acked = ended = False
        try:
            stub = pb_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            call = stub.RegisterInferenceServer(outbox.requests(), metadata=self._metadata())
            reader: ResponseReader[pb.InferenceServerAck] = ResponseReader(
                call, f"pylon-register-{replica.authority}"
            )
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_snapshots, outbox, replica)
                    async for item in reader.receive:
                        if isinstance(item, StreamEnded):
                            ended = True
                            nursery.cancel_scope.cancel()
                            return item, acked
                        if self.config.tunnel.connectivity == "reverse":
                            self._reverse_endpoint(replica, item)
                        if not acked:
                            acked = True
                            self._registered.add(replica)
                            log.info(
                                "registered with replica %s as %r (%d models, %s)",
                                replica.name,
                                self.config.inference_server_id,
                                len(self.admitted),
                                "ACTIVE"
                                if self.healthy and self.config.tunnel.connectivity != "reverse"
                                else "INACTIVE until its reverse tunnel is up"
                                if self.healthy
                                else "INACTIVE",
                            )
                return StreamEnded(), acked  # pragma: no cover - the reader always sends an end
            finally:
                if acked and not ended:
                    log.info("closing registration with replica %s", replica.name)
                outbox.close()  # half-close; on a deliberate close the replica ends the stream
                if not reader.finished:
                    await reader.wait_finished(HALF_CLOSE_GRACE_SECONDS)
                await reader.close()
        finally:
            self._registered.discard(replica)
            outbox.close()
            channel.close()

    def _reverse_endpoint(self, replica: ReplicaInfo, ack: pb.InferenceServerAck) -> None:
        """Take the reverse endpoint an ack of `replica` names; the first one starts the tunnel
        to it (kept until the replica is dropped or the Pylon stops)."""
        watch = self._reverse_watches.get(replica)
        if watch is None:
            watch = self._reverse_watches[replica] = EndpointWatch()
        if not watch.update(ack.reverse_tunnel_target, ack.reverse_tunnel_pylon_dial_addr):
            return
        if replica not in self._tunnel_scopes and self._serving is not None:
            scope = self._tunnel_scopes[replica] = trio.CancelScope()
            self._serving.start_soon(self._reverse_tunnel, replica, watch, scope)

    def _drop_reverse(self, replica: ReplicaInfo) -> None:
        scope = self._tunnel_scopes.pop(replica, None)
        if scope is not None:
            scope.cancel()
        self._reverse_watches.pop(replica, None)

    async def _reverse_tunnel(
        self, replica: ReplicaInfo, endpoint: EndpointWatch, scope: trio.CancelScope
    ) -> None:
        """Keep a reverse tunnel to `replica`: dial where its latest ack says, serve the streams
        it opens, redial with a backoff (docs/tunnels.md)."""
        from stargate.pylon.tunnel import ReverseTunnels

        tunnel = self.config.tunnel
        trust = tunnel.cert_path.read_bytes() if tunnel.cert_path is not None else None

        def changed() -> None:
            if replica.name in tunnels.connected:
                self._reverse_connected.add(replica)
            else:
                self._reverse_connected.discard(replica)
            self._notify_changed()

        tunnels = ReverseTunnels(
            lambda: self._hop,
            self.config.inference_server_id,
            lambda: self._token,
            protocol=tunnel.protocol,
            insecure=tunnel.insecure,
            trust_pem=trust,
            on_change=changed,
            connections=self.tunnel_connections,
        )
        try:
            with scope:
                await tunnels.run_for(replica.name, endpoint)
        finally:
            self._reverse_connected.discard(replica)

    async def _send_snapshots(
        self, outbox: Outbox[pb.InferenceServerRegistration], replica: ReplicaInfo
    ) -> None:
        """One stream's messages: the snapshot at once, every heartbeat and on every change.
        With KV events each carries the stream's block delta (`kv_blocks.py`); the chunks of a
        large reset go back to back, without waiting for the heartbeat."""
        tracker = self.kv_blocks
        cursor = tracker.cursor() if tracker is not None else None
        while True:
            changed = self._changed
            message = self.registration(replica)
            if tracker is not None and cursor is not None:
                attach_kv_delta(message, tracker.delta(cursor))
            outbox.put(message)
            if cursor is not None and cursor.syncing:
                await trio.lowlevel.checkpoint()
                continue
            with trio.move_on_after(self.config.heartbeat_seconds):
                await changed.wait()


async def run_pylon(
    config: PylonConfig, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run a Pylon until cancelled. `task_status.started()` is reported once the initial
    upstream health wait (and model discovery) is over and the seed watches are starting."""
    await Pylon(config).run(task_status=task_status)
