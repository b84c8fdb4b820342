"""Pure pieces of the Pylon: the registration message, the engine's model list, the replica set
derived from WatchStargates snapshots, and the decisions that let a Pylon follow a fleet through
restarts (which registrations to start or stop, which replica a watch tries next).

Everything here is a function of its arguments, so the rules are unit-tested with plain values;
`sidecar.py` does the I/O and calls these. The rules (docs/pylon.md):

* a watch's last snapshot is kept while the watch reconnects: a stream ending says nothing
  about the replicas it listed;
* a seed's watch fails over to any other known replica when its own target fails
  (`watch_candidates`, `next_watch_target`), and the snapshot that answers is kept under the
  seed's key;
* a replica is dropped only when the latest snapshots no longer list it AND its registration
  stream is not up (`registration_changes`): a leaving replica stops listing itself but keeps
  its streams until it drains, and those must not be cut early.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from stargate.protocol import stargate_pb2 as pb
from stargate.pylon.config import (
    DEFAULT_STARGATE_PORT,
    DialTarget,
    PylonConfigError,
    parse_dial_target,
)
from stargate.pylon.kv_blocks import KvDelta
from stargate.routing.stats import ModelStats

__all__ = [
    "ReplicaInfo",
    "WatchResult",
    "attach_kv_delta",
    "build_registration",
    "desired_replicas",
    "model_stats_message",
    "next_watch_target",
    "parse_model_list",
    "parse_watch_response",
    "reachable_watches",
    "reappeared",
    "registration_changes",
    "split_host_port",
    "watch_candidates",
]

log = logging.getLogger(__name__)

ACTIVE = pb.INFERENCE_SERVER_STATUS_ACTIVE
INACTIVE = pb.INFERENCE_SERVER_STATUS_INACTIVE


def model_stats_message(stats: ModelStats) -> pb.ModelStats:
    """The wire form of one model's stats (the fields and their meaning are the same)."""
    return pb.ModelStats(
        last_mean_input_tps=stats.last_mean_input_tps,
        output_tps=stats.output_tps,
        queue_size=stats.queue_size,
        queued_input_size=stats.queued_input_size,
        max_output_tps=stats.max_output_tps,
        kv_cache_capacity_tokens=stats.kv_cache_capacity_tokens,
        kv_cache_used_tokens=stats.kv_cache_used_tokens,
        kv_cache_free_tokens=stats.kv_cache_free_tokens,
        num_running_queries=stats.num_running_queries,
        max_engine_concurrency=stats.max_engine_concurrency,
        total_query_input_size=stats.total_query_input_size,
        queue_time_estimate_ms_by_priority=dict(stats.queue_time_estimate_ms_by_priority),
        input_processing_queries=stats.input_processing_queries,
        output_generation_queries=stats.output_generation_queries,
        stats_observed_at_unix_ms=stats.stats_observed_at_unix_ms,
        stats_capabilities=list(stats.stats_capabilities),
        stats_sources=list(stats.stats_sources),
    )


def build_registration(
    *,
    inference_server_id: str,
    inference_server_url: str,
    cluster_id: str,
    models: Mapping[str, tuple[ModelStats, bool]],
) -> pb.InferenceServerRegistration:
    """The full snapshot sent on every heartbeat: each advertised model with its stats and
    whether it is ACTIVE (the engine healthy and its canary passing) or INACTIVE. Every model
    carries a `stats` message, since a registration without one reads as INACTIVE."""
    return pb.InferenceServerRegistration(
        inference_server_id=inference_server_id,
        inference_server_url=inference_server_url,
        cluster_id=cluster_id,
        models={
            model_id: pb.InferenceServerModelRegistration(
                stats=model_stats_message(stats), status=ACTIVE if active else INACTIVE
            )
            for model_id, (stats, active) in models.items()
        },
    )


def attach_kv_delta(message: pb.InferenceServerRegistration, delta: KvDelta) -> None:
    """Put one stream's KV-block delta on its registration message (our fields 1000-1002,
    docs/prefix-routing.md, "Precise mode"); an empty delta adds nothing to the wire."""
    if delta.reset:
        message.kv_blocks_reset = True
    if delta.added:
        message.kv_blocks_added.extend(delta.added)
    if delta.removed:
        message.kv_blocks_removed.extend(delta.removed)


def parse_model_list(body: Any) -> tuple[str, ...]:
    """Model ids of an OpenAI `GET /v1/models` answer (`{"data": [{"id": ...}, ...]}`), sorted and
    unique. Raises ValueError when the body is not of that shape."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError('expected a JSON object with a "data" list')
    ids: set[str] = set()
    for entry in body["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise ValueError('every "data" entry needs a string "id"')
        if entry["id"].strip():
            ids.add(entry["id"])
    return tuple(sorted(ids))


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """One registration target: `authority` is its advertise address (the gRPC `:authority`),
    `dial` where the channel connects (`grpc_pylon_dial_addr`, or the advertise address)."""

    authority: str
    dial: DialTarget
    stargate_id: str = field(default="", compare=False)  # for logs; not part of the identity

    @property
    def name(self) -> str:
        label = self.stargate_id or self.authority
        if self.dial.address != self.authority:
            return f"{label} ({self.authority} via {self.dial})"
        return label if label == self.authority else f"{label} ({self.authority})"


@dataclass(frozen=True, slots=True)
class WatchResult:
    """One WatchStargates response, parsed."""

    replicas: frozenset[ReplicaInfo]
    watch_urls: frozenset[DialTarget]


def _dial(text: str) -> DialTarget:
    try:
        return parse_dial_target(text, default_port=DEFAULT_STARGATE_PORT)
    except PylonConfigError:
        return DialTarget(text.strip())  # let grpc try whatever target syntax this is


def parse_watch_response(response: pb.WatchStargatesResponse) -> WatchResult:
    replicas: set[ReplicaInfo] = set()
    for info in response.stargates:
        authority = info.advertise_addr.strip()
        if not authority:
            continue
        dial_text = info.grpc_pylon_dial_addr.strip() or authority
        replicas.add(ReplicaInfo(authority, _dial(dial_text), info.stargate_id))
    urls: set[DialTarget] = set()
    for url in response.watch_stargate_urls:
        try:
            urls.add(parse_dial_target(url, default_port=DEFAULT_STARGATE_PORT))
        except PylonConfigError as error:
            log.warning("ignoring watch_stargate_urls entry: %s", error)
    return WatchResult(frozenset(replicas), frozenset(urls))


def reachable_watches(
    seeds: Iterable[DialTarget], results: Mapping[DialTarget, WatchResult]
) -> frozenset[DialTarget]:
    """The watch URLs to keep open: the seeds, and every URL announced (recursively) by a watch
    that is itself kept. An URL only announced by a dropped watch is no longer watched."""
    kept: set[DialTarget] = set()
    pending = list(seeds)
    while pending:
        url = pending.pop()
        if url in kept:
            continue
        kept.add(url)
        result = results.get(url)
        if result is not None:
            pending.extend(result.watch_urls - kept)
    return frozenset(kept)


def desired_replicas(
    watches: Iterable[DialTarget], results: Mapping[DialTarget, WatchResult]
) -> frozenset[ReplicaInfo]:
    """The union of the replicas in the current snapshot of every kept watch."""
    replicas: set[ReplicaInfo] = set()
    for url in watches:
        result = results.get(url)
        if result is not None:
            replicas |= result.replicas
    return frozenset(replicas)


def registration_changes(
    listed: frozenset[ReplicaInfo],
    running: Collection[ReplicaInfo],
    alive: Collection[ReplicaInfo],
) -> tuple[frozenset[ReplicaInfo], frozenset[ReplicaInfo]]:
    """`(start, stop)`: the registration tasks to start and to stop.

    `listed` is the union of the latest snapshots (`desired_replicas`), `running` the replicas
    with a registration task, `alive` those whose current stream has been acknowledged and is
    still up. A listed replica without a task gets one. A task is stopped only when its replica
    is unlisted AND its stream is not up: a leaving replica drops out of its own snapshots while
    it still serves, and a live stream is the best evidence that registering there is useful.
    The replica ends that stream itself when it drains; then the replica is dropped.

    The exception does not hold for a replica listed again under another dial address (same
    advertise address, new `grpc_pylon_dial_addr`): the old stream holds the engine's id there
    and would keep the new one out (ALREADY_EXISTS), so it is closed.
    """
    listed_authorities = {replica.authority for replica in listed}
    kept_alive = {replica for replica in alive if replica.authority not in listed_authorities}
    start = listed - frozenset(running)
    stop = frozenset(running) - listed - kept_alive
    return start, stop


def reappeared(old: WatchResult | None, new: WatchResult) -> frozenset[ReplicaInfo]:
    """Replicas `new` lists that the previous snapshot of the same watch did not: their
    registration tasks retry at once (the replica was just announced, so it is likely up)."""
    return new.replicas - (old.replicas if old is not None else frozenset())


def watch_candidates(
    key: DialTarget,
    seeds: Sequence[DialTarget],
    results: Mapping[DialTarget, WatchResult],
) -> tuple[DialTarget, ...]:
    """Where the watch kept under `key` may be opened, in the order to try them.

    First `key` itself, then the dial addresses of the replicas its own last snapshot listed
    (the same fleet, most likely to answer with the same view). A seed's watch then falls back to
    the other seeds and to every replica any kept snapshot lists: any replica of the fleet
    publishes the whole fleet, and a seed that is one replica (or a name that points at a
    restarting pod) must not leave the Pylon blind. A watch announced through
    `watch_stargate_urls` (another region) stays within its own snapshot: an answer from this
    region's replicas would replace that region's view with this one.
    """
    ordered: list[DialTarget] = [key]
    own = results.get(key)
    if own is not None:
        ordered.extend(sorted((replica.dial for replica in own.replicas), key=str))
    if key in seeds:
        ordered.extend(seeds)
        others = {
            replica.dial
            for url, result in results.items()
            if url != key
            for replica in result.replicas
        }
        ordered.extend(sorted(others, key=str))
    return tuple(dict.fromkeys(ordered))


def next_watch_target(
    candidates: Sequence[DialTarget], tried: Collection[DialTarget]
) -> DialTarget | None:
    """The first candidate not yet tried in this round, or None when the round is over (then
    the watch backs off before starting a new round with its own target)."""
    for candidate in candidates:
        if candidate not in tried:
            return candidate
    return None


def split_host_port(address: str) -> tuple[str, int] | None:
    """`(host, port)` of a `host:port` or `[v6]:port` dial address; None for anything else
    (a gRPC target syntax the Pylon passes through), which is then never TCP-probed."""
    try:
        parts = urlsplit(f"//{address}")
        host = parts.hostname
        port = parts.port
    except ValueError:
        return None
    if not host or port is None:
        return None
    return host, port
