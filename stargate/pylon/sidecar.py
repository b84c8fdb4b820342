"""The Pylon sidecar: keep one inference engine registered with every Stargate replica.

Task tree (one trio nursery, `Pylon.run`):

- a health loop probing the engine every heartbeat (`http_health_probe` semantics);
- with no explicit `--model-name`, a loop re-reading the engine's `GET /v1/models`;
- one watch task per WatchStargates URL: the seeds and, recursively, every `watch_stargate_urls`
  entry announced by a watch that is kept. Each watch's latest snapshot is kept until the stream
  ends or errors; then it is dropped at once and the watch reconnects after a backoff;
- one registration task per replica in the union of the kept snapshots: a
  `RegisterInferenceServer` stream that sends the full snapshot at once, every heartbeat, and as
  soon as the engine's health or model set changes; it reconnects after a capped, jittered
  exponential backoff whenever the stream ends or fails. A replica that leaves every snapshot
  has its task cancelled (the stream is half-closed, then cancelled).

grpcio calls are blocking: a worker thread per call drains its responses (`bridge.py`), and the
requests flow through a `queue.Queue` that grpcio's sender thread reads. Cancelling a task
cancels its call and joins its thread (bounded), so SIGTERM ends every stream promptly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import trio

from stargate.control_plane.health import ProbeFailed, http_health_probe
from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from stargate.pylon.backoff import Backoff
from stargate.pylon.bridge import Outbox, ResponseReader, StreamEnded
from stargate.pylon.config import DialTarget, PylonConfig
from stargate.pylon.snapshot import (
    ReplicaInfo,
    WatchResult,
    build_registration,
    desired_replicas,
    parse_model_list,
    parse_watch_response,
    reachable_watches,
)

__all__ = ["HEARTBEAT_METADATA", "Pylon", "run_pylon"]

log = logging.getLogger("stargate.pylon")

HEARTBEAT_METADATA = "x-stargate-registration-heartbeat-ms"
BACKOFF_INITIAL_SECONDS = 0.1
BACKOFF_CAP_SECONDS = 5.0
STABLE_STREAM_SECONDS = 5.0
"""A registration stream that stayed up this long resets its backoff."""
HALF_CLOSE_GRACE_SECONDS = 0.5
"""On a deliberate close, how long the replica may take to end the stream after the half-close
before the call is cancelled."""
UPSTREAM_WAIT_POLL_SECONDS = 0.25


def _probe_timeout(config: PylonConfig) -> float:
    """Timeout of one engine request: twice the heartbeat, within [1 s, 5 s]."""
    return min(5.0, max(1.0, 2 * config.heartbeat_seconds))


async def probe_upstream(
    client: httpx.AsyncClient, base_url: str, paths: tuple[str, ...], seconds: float
) -> None:
    """Raise ProbeFailed unless the engine is healthy, judged exactly as the replica judges it."""
    await http_health_probe(client, base_url, seconds, paths)


def _channel(target: DialTarget, authority: str | None = None) -> grpc.Channel:
    options = [("grpc.default_authority", authority)] if authority else []
    if target.secure:
        return grpc.secure_channel(target.address, grpc.ssl_channel_credentials(), options)
    return grpc.insecure_channel(target.address, options)


@dataclass
class _Task:
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)


class Pylon:
    """One sidecar's state and tasks; `run` is the whole program."""

    def __init__(self, config: PylonConfig) -> None:
        self.config = config
        self.models: tuple[str, ...] = tuple(sorted(set(config.model_names)))
        self.healthy = False
        self._changed = trio.Event()
        self._results: dict[DialTarget, WatchResult] = {}
        self._watches: dict[DialTarget, _Task] = {}
        self._registrations: dict[ReplicaInfo, _Task] = {}
        self._closing: dict[ReplicaInfo, _Task] = {}  # cancelled, maybe still closing
        self._registered: set[ReplicaInfo] = set()
        self._nursery: trio.Nursery | None = None
        self._token: str | None = None
        self._models_failing = False

    # ------------------------------------------------------------------ public state

    @property
    def replicas(self) -> frozenset[ReplicaInfo]:
        """Replicas with a registration task (known through a kept watch)."""
        return frozenset(self._registrations)

    @property
    def registered(self) -> frozenset[ReplicaInfo]:
        """Replicas whose current stream has been acknowledged at least once."""
        return frozenset(self._registered)

    def registration(self) -> pb.InferenceServerRegistration:
        return build_registration(
            inference_server_id=self.config.inference_server_id,
            inference_server_url=self.config.upstream_url,
            cluster_id=self.config.cluster_id,
            models=self.models,
            healthy=self.healthy,
            now_unix_ms=int(time.time() * 1000),
        )

    def _notify_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ main

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        log.info(
            "pylon %r for %s: seeds %s, %s, heartbeat %d ms",
            config.inference_server_id,
            config.upstream_url,
            ", ".join(str(seed) for seed in config.stargates),
            f"models {list(self.models)}" if self.models else "models from GET /v1/models",
            config.min_update_interval_ms,
        )
        timeout = _probe_timeout(config)
        async with httpx.AsyncClient(timeout=timeout) as client:
            await self._wait_for_upstream(client)
            if not config.model_names:
                await self._refresh_models(client)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._health_loop, client)
                if not config.model_names:
                    nursery.start_soon(self._model_loop, client)
                self._reconcile()
                task_status.started()

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
            self._notify_changed()

    async def _model_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await trio.sleep(self.config.model_refresh_seconds)
            await self._refresh_models(client)

    # ------------------------------------------------------------------ discovery

    def _reconcile(self) -> None:
        """Start and stop watch and registration tasks to match the current snapshots."""
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
        replicas = desired_replicas(watches, self._results)
        for replica in list(self._registrations):
            if replica not in replicas:
                log.info("replica %s left discovery; closing its registration", replica.name)
                closing = self._closing[replica] = self._registrations.pop(replica)
                closing.scope.cancel()
        for replica in sorted(replicas - set(self._registrations), key=lambda r: r.authority):
            previous = self._closing.pop(replica, None)
            task = self._registrations[replica] = _Task()
            nursery.start_soon(self._register, replica, task, previous)

    async def _watch(self, url: DialTarget, task: _Task) -> None:
        backoff = Backoff(BACKOFF_INITIAL_SECONDS, BACKOFF_CAP_SECONDS)
        try:
            with task.scope:
                last_failure = ""
                while True:
                    end, received = await self._watch_once(url, backoff)
                    delay = backoff.next()
                    text = end.describe()
                    level = logging.DEBUG if text == last_failure else logging.WARNING
                    log.log(
                        level, "WatchStargates on %s: %s; reconnecting in %.2f s", url, text, delay
                    )
                    last_failure = "" if received else text
                    if self._watches.get(url) is task and url in self._results:
                        del self._results[url]
                        self._reconcile()  # drop the replicas known only through this watch
                    await trio.sleep(delay)
        finally:
            task.done.set()

    async def _watch_once(self, url: DialTarget, backoff: Backoff) -> tuple[StreamEnded, bool]:
        """Run one watch stream until it ends; return how, and whether anything arrived."""
        received = False
        channel = _channel(url)
        try:
            stub = pb_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            call = stub.WatchStargates(pb.WatchStargatesRequest())
            reader: ResponseReader[pb.WatchStargatesResponse] = ResponseReader(
                call, f"pylon-watch-{url}"
            )
            try:
                async for item in reader.receive:
                    if isinstance(item, StreamEnded):
                        return item, received
                    received = True
                    backoff.reset()
                    result = parse_watch_response(item)
                    if self._results.get(url) != result:
                        log.debug("WatchStargates on %s: %s", url, result)
                        self._results[url] = result
                        self._reconcile()
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
        backoff = Backoff(BACKOFF_INITIAL_SECONDS, BACKOFF_CAP_SECONDS)
        last_failure = ""
        try:
            with task.scope:
                if previous is not None:
                    await previous.done.wait()  # one stream per replica at a time
                while True:
                    started = trio.current_time()
                    end, acked = await self._register_once(replica)
                    if acked and trio.current_time() - started >= STABLE_STREAM_SECONDS:
                        backoff.reset()
                    delay = backoff.next()
                    text = end.describe()
                    if end.code == grpc.StatusCode.ALREADY_EXISTS:
                        text += " (another stream holds this id; it is free once that one ends)"
                    if acked:
                        log.warning(
                            "lost registration with replica %s: %s; reconnecting in %.2f s",
                            replica.name,
                            text,
                            delay,
                        )
                    elif text != last_failure:
                        log.warning(
                            "registration with replica %s failed: %s; retrying in %.2f s "
                            "(backing off up to %.0f s)",
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
                    await trio.sleep(delay)
        finally:
            task.done.set()

    async def _register_once(self, replica: ReplicaInfo) -> tuple[StreamEnded, bool]:
        """Run one registration stream until it ends; return how it ended and whether it was
        ever acknowledged. Cancellation half-closes the stream, then cancels it."""
        channel = _channel(replica.dial, replica.authority)
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
                    nursery.start_soon(self._send_snapshots, outbox)
                    async for item in reader.receive:
                        if isinstance(item, StreamEnded):
                            ended = True
                            nursery.cancel_scope.cancel()
                            return item, acked
                        if not acked:
                            acked = True
                            self._registered.add(replica)
                            log.info(
                                "registered with replica %s as %r (%d models, %s)",
                                replica.name,
                                self.config.inference_server_id,
                                len(self.models),
                                "ACTIVE" if self.healthy else "INACTIVE",
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

    async def _send_snapshots(self, outbox: Outbox[pb.InferenceServerRegistration]) -> None:
        while True:
            changed = self._changed
            outbox.put(self.registration())
            with trio.move_on_after(self.config.heartbeat_seconds):
                await changed.wait()


async def run_pylon(
    config: PylonConfig, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run a Pylon until cancelled. `task_status.started()` is reported once the initial
    upstream health wait (and model discovery) is over and the seed watches are starting."""
    await Pylon(config).run(task_status=task_status)
