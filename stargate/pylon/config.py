"""The Pylon's frozen settings and the pure parsing of its addresses.

`PylonConfig` is what `run_pylon` needs; the CLI builds it from flags. Parsing that needs no
network (URL schemes, `HOST:PORT` syntax, ranges) lives here so bad input fails at start-up.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from stargate.addresses import canonical_host, format_host_port, ip_literal, is_host_name
from stargate.config import ListenAddress, TunnelProtocol
from stargate.health_probe import DEFAULT_HEALTH_PATHS
from stargate.protocol.kv_events import parse_tcp_endpoint
from stargate.pylon.bringup import CalibrationConfig
from stargate.pylon.kv_blocks import DEFAULT_MAX_BLOCKS
from stargate.pylon.stats.admission import AdmissionConfig

__all__ = [
    "DEFAULT_HEALTH_PATHS",
    "DEFAULT_LISTEN_ADDR",
    "DEFAULT_STARGATE_PORT",
    "ENGINE_STATS_STREAM_MODES",
    "UPSTREAM_BACKENDS",
    "BringupConfig",
    "DialTarget",
    "PylonConfig",
    "PylonConfigError",
    "RequestPathConfig",
    "SideChannelConfig",
    "default_inference_server_id",
    "parse_dial_target",
    "parse_upstream_url",
]

DEFAULT_STARGATE_PORT = 50071
DEFAULT_LISTEN_ADDR = ListenAddress("127.0.0.1", 0)
ENGINE_STATS_STREAM_MODES = ("auto", "required", "off")
UPSTREAM_BACKENDS = ("dynamo", "none")


class PylonConfigError(ValueError):
    """A Pylon setting is malformed; the message says which value and what is expected."""


@dataclass(frozen=True, slots=True)
class DialTarget:
    """Where a gRPC channel connects: `host:port`, and whether it uses TLS."""

    address: str
    secure: bool = False

    def __str__(self) -> str:
        return f"https://{self.address}" if self.secure else self.address


def _check_host(host: str, text: str) -> str:
    if ip_literal(host) is None and not is_host_name(host):
        raise PylonConfigError(f"{text!r}: {host!r} is neither an IP address nor a host name")
    return canonical_host(host)


def parse_dial_target(text: str, *, default_port: int | None = None) -> DialTarget:
    """Parse a Stargate address: `HOST:PORT`, `[v6]:PORT`, or `http(s)://HOST[:PORT][/...]`.

    `http://` (and `grpc://`) mean plaintext h2c, `https://` (and `grpcs://`) TLS; the path is
    ignored. A URL without a port uses 80/443; a bare host without a port uses `default_port`
    (none: the port is required).
    """
    value = text.strip()
    if not value or any(ch.isspace() for ch in value):
        raise PylonConfigError(f"{text!r} is not a HOST:PORT address (e.g. 127.0.0.1:50071)")
    scheme = ""
    if "://" in value:
        scheme = value.split("://", 1)[0].lower()
        if scheme not in ("http", "https", "grpc", "grpcs"):
            raise PylonConfigError(f"{text!r}: scheme must be http, https, grpc or grpcs")
    try:
        parts = urlsplit(value if scheme else f"//{value}")
        host = parts.hostname
        port = parts.port
    except ValueError as error:
        if "port" in str(error).lower():
            raise PylonConfigError(f"{text!r}: port must be a number from 1 to 65535") from None
        raise PylonConfigError(f"{text!r} is not a HOST:PORT address: {error}") from None
    if not host:
        raise PylonConfigError(f"{text!r} has no host (e.g. 127.0.0.1:50071)")
    if port is None:
        port = {"http": 80, "https": 443}.get(scheme, default_port)
    if port is None:
        raise PylonConfigError(f"{text!r} has no port (e.g. 127.0.0.1:50071)")
    if not 1 <= port <= 65535:
        raise PylonConfigError(f"{text!r}: port must be a number from 1 to 65535")
    if not scheme and "[" not in value and value.count(":") > 1:
        raise PylonConfigError(f"{text!r}: an IPv6 address must be written in brackets")
    canonical = _check_host(host, text)
    return DialTarget(format_host_port(canonical, port), secure=scheme in ("https", "grpcs"))


def parse_upstream_url(text: str) -> str:
    """The engine's base URL: `http(s)://host[:port][/prefix]`, without a trailing slash."""
    value = text.strip()
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as error:
        raise PylonConfigError(f"{text!r} is not a valid URL: {error}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise PylonConfigError(f"{text!r}: the upstream URL must start with http:// or https://")
    if not parts.hostname:
        raise PylonConfigError(f"{text!r}: the upstream URL must include a host")
    if port == 0:
        raise PylonConfigError(f"{text!r}: port must be a number from 1 to 65535")
    if parts.query or parts.fragment:
        raise PylonConfigError(f"{text!r}: the upstream URL must not have a query or fragment")
    return value.rstrip("/")


def upstream_port(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme.lower() == "https" else 80)


def advertise_host(listen_host: str) -> str:
    """The host to register for a listener bound to `listen_host`: itself, or for a wildcard
    (0.0.0.0, ::) the address this host's name resolves to (loopback when it resolves to
    nothing else): a Pod's hostname resolves to its Pod IP."""
    if listen_host not in ("0.0.0.0", "::"):
        return listen_host
    family = socket.AF_INET6 if listen_host == "::" else socket.AF_INET
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        address = str(info[4][0])
        if not address.startswith("127.") and address != "::1":
            return address
    return "::1" if listen_host == "::" else "127.0.0.1"


def default_inference_server_id(upstream_url: str) -> str:
    """`<hostname>:<upstream port>`: stable across restarts, unique per engine on one host."""
    return f"{socket.gethostname()}:{upstream_port(upstream_url)}"


def parse_advertise_url(text: str) -> str:
    """The URL the Pylon registers (`--advertise-url`): `http(s)://host:port`, no path."""
    url = parse_upstream_url(text)
    parts = urlsplit(url)
    if parts.path not in ("", "/"):
        raise PylonConfigError(f"{text!r}: the advertise URL must not have a path")
    return url


@dataclass(frozen=True, slots=True)
class RequestPathConfig:
    """The Pylon in the request path: its listener, what it registers, and how it forwards
    (docs/pylon-data-path.md)."""

    listen_addr: ListenAddress = DEFAULT_LISTEN_ADDR
    advertise_url: str | None = None
    """Registered as `inference_server_url`; None: `http://<listen address>` (a wildcard listen
    host is replaced by this host's address, `advertise_host`)."""
    upstream_backend: str = "dynamo"
    priority_ceiling: int = 3600
    require_streaming: bool = False
    local_connect_failures_retryable: bool = False
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        if self.upstream_backend not in UPSTREAM_BACKENDS:
            raise PylonConfigError(
                f"upstream backend must be one of {', '.join(UPSTREAM_BACKENDS)}, "
                f"got {self.upstream_backend!r}"
            )
        if not 0 <= self.priority_ceiling <= 2**32 - 1:
            raise PylonConfigError("the priority ceiling must be from 0 to 4294967295")


PYLON_CONNECTIVITIES = ("http", "direct", "reverse")
DEFAULT_QUIC_LISTEN_ADDR = ListenAddress("127.0.0.1", 0)


@dataclass(frozen=True, slots=True)
class PylonTunnelConfig:
    """How the replicas reach this Pylon (docs/tunnels.md, "The Pylon"): `http` (our extension:
    its HTTP listener, registered as `http://`), `direct` (a QUIC listener on `quic_listen_addr`,
    registered as `quic://IP:port`) or `reverse` (it dials each replica's reverse listener).

    `cert_path`/`key_path` are the QUIC listener's identity (direct; a generated self-signed one
    without them) and `cert_path` the certificates trusted when dialing (reverse; nothing is
    checked with `insecure`), as the Rust Pylon reads `--tls-cert-path`."""

    connectivity: str = "http"
    protocol: TunnelProtocol = TunnelProtocol.RAW_QUIC
    quic_listen_addr: ListenAddress = DEFAULT_QUIC_LISTEN_ADDR
    cert_path: Path | None = None
    key_path: Path | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.connectivity not in PYLON_CONNECTIVITIES:
            raise PylonConfigError(
                f"--backend-connectivity must be one of {', '.join(PYLON_CONNECTIVITIES)}"
            )
        if (self.cert_path is None) != (self.key_path is None) and self.connectivity == "direct":
            raise PylonConfigError(
                "--tls-key-path is required with --tls-cert-path"
                if self.key_path is None
                else "--tls-cert-path is required with --tls-key-path"
            )
        if self.connectivity == "reverse" and not self.insecure and self.cert_path is None:
            raise PylonConfigError("TLS cert required when --quic-insecure is not set")

    @property
    def tunneled(self) -> bool:
        return self.connectivity != "http"


@dataclass(frozen=True, slots=True)
class SideChannelConfig:
    """What the Pylon reads from its engine besides the requests (docs/pylon-data-path.md)."""

    engine_stats_stream: str = "auto"
    engine_stats_stream_path: str = "/pylon/v1/stats/stream"
    kv_cache_stats_path: str | None = None
    engine_metrics_path: str | None = "/metrics"
    kv_events_endpoint: str | None = None
    """The engine's KV-event PUB socket, `tcp://HOST:PORT` (docs/prefix-routing.md, "Precise
    mode"); None: off."""
    kv_events_max_blocks: int = DEFAULT_MAX_BLOCKS

    def __post_init__(self) -> None:
        if self.engine_stats_stream not in ENGINE_STATS_STREAM_MODES:
            raise PylonConfigError(
                f"engine stats stream mode must be one of {', '.join(ENGINE_STATS_STREAM_MODES)}"
            )
        if self.kv_events_endpoint is not None:
            try:
                endpoint = parse_tcp_endpoint(self.kv_events_endpoint)
            except ValueError as error:
                raise PylonConfigError(f"--kv-events-endpoint: {error}") from None
            object.__setattr__(self, "kv_events_endpoint", endpoint)
        if self.kv_events_max_blocks < 1:
            raise PylonConfigError("--kv-events-max-blocks must be at least 1")


@dataclass(frozen=True, slots=True)
class BringupConfig:
    """How a model's input TPS is known before it is advertised, and the canaries."""

    initial_input_tps: float | None = None
    pin_input_tps: bool = False
    do_calibration: bool = False
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    canary_interval_ms: int = 5000
    canary_timeout_ms: int = 5000

    def __post_init__(self) -> None:
        tps = self.initial_input_tps
        if tps is not None and not (tps > 0 and tps != float("inf")):
            raise PylonConfigError("the initial input TPS must be a finite number > 0")
        if tps is not None and self.do_calibration:
            raise PylonConfigError("an initial input TPS and calibration exclude each other")
        if self.pin_input_tps and tps is None:
            raise PylonConfigError("pinning the input TPS needs an initial input TPS")
        if self.canary_interval_ms < 0 or self.canary_timeout_ms <= 0:
            raise PylonConfigError("canary interval must be >= 0 and canary timeout > 0")


@dataclass(frozen=True, slots=True)
class PylonConfig:
    """Everything one Pylon sidecar needs (one inference engine, any number of replicas)."""

    upstream_url: str
    """The engine's base URL (http:// or https://), also sent as `inference_server_url`."""
    stargates: tuple[DialTarget, ...] = (DialTarget(f"127.0.0.1:{DEFAULT_STARGATE_PORT}"),)
    """WatchStargates seeds."""
    model_names: tuple[str, ...] = ()
    """Models to register; empty = discover them from `GET {upstream}/v1/models`."""
    model_refresh_ms: int = 5000
    inference_server_id: str = ""
    """Empty = `default_inference_server_id(upstream_url)`."""
    cluster_id: str = ""
    min_update_interval_ms: int = 1000
    token_file: Path | None = None
    upstream_health_paths: tuple[str, ...] = DEFAULT_HEALTH_PATHS
    upstream_health_wait_ms: int = 60000
    extra_metadata: tuple[tuple[str, str], ...] = field(default=())
    """Extra request metadata on registration streams (tests, custom auth)."""
    stargate_ca_file: Path | None = None
    """PEM CA certificates that sign the replicas' TLS certificates: with it every channel to a
    replica (seeds and discovered ones alike) uses TLS with these roots (docs/tls.md)."""
    request_path: RequestPathConfig = field(default_factory=RequestPathConfig)
    side_channels: SideChannelConfig = field(default_factory=SideChannelConfig)
    bringup: BringupConfig = field(default_factory=BringupConfig)
    tunnel: PylonTunnelConfig = field(default_factory=PylonTunnelConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "upstream_url", parse_upstream_url(self.upstream_url))
        if not self.inference_server_id:
            object.__setattr__(
                self, "inference_server_id", default_inference_server_id(self.upstream_url)
            )
        if not self.stargates:
            raise PylonConfigError("at least one Stargate seed address is required")
        if self.min_update_interval_ms <= 0:
            raise PylonConfigError("min_update_interval_ms must be greater than 0")
        if self.model_refresh_ms <= 0:
            raise PylonConfigError("model_refresh_ms must be greater than 0")
        if self.upstream_health_wait_ms < 0:
            raise PylonConfigError("upstream_health_wait_ms must be >= 0")
        if not self.upstream_health_paths:
            raise PylonConfigError("at least one upstream health path is required")
        for path in self.upstream_health_paths:
            if not path.startswith("/"):
                raise PylonConfigError(f"health path {path!r} must start with '/'")

    @property
    def heartbeat_seconds(self) -> float:
        return self.min_update_interval_ms / 1000

    @property
    def model_refresh_seconds(self) -> float:
        return self.model_refresh_ms / 1000
