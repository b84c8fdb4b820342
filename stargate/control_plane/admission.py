"""Admission and identity rules of a registration stream, as pure functions.

docs/control-plane.md, "Admission" and "Idle timeout"; the transports: docs/decisions.md, D3, and
docs/tunnels.md. A registration is one of three kinds: `quic://IP:port` (a direct tunnel: the Rust
rules, an IP literal and an explicit port), `http(s)://` with `reverse_tunnel` (the Pylon dials the
replica's reverse listener, which must be configured), or `http(s)://` without it (our extension:
the replica forwards over HTTP; host names are accepted as well as IP literals, since an HTTP
client resolves them).
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit

from stargate.addresses import ip_literal, is_host_name
from stargate.grpc_asgi import GrpcError, GrpcStatus
from stargate.protocol import stargate_pb2 as pb
from stargate.routing import BackendRoute, ModelStats, RegistrationIdentity

__all__ = [
    "admit",
    "bearer_token",
    "check_identity",
    "negotiate_idle_timeout",
    "routes_for_update",
    "stats_from_wire",
]

log = logging.getLogger(__name__)

HEARTBEAT_HEADER = "x-stargate-registration-heartbeat-ms"
SUPPORTED_SCHEMES = ("http", "https")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _invalid(message: str) -> GrpcError:
    return GrpcError(GrpcStatus.INVALID_ARGUMENT, message)


def _invalid_url(reason: str) -> GrpcError:
    return _invalid(f"invalid inference_server_url: inference_server_url {reason}")


def validate_backend_url(url: str, reverse_tunnel: bool = False) -> None:
    """Raise INVALID_ARGUMENT unless `url` is a backend URL this replica can reach: `quic://` with
    an IP literal and a port (direct tunnel, not with `reverse_tunnel`), or absolute http(s)."""
    if not _SCHEME.match(url):
        raise _invalid_url("must be a valid URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise _invalid_url("must be a valid URL") from None
    scheme = parts.scheme.lower()
    if reverse_tunnel:
        if scheme not in SUPPORTED_SCHEMES:
            raise _invalid_url("scheme must be http or https")
    elif scheme != "quic" and scheme not in SUPPORTED_SCHEMES:
        raise _invalid_url("scheme must be quic, http or https")
    if not parts.hostname:
        raise _invalid_url("must include host")
    if not _valid_host(parts.netloc):
        raise _invalid_url("must be a valid URL")
    if scheme == "quic":
        if ip_literal(parts.hostname) is None:
            raise _invalid_url("host must be an IP address")
        if port is None:
            raise _invalid_url("must include port")


def _valid_host(netloc: str) -> bool:
    """Whether the authority's host is an IP literal or a DNS name. `urlsplit` is lenient: it
    keeps a space inside a host and drops text after an IPv6 literal's `]`, so `http://pyl on`
    and `http://[::1]junk:80` would otherwise be admitted and fail only at connect time."""
    host_port = netloc.rpartition("@")[2]
    if host_port.startswith("["):
        end = host_port.find("]")
        rest = host_port[end + 1 :]
        return end > 0 and ip_literal(host_port[1:end]) is not None and (not rest or rest[0] == ":")
    host = host_port.partition(":")[0]
    return is_host_name(host) or ip_literal(host) is not None


def admit(
    message: pb.InferenceServerRegistration,
    routing_key: str | None,
    reverse_listener: bool = False,
) -> RegistrationIdentity:
    """Check a stream's first message (docs/control-plane.md, Admission) and derive its identity.
    `reverse_listener`: this replica listens for reverse tunnels."""
    if not message.inference_server_id:
        raise _invalid("inference_server_id is empty")
    if not message.inference_server_url:
        raise _invalid("inference_server_url is empty")
    validate_backend_url(message.inference_server_url, message.reverse_tunnel)
    if message.reverse_tunnel and not reverse_listener:
        raise _invalid("reverse tunnel flag set but no reverse tunnel config")
    return RegistrationIdentity(
        inference_server_id=message.inference_server_id,
        cluster_id=message.cluster_id or message.inference_server_id,
        url=message.inference_server_url,
        routing_key=routing_key,
        reverse_tunnel=message.reverse_tunnel,
    )


def check_identity(message: pb.InferenceServerRegistration, identity: RegistrationIdentity) -> None:
    """Every message must keep the admitted identity (checked in the Rust order)."""
    if message.reverse_tunnel != identity.reverse_tunnel:
        raise _invalid("reverse tunnel flag changed")
    if message.inference_server_url != identity.url:
        raise _invalid("inference_server_url changed")
    if message.inference_server_id != identity.inference_server_id:
        raise _invalid("inference_server_id changed")
    if (message.cluster_id or message.inference_server_id) != identity.cluster_id:
        raise _invalid("cluster_id changed")


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `authorization: Bearer <token>` header (exact, case-sensitive prefix)."""
    if authorization is None or not authorization.startswith("Bearer "):
        return None
    return authorization[len("Bearer ") :]


def negotiate_idle_timeout(header: str | None, floor_ms: int, cap_ms: int) -> float | None:
    """Seconds a stream may stay silent (docs/control-plane.md, Idle timeout); None = forever.

    Any zero flag disables idle enforcement. Without a usable heartbeat header the cap applies;
    otherwise min(max(3 x heartbeat, floor), cap): the cap wins even when it is below the floor.
    """
    if floor_ms == 0 or cap_ms == 0:
        return None
    if header is None:
        return cap_ms / 1000
    if not header.isascii() or not header.isdigit():
        log.warning("malformed %s header %r; using the idle timeout cap", HEARTBEAT_HEADER, header)
        return cap_ms / 1000
    return min(max(3 * int(header), floor_ms), cap_ms) / 1000


def stats_from_wire(stats: pb.ModelStats) -> ModelStats:
    """The routing state's immutable copy of a wire `ModelStats`."""
    return ModelStats(
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
        queue_time_estimate_ms_by_priority=tuple(
            sorted(stats.queue_time_estimate_ms_by_priority.items())
        ),
        input_processing_queries=stats.input_processing_queries,
        output_generation_queries=stats.output_generation_queries,
        stats_observed_at_unix_ms=stats.stats_observed_at_unix_ms,
        stats_capabilities=tuple(stats.stats_capabilities),
        stats_sources=tuple(stats.stats_sources),
    )


def routes_for_update(
    message: pb.InferenceServerRegistration, rtt_ns: int | None, received_at: float
) -> dict[str, BackendRoute | None]:
    """Each listed model's effective status: a route, or None if not routable.

    docs/control-plane.md, Model status.

    Missing stats force INACTIVE; UNKNOWN and unknown enum numbers are not routable; an ACTIVE
    model without an RTT (the backend's health check failed) is not routable either.
    """
    routes: dict[str, BackendRoute | None] = {}
    for model_id, model in message.models.items():
        route: BackendRoute | None = None
        if not model.HasField("stats"):
            log.warning(
                "missing model stats in registration; setting model status to inactive "
                "(inference_server_id=%s model=%s)",
                message.inference_server_id,
                model_id,
            )
        elif model.status == pb.INFERENCE_SERVER_STATUS_ACTIVE:
            if rtt_ns is None:
                log.warning(
                    "active model registration missing connection RTT (the backend health "
                    "check has not passed); model applied as not routable "
                    "(inference_server_id=%s model=%s)",
                    message.inference_server_id,
                    model_id,
                )
            else:
                route = BackendRoute(stats_from_wire(model.stats), rtt_ns, received_at)
        routes[model_id] = route
    return routes
