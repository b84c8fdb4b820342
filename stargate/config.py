"""Frozen settings objects for every part of a replica.

The CLI turns flags and environment variables into these objects; the runtime and the parts only
ever see the objects. Validation that does not need the network (address syntax, ranges, the metric
prefix) happens here, so bad input fails before anything is bound or started.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from pathlib import Path

from stargate.addresses import AddressError, AddressProblem, format_host_port, parse_host_port
from stargate.prefix_key import DEFAULT_BLOCK_BYTES, DEFAULT_DEPTH, MAX_CAP_BYTES

__all__ = [
    "DEFAULT_MAX_CLIENT_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_BACKEND",
    "DEFAULT_METRICS_LISTEN_ADDR",
    "METRICS_FLAGS_CONFLICT",
    "ActivatorConfig",
    "ConfigError",
    "ControlPlaneConfig",
    "DemoConfig",
    "DiscoveryConfig",
    "ListenAddress",
    "PoolOwnershipConfig",
    "ProxyConfig",
    "SecretsConfig",
    "ServeConfig",
    "TlsConfig",
    "TracingConfig",
    "WarmupConfig",
    "describe",
    "parse_listen_address",
    "validate_metrics_prefix",
]


class ConfigError(ValueError):
    """A setting is malformed; the message says which value and what is expected."""


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """An `IP:port` socket address a listener binds to (port 0 picks a free port)."""

    host: str
    port: int

    def __str__(self) -> str:
        return format_host_port(self.host, self.port)


def parse_listen_address(text: str) -> ListenAddress:
    """Parse `IP:port` (`[v6]:port` for IPv6), as the Rust replica's socket-address parser does.

    Host names are refused: a listener binds to an interface address, and resolving a name at
    start-up would hide which interface was meant.
    """
    try:
        address = parse_host_port(text.strip(), names=False, min_port=0, ipv4_in_brackets=True)
    except AddressError as error:
        problems = error.problems
        if AddressProblem.SYNTAX in problems:
            raise ConfigError(
                f"{text!r} is not an IP:PORT socket address (e.g. 0.0.0.0:8000)"
            ) from None
        if AddressProblem.BRACKETS in problems:
            raise ConfigError(
                f"{text!r}: an IPv6 address must be written in brackets, e.g. [::]:8000"
            ) from None
        if AddressProblem.HOST in problems:
            raise ConfigError(f"{text!r}: {error.host!r} is not an IP address") from None
        raise ConfigError(f"{text!r}: port must be a number from 0 to 65535") from None
    return ListenAddress(host=address.host, port=address.port)


_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def validate_metrics_prefix(prefix: str) -> str:
    """Return `prefix` if metric names built from it are valid Prometheus names."""
    if prefix and not _METRIC_NAME.match(prefix):
        raise ConfigError(
            f"{prefix!r} cannot start a Prometheus metric name "
            "(letters, digits, '_' and ':' only, not starting with a digit)"
        )
    return prefix


PYLON_RECONNECT_WINDOW_MS = 1_000
"""The shortest stabilization window that covers a Pylon's worst reconnect to a replica that
accepts connections again (0.45 s, `stargate/pylon/backoff.py`) plus a registration round trip,
with a margin for a loaded node."""


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    """How `/readyz` warms up (docs/decisions.md, D2).

    `warmup_ms == 0` means ready at start with no sampler. Otherwise a sampler reads the total
    active backend count every `sample_interval_ms` and promotes once the last
    `stabilization_window` samples are equal and nonzero; `warmup_ms` is the deadline that promotes
    regardless.
    """

    warmup_ms: int = 60_000
    sample_interval_ms: int = 1_000
    stabilization_window: int = 5

    def __post_init__(self) -> None:
        if self.warmup_ms < 0:
            raise ConfigError("readiness warmup must not be negative")
        if self.sample_interval_ms <= 0:
            raise ConfigError("warmup sample interval must be greater than 0")
        if self.stabilization_window <= 0:
            raise ConfigError("warmup stabilization window must be greater than 0")

    @property
    def enabled(self) -> bool:
        return self.warmup_ms > 0

    @property
    def warmup_seconds(self) -> float:
        return self.warmup_ms / 1000

    @property
    def sample_interval_seconds(self) -> float:
        return self.sample_interval_ms / 1000

    @property
    def covers_pylon_reconnect(self) -> bool:
        """Whether the stabilization window (interval x window) outlasts a Pylon's reconnect to a
        restarted replica; a shorter one can promote before every backend is back
        (docs/pylon.md). True when warmup is off: then nothing is sampled."""
        window_ms = self.sample_interval_ms * self.stabilization_window
        return not self.enabled or window_ms >= PYLON_RECONNECT_WINDOW_MS


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """`stargate demo`: its replica's listeners and warmup (the CLI supplies defaults; the demo
    itself is stargate/demo.py)."""

    http_listen_addr: ListenAddress
    listen_addr: ListenAddress
    model_discovery_listen_addr: ListenAddress
    metrics_listen_addr: ListenAddress
    warmup: WarmupConfig
    engines: int = 2
    tunnel: str = "http"
    """How the replica reaches the Pylons: `http`, or a QUIC tunnel protocol (`raw-quic`,
    `http3`; docs/tunnels.md)."""
    tunnel_connectivity: str = "direct"
    """With a tunnel: `direct` (the replica dials) or `reverse` (the Pylons dial)."""


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """How `WatchStargates` finds this replica's peers (docs/control-plane.md, WatchStargates).

    Modes: a DNS name polled every `dns_poll_ms` (in Kubernetes, the headless Service), a static
    `peers` list, or this replica alone (`disable_dns_discovery`, or neither of the others set).
    Static peers are health-checked every `dns_poll_ms` and left out of `WatchStargates` once they
    have not answered for `peer_absent_after_ms` (0: never checked, always listed). Its default
    here is 0, so settings built in code (tests) touch no network; `stargate serve` (and
    `ServeConfig`'s default) uses the flag's default, 30 s.

    The one validation of these settings; `dns_name` and `grpc_pylon_dial_addr` are stored trimmed,
    with "" turned into None. What needs this replica's own addresses (the DNS name's syntax, each
    peer, folding self out of the peer list) is checked where they are known:
    `stargate.control_plane.discovery.PublisherConfig`.
    """

    dns_name: str | None = None
    peers: tuple[str, ...] = ()
    disable_dns_discovery: bool = False
    dns_poll_ms: int = 1_000
    watch_heartbeat_ms: int = 5_000
    remote_stargate_urls: tuple[str, ...] = ()
    grpc_pylon_dial_addr: str | None = None
    peer_absent_after_ms: int = 0

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # canonicalisation of a frozen dataclass
        set_(self, "dns_name", (self.dns_name or "").strip() or None)
        set_(self, "peers", tuple(self.peers))
        set_(self, "remote_stargate_urls", tuple(self.remote_stargate_urls))
        set_(self, "grpc_pylon_dial_addr", (self.grpc_pylon_dial_addr or "").strip() or None)
        if self.dns_poll_ms <= 0:
            raise ConfigError("DNS poll interval (--dns-poll-ms) must be greater than 0")
        if self.watch_heartbeat_ms < 0:
            raise ConfigError("watch heartbeat (--watch-heartbeat-ms) must not be negative")
        if self.peer_absent_after_ms < 0:
            raise ConfigError("peer absence (--peer-absent-after-ms) must not be negative")
        if self.disable_dns_discovery and self.peers:
            raise ConfigError("--peer cannot be combined with --disable-dns-discovery")
        if self.dns_name and self.peers:
            raise ConfigError("--peer cannot be combined with --stargate-discovery-dns-name")


def _serve_discovery_settings() -> DiscoveryConfig:
    """`ServeConfig`'s default: the `stargate serve` flags' defaults."""
    return DiscoveryConfig(peer_absent_after_ms=30_000)


@dataclass(frozen=True, slots=True)
class ControlPlaneConfig:
    """Registration streams: idle timeouts, message size, authentication, backend health."""

    idle_timeout_ms: int = 60_000
    max_idle_timeout_ms: int = 300_000
    grpc_max_message_bytes: int = 4 * 1024 * 1024
    worker_auth_endpoint: str | None = None
    registration_token_file: Path | None = None
    health_check_timeout_ms: int = 5_000
    # How the replica authenticates itself to the worker-auth gateway (docs/worker-auth.md): a
    # bearer from the secrets file (`ServeConfig.secrets`), or one minted by OAuth2 client
    # credentials at `<oauth2_provider_host>/token`; TLS to the gateway with `worker_auth_ca_file`
    # (or an `https://` endpoint, trusting the system store).
    oauth2_provider_host: str | None = None
    worker_auth_ca_file: Path | None = None

    def __post_init__(self) -> None:
        if self.idle_timeout_ms < 0 or self.max_idle_timeout_ms < 0:
            raise ConfigError("registration idle timeouts must not be negative")
        if self.grpc_max_message_bytes <= 0:
            raise ConfigError("gRPC max message size must be greater than 0")
        if self.health_check_timeout_ms <= 0:
            raise ConfigError("health check timeout must be greater than 0")
        if self.worker_auth_endpoint and self.registration_token_file:
            raise ConfigError(
                "--worker-auth-endpoint cannot be combined with --registration-token-file"
            )
        if self.worker_auth_ca_file and not self.worker_auth_endpoint:
            raise ConfigError("--worker-auth-ca-file requires --worker-auth-endpoint")
        if self.worker_auth_ca_file and (self.worker_auth_endpoint or "").startswith("http://"):
            raise ConfigError(
                "--worker-auth-ca-file dials the gateway over TLS, but --worker-auth-endpoint "
                "says http://: use https:// or HOST:PORT"
            )
        if self.oauth2_provider_host is not None:
            host = self.oauth2_provider_host
            if not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", host):
                raise ConfigError(
                    f"--oauth2-provider-host must be an http:// or https:// URL, got {host!r}"
                )


@dataclass(frozen=True, slots=True)
class SecretsConfig:
    """The replica's own secrets file (`--secrets-path`, JSON; Kubernetes mounts and rotates it):
    the worker-auth bearer at the dot-separated `json_path` (or, with `--oauth2-provider-host`,
    the OAuth2 client credentials `clientId` / `clientSecret`), and the tracing exporter's
    `tracingAccessToken`. Read when needed and re-read when it changes; never logged."""

    path: Path | None = None
    json_path: str = "authToken"

    def __post_init__(self) -> None:
        if not self.json_path or any(not part for part in self.json_path.split(".")):
            raise ConfigError(
                f"--secrets-json-path must be dot-separated keys (like authToken or "
                f"nvcf.apiToken), got {self.json_path!r}"
            )

    @property
    def json_keys(self) -> tuple[str, ...]:
        return tuple(self.json_path.split("."))


TLS_KEY_REQUIRED = "--tls-key-path is required with --tls-cert-path"
TLS_CERT_REQUIRED = "--tls-cert-path is required with --tls-key-path"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """The replica's TLS identity, served on the HTTP and both gRPC listeners (docs/tls.md).

    Both paths or neither (`TlsConfig.of`); the pair is re-read every `reload_interval_ms` and a
    changed, valid pair replaces the served one for new handshakes.
    """

    cert_path: Path
    key_path: Path
    reload_interval_ms: int = 30_000

    def __post_init__(self) -> None:
        if self.reload_interval_ms <= 0:
            raise ConfigError("--tls-reload-interval-ms must be greater than 0")

    @classmethod
    def of(
        cls, cert_path: Path | None, key_path: Path | None, reload_interval_ms: int = 30_000
    ) -> TlsConfig | None:
        """The identity named by the two flags: None without both, an error with one."""
        if cert_path is None and key_path is None:
            return None
        if key_path is None:
            raise ConfigError(TLS_KEY_REQUIRED)
        if cert_path is None:
            raise ConfigError(TLS_CERT_REQUIRED)
        return cls(cert_path, key_path, reload_interval_ms)

    @property
    def reload_interval_seconds(self) -> float:
        return self.reload_interval_ms / 1000


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry tracing (docs/tracing.md): spans are exported over OTLP/gRPC to `endpoint`
    when it is set; without it nothing is recorded and `traceparent` passes through untouched."""

    endpoint: str | None = None
    service_name: str = "stargate"

    def __post_init__(self) -> None:
        if self.endpoint is not None and not re.fullmatch(r"https?://[^\s/]+/?", self.endpoint):
            raise ConfigError(
                "--otel-endpoint must be an OTLP/gRPC collector URL such as "
                f"http://otel-collector:4317, got {self.endpoint!r}"
            )
        if not self.service_name.strip():
            raise ConfigError("--otel-service-name must not be empty")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


DEFAULT_MAX_CONNECTIONS_PER_BACKEND = 1024
"""`--proxy-max-connections-per-backend`: upstream connections (so concurrent requests and
streams) one backend may have open. Engines (vLLM, SGLang, TensorRT-LLM) batch hundreds of
sequences at once, and a request holds its connection for its whole stream, so the cap must not
sit below what one engine serves; it only guards the replica's descriptors against a runaway
(docs/data-plane.md, "Per-backend connections")."""


DEFAULT_LOADING_COMMENT_INTERVAL_MS = 5_000
"""`--loading-comment-interval-ms`: a held streaming request gets a comment this often, half of
the shortest idle read timeout seen in clients (10 s), so one late comment is still in time."""


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """The data plane: retries, replay, upstream timeouts and connections, load balancing,
    OpenAI mode."""

    max_connect_retries: int = 2
    max_request_retries: int = 2
    max_replay_body_bytes: int = 64 * 1024 * 1024
    require_pylon_retry_signal: bool = True
    retry_budget_header: str | None = "x-stargate-max-wait-ms"
    response_header_timeout_ms: int = 30_000
    connect_timeout_ms: int = 5_000
    accept_openai_requests: bool = False
    lb_config_path: Path | None = None
    upstream_ca_file: Path | None = None
    max_connections_per_backend: int = DEFAULT_MAX_CONNECTIONS_PER_BACKEND
    # docs/data-plane.md, "Derived affinity keys" (stargate/prefix_key.py).
    derive_affinity_key: bool = False
    derive_affinity_key_block_bytes: int = DEFAULT_BLOCK_BYTES
    derive_affinity_key_depth: int = DEFAULT_DEPTH
    # docs/pylon-data-path.md, "Unmeasured backends" (stargate/routing/state.py).
    estimate_unmeasured_backends: bool = True
    # docs/clients.md, "Held streaming requests" (stargate/proxy/loading.py).
    loading_comments: bool = True
    loading_comment_interval_ms: int = DEFAULT_LOADING_COMMENT_INTERVAL_MS
    # docs/outliers.md (stargate/routing/outliers.py, stargate/routing/slow_start.py).
    outlier_consecutive_failures: int = 5
    outlier_base_ejection_ms: int = 30_000
    outlier_max_ejection_ms: int = 300_000
    outlier_max_ejection_percent: int = 10
    outlier_decay_interval_ms: int = 10_000
    slow_start_window_ms: int = 30_000
    slow_start_aggression: float = 1.0
    slow_start_min_weight_percent: float = 10.0

    def __post_init__(self) -> None:
        _check_outliers_and_slow_start(self)
        for flag, value in (
            ("--derive-affinity-key-block-bytes", self.derive_affinity_key_block_bytes),
            ("--derive-affinity-key-depth", self.derive_affinity_key_depth),
        ):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        cover = self.derive_affinity_key_block_bytes * self.derive_affinity_key_depth
        if cover > MAX_CAP_BYTES:
            raise ConfigError(
                "--derive-affinity-key-block-bytes x --derive-affinity-key-depth must be at most "
                f"{MAX_CAP_BYTES} bytes, got {cover}"
            )
        if self.max_connections_per_backend < 1:
            raise ConfigError(
                "--proxy-max-connections-per-backend must be at least 1, got "
                f"{self.max_connections_per_backend}"
            )
        interval = self.loading_comment_interval_ms
        if not 100 <= interval < 10_000:
            raise ConfigError(
                "--loading-comment-interval-ms must be at least 100 and below 10000 (idle read "
                f"timeouts of 10 s are common), got {interval}"
            )
        for name in ("max_connect_retries", "max_request_retries", "max_replay_body_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', ' ')} must not be negative")
        if self.response_header_timeout_ms <= 0 or self.connect_timeout_ms <= 0:
            raise ConfigError("upstream timeouts must be greater than 0")
        header = self.retry_budget_header
        if header is not None and not _HEADER_NAME.match(header):
            raise ConfigError(f"invalid proxy retry budget header: {header!r}")


def _check_outliers_and_slow_start(config: ProxyConfig) -> None:
    """The outlier-ejection and slow-start flags (docs/outliers.md); each message names its flag."""
    for flag, value in (
        ("--outlier-consecutive-failures", config.outlier_consecutive_failures),
        ("--slow-start-window-ms", config.slow_start_window_ms),
    ):
        if value < 0:
            raise ConfigError(f"{flag} must not be negative, got {value}")
    for flag, value in (
        ("--outlier-base-ejection-ms", config.outlier_base_ejection_ms),
        ("--outlier-decay-interval-ms", config.outlier_decay_interval_ms),
    ):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if config.outlier_max_ejection_ms < config.outlier_base_ejection_ms:
        raise ConfigError(
            "--outlier-max-ejection-ms must be at least --outlier-base-ejection-ms, got "
            f"{config.outlier_max_ejection_ms} < {config.outlier_base_ejection_ms}"
        )
    for flag, percent in (
        ("--outlier-max-ejection-percent", config.outlier_max_ejection_percent),
        ("--slow-start-min-weight-percent", config.slow_start_min_weight_percent),
    ):
        if not 0 <= percent <= 100:
            raise ConfigError(f"{flag} must be within 0..100, got {percent}")
    if not config.slow_start_aggression > 0:
        raise ConfigError(
            f"--slow-start-aggression must be greater than 0, got {config.slow_start_aggression}"
        )


@dataclass(frozen=True, slots=True)
class PoolOwnershipConfig:
    """Who runs each pool's activator when several replicas share the pools
    (docs/pool-ownership.md).

    `mode`: `local` (this replica decides for every pool: one replica, or the process
    controller) or `lease` (one `coordination.k8s.io/v1` Lease per pool, named
    `<lease_prefix>-pool-<pool>` in `lease_namespace`; the holder decides, the other replicas
    hand it their requests for the pool at `owner_url`). Timings as client-go's leader election:
    a holder renews every `retry_period_ms`, stops deciding when a renewal has not succeeded for
    `renew_deadline_ms`, and a lease not renewed for `lease_duration_ms` may be taken over.
    """

    mode: str = "local"
    lease_namespace: str | None = None
    lease_prefix: str = "stargate"
    lease_duration_ms: int = 15_000
    renew_deadline_ms: int = 10_000
    retry_period_ms: int = 2_000
    owner_url: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("local", "lease"):
            raise ConfigError(f"--pool-ownership must be local or lease, got {self.mode!r}")
        if not (0 < self.retry_period_ms < self.renew_deadline_ms < self.lease_duration_ms):
            raise ConfigError(
                "pool lease timings must satisfy 0 < --pool-lease-retry-period-ms < "
                "--pool-lease-renew-deadline-ms < --pool-lease-duration-ms (a holder must stop "
                "deciding before its lease can expire), got "
                f"{self.retry_period_ms} / {self.renew_deadline_ms} / {self.lease_duration_ms}"
            )
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", self.lease_prefix):
            raise ConfigError(
                "--pool-lease-prefix must be a DNS label of at most 40 characters (lower-case "
                f"letters, digits, '-'), got {self.lease_prefix!r}"
            )
        if self.owner_url is not None and not re.fullmatch(r"https?://[^\s/]+/?", self.owner_url):
            raise ConfigError(
                "--pool-owner-url must be this replica's HTTP listener as its peers reach it, "
                f"like http://10.0.0.7:8000, got {self.owner_url!r}"
            )


@dataclass(frozen=True, slots=True)
class ActivatorConfig:
    """Model pools (the activator): the pool file, the activator's timing, and who owns each
    pool when several replicas share them."""

    pool_config_path: Path | None = None
    resync_interval_ms: int = 5_000
    controller_timeout_ms: int = 10_000
    ownership: PoolOwnershipConfig = PoolOwnershipConfig()
    # A member's breaker (docs/activator.md, "Breaker"): opens after this many failed swaps in a
    # row (0: off), for the cooldown (doubled per failed probe, up to 8 x).
    breaker_failures: int = 3
    breaker_cooldown_ms: int = 30_000

    def __post_init__(self) -> None:
        if self.resync_interval_ms <= 0 or self.controller_timeout_ms <= 0:
            raise ConfigError("pool resync interval and controller timeout must be > 0")
        if self.breaker_failures < 0:
            raise ConfigError("--pool-breaker-failures must be >= 0 (0 turns the breaker off)")
        if self.breaker_cooldown_ms <= 0:
            raise ConfigError("--pool-breaker-cooldown-ms must be > 0")
        if self.ownership.mode == "lease" and self.pool_config_path is None:
            raise ConfigError("--pool-ownership=lease requires --pool-config")


DEFAULT_MAX_CLIENT_CONNECTIONS: int | None = None
"""`--max-client-connections`: None (`auto`) computes the cap at start-up from the raised
open-file limit, two descriptors per connection after the probe reserve and headroom
(`stargate.http_limits.connection_cap`; docs/http-serving.md, "Limits")."""

_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")

DEFAULT_METRICS_LISTEN_ADDR = ListenAddress("0.0.0.0", 9090)
"""The metrics listener's default: every interface, as the Rust replica binds it."""

METRICS_FLAGS_CONFLICT = (
    "--metrics-port cannot be combined with --metrics-listen-addr: give only "
    "--metrics-listen-addr (--metrics-port is the older flag; it sets the port of the default "
    "metrics address)"
)


# ---------------------------------------------------------------------------------------------
# QUIC tunnels (docs/tunnels.md). The names, defaults and refusals are the Rust binaries'
# (`--tunnel-protocol`, `--backend-connectivity`, `--direct-quic-connections`, the
# `--reverse-tunnel-*` and `--quic-*` flags): replicas and Pylons must be given the same protocol
# and connectivity, since nothing on the wire negotiates them but ALPN.


class TunnelProtocol(enum.Enum):
    RAW_QUIC = "raw-quic"
    HTTP3 = "http3"

    @property
    def alpn(self) -> list[str] | None:
        """raw-quic negotiates no ALPN at all; http3 negotiates `h3` (the Rust lists)."""
        return None if self is TunnelProtocol.RAW_QUIC else ["h3"]


class Connectivity(enum.Enum):
    DIRECT = "direct"
    REVERSE = "reverse"


_ALIASES = {
    "raw-quic": TunnelProtocol.RAW_QUIC,
    "http3": TunnelProtocol.HTTP3,
    "h3": TunnelProtocol.HTTP3,
}
_WEBTRANSPORT = ("webtransport", "web-transport", "wt")
_LEGACY = ("custom", "custom-quic")


def parse_tunnel_protocol(value: str) -> TunnelProtocol:
    """`raw-quic`, `http3` (alias `h3`); WebTransport and the legacy names are refused with what
    to use instead. The ValueError's message does not name the flag: the command line's usage
    error does (stargate/settings.py)."""
    name = value.strip().lower()
    if name in _ALIASES:
        return _ALIASES[name]
    if name in _WEBTRANSPORT:
        raise ConfigError(
            "webtransport is not offered yet: use raw-quic or http3 "
            "(on both the replicas and the Pylons)"
        )
    if name in _LEGACY:
        raise ConfigError(f"{value} is a retired name: use raw-quic (the same wire format)")
    raise ConfigError(f"must be raw-quic or http3, got {value!r}")


@dataclass(frozen=True, slots=True)
class TunnelConfig:
    """A replica's tunnels: how it dials direct backends and whether it listens for reverse ones.

    `cert_path`/`key_path` are the QUIC pair (`--quic-tls-cert-path`/`--quic-tls-key-path`, what
    the Rust replica calls `--tls-cert-path`/`--tls-key-path`): the reverse listener's identity,
    and the certificates trusted when dialing a direct backend. Without a pair the listener serves
    a generated self-signed identity (SANs `localhost`, `stargate`), and dialing needs `insecure`.
    Apart from the HTTP and gRPC listeners' pair (`TlsConfig`), so that verified tunnels do not
    force TLS on the client-facing listeners, nor the reverse.
    """

    protocol: TunnelProtocol = TunnelProtocol.RAW_QUIC
    connectivity: Connectivity = Connectivity.DIRECT
    direct_connections: int = 1
    reverse_listen_addr: ListenAddress | None = None
    reverse_pylon_dial_addr: str | None = None
    reverse_connect_timeout_ms: int = 10_000
    connect_timeout_ms: int = 2_000
    request_timeout_ms: int = 30_000
    insecure: bool = False
    cert_path: Path | None = None
    key_path: Path | None = None
    reload_interval_ms: int = 30_000

    def __post_init__(self) -> None:
        if self.cert_path is not None and self.key_path is None and self.reverse:
            raise ConfigError("--quic-tls-key-path is required with --quic-tls-cert-path")
        if self.key_path is not None and self.cert_path is None:
            raise ConfigError("--quic-tls-cert-path is required with --quic-tls-key-path")
        if self.direct_connections <= 0:
            raise ConfigError("--direct-quic-connections must be greater than 0")
        if self.connectivity is Connectivity.REVERSE:
            if not self.reverse_listen_addr:
                raise ConfigError(
                    "--backend-connectivity reverse requires --reverse-tunnel-listen-addr"
                )
        else:
            if self.reverse_listen_addr:
                raise ConfigError(
                    "--reverse-tunnel-listen-addr needs --backend-connectivity reverse"
                )
            if self.reverse_pylon_dial_addr:
                raise ConfigError(
                    "--reverse-tunnel-pylon-dial-addr needs --backend-connectivity reverse"
                )

    @property
    def reverse(self) -> bool:
        return self.connectivity is Connectivity.REVERSE

    @property
    def can_dial(self) -> bool:
        """Whether direct (`quic://`) backends can be dialed: their certificate is checked against
        `--quic-tls-cert-path`, or not at all with `--quic-insecure`."""
        return self.insecure or self.cert_path is not None

    @property
    def connect_timeout(self) -> float:
        return self.connect_timeout_ms / 1000

    @property
    def request_timeout(self) -> float:
        return self.request_timeout_ms / 1000

    @property
    def reverse_connect_timeout(self) -> float:
        return self.reverse_connect_timeout_ms / 1000


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `stargate serve` needs to run one replica.

    `metrics_port` is the older way to choose the metrics listener (`--metrics-port`): when given
    it becomes `metrics_listen_addr` (`0.0.0.0:PORT`) and reads back as None; giving it with a
    non-default `metrics_listen_addr` is an error. `debug_endpoints` serves `/debug/state`.
    `request_body_timeout_ms` and `max_client_connections` are the HTTP listener's client limits
    (0 disables each; `max_client_connections` None is computed at start-up;
    stargate/http_limits.py).
    """

    stargate_id: str
    http_listen_addr: ListenAddress = ListenAddress("0.0.0.0", 8000)
    listen_addr: ListenAddress = ListenAddress("0.0.0.0", 50071)
    model_discovery_listen_addr: ListenAddress = ListenAddress("0.0.0.0", 50073)
    advertise_addr: ListenAddress | None = None
    metrics_listen_addr: ListenAddress = DEFAULT_METRICS_LISTEN_ADDR
    metrics_port: int | None = None
    metrics_prefix: str = "stargate_"
    debug_endpoints: bool = True
    shutdown_delay_ms: int = 5_000
    shutdown_drain_timeout_ms: int = 30_000
    request_body_timeout_ms: int = 30_000
    max_client_connections: int | None = DEFAULT_MAX_CLIENT_CONNECTIONS
    warmup: WarmupConfig = WarmupConfig()
    discovery: DiscoveryConfig = field(default_factory=_serve_discovery_settings)
    control_plane: ControlPlaneConfig = field(default_factory=ControlPlaneConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    activator: ActivatorConfig = field(default_factory=ActivatorConfig)
    tls: TlsConfig | None = None
    tunnels: TunnelConfig = TunnelConfig()
    secrets: SecretsConfig = SecretsConfig()
    tracing: TracingConfig = TracingConfig()

    def __post_init__(self) -> None:
        if not self.stargate_id:
            raise ConfigError("stargate id must not be empty")
        if self.metrics_port is not None:
            # The older spelling (--metrics-port): the port on the default host, folded in here so
            # the runtime only ever reads `metrics_listen_addr`.
            if not 0 <= self.metrics_port <= 65535:
                raise ConfigError("metrics port (--metrics-port) must be from 0 to 65535")
            if self.metrics_listen_addr != DEFAULT_METRICS_LISTEN_ADDR:
                raise ConfigError(METRICS_FLAGS_CONFLICT)
            set_ = object.__setattr__  # canonicalisation of a frozen dataclass
            set_(self, "metrics_listen_addr", ListenAddress("0.0.0.0", self.metrics_port))
            set_(self, "metrics_port", None)
        if self.shutdown_drain_timeout_ms < 0:
            raise ConfigError("shutdown drain timeout must not be negative")
        if self.shutdown_delay_ms < 0:
            raise ConfigError("shutdown delay must not be negative")
        if self.request_body_timeout_ms < 0:
            raise ConfigError("--request-body-timeout-ms must not be negative (0 disables it)")
        if self.max_client_connections is not None and self.max_client_connections < 0:
            raise ConfigError("--max-client-connections must not be negative (0 = unlimited)")
        validate_metrics_prefix(self.metrics_prefix)
        if self.control_plane.oauth2_provider_host and self.secrets.path is None:
            raise ConfigError(
                "--oauth2-provider-host requires --secrets-path (SECRETS_PATH): the file holds "
                "the OAuth2 client credentials"
            )

    @property
    def shutdown_drain_timeout_seconds(self) -> float:
        return self.shutdown_drain_timeout_ms / 1000

    @property
    def shutdown_delay_seconds(self) -> float:
        return self.shutdown_delay_ms / 1000

    @property
    def request_body_timeout_seconds(self) -> float | None:
        """None when the request body time is not limited."""
        return self.request_body_timeout_ms / 1000 or None


def describe(config: object) -> str:
    """`key=value` pairs of a (nested) config dataclass, for the one start-up log line: nested
    configs are flattened so the line reads as one list of settings, but a `ListenAddress` is a
    value (`host:port`), not a config."""
    assert dataclasses.is_dataclass(config)
    parts = []
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, ListenAddress):
            parts.append(describe(value))
        else:
            parts.append(f"{item.name}={value}")
    return " ".join(parts)
