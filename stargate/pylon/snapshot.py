"""Pure pieces of the Pylon: the registration message, the engine's model list, and the
replica set derived from WatchStargates snapshots."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stargate.protocol import stargate_pb2 as pb
from stargate.pylon.config import (
    DEFAULT_STARGATE_PORT,
    DialTarget,
    PylonConfigError,
    parse_dial_target,
)

__all__ = [
    "ReplicaInfo",
    "WatchResult",
    "build_registration",
    "desired_replicas",
    "parse_model_list",
    "parse_watch_response",
    "reachable_watches",
]

log = logging.getLogger(__name__)

ACTIVE = pb.INFERENCE_SERVER_STATUS_ACTIVE
INACTIVE = pb.INFERENCE_SERVER_STATUS_INACTIVE


def build_registration(
    *,
    inference_server_id: str,
    inference_server_url: str,
    cluster_id: str,
    models: Iterable[str],
    healthy: bool,
    now_unix_ms: int,
) -> pb.InferenceServerRegistration:
    """The full snapshot sent on every heartbeat: every model ACTIVE while the engine is
    healthy, INACTIVE otherwise, each with a `ModelStats` (the Pylon knows no engine counters,
    so everything but the observation time is 0; a missing `stats` would read as INACTIVE)."""
    status = ACTIVE if healthy else INACTIVE
    return pb.InferenceServerRegistration(
        inference_server_id=inference_server_id,
        inference_server_url=inference_server_url,
        cluster_id=cluster_id,
        models={
            model_id: pb.InferenceServerModelRegistration(
                stats=pb.ModelStats(stats_observed_at_unix_ms=now_unix_ms), status=status
            )
            for model_id in models
        },
    )


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
