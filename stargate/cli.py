"""The `stargate` command line: flags and environment variables become config objects.

Every flag has help text and an explicit environment variable (named on the flag, not derived, so
renaming a command can never silently change it). Malformed values are click usage errors (exit
2) that name the flag; problems only visible at start-up, such as an occupied port, exit 1 with a
message naming the listener.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from stargate import __version__
from stargate.clitools import (
    LISTEN_ADDRESS,
    POSITIVE_INT,
    comma_list,
    log_format_option,
    log_level_option,
    option,
    sectioned,
)
from stargate.config import (
    DEFAULT_DERIVE_AFFINITY_KEY_BYTES,
    DEFAULT_MAX_CLIENT_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_BACKEND,
    DEFAULT_METRICS_LISTEN_ADDR,
    METRICS_FLAGS_CONFLICT,
    ActivatorConfig,
    ConfigError,
    ControlPlaneConfig,
    DiscoveryConfig,
    ListenAddress,
    PoolOwnershipConfig,
    ProxyConfig,
    SecretsConfig,
    ServeConfig,
    TlsConfig,
    TracingConfig,
    WarmupConfig,
    validate_metrics_prefix,
)
from stargate.logs import configure_logging

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])


NON_NEGATIVE_INT = click.IntRange(min=0)
PORT = click.IntRange(min=0, max=65535)


def _metrics_prefix(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_metrics_prefix(value)
    except ConfigError as error:
        raise click.BadParameter(str(error), ctx, param) from None


def _connectivity(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value == "reverse":
        raise click.BadParameter(
            "reverse tunnels are not offered by this replica: backends register an http:// or "
            "https:// URL and are reached directly over HTTP",
            ctx,
            param,
        )
    return value


def _together(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Apply several option decorators as one (listed in --help order)."""

    def apply(function: F) -> F:
        for decorator in reversed(decorators):
            function = decorator(function)
        return function

    return apply


def listener_options(env_prefix: str, host: str) -> Callable[[F], F]:
    """The HTTP and the two gRPC listen addresses (`stargate serve` and `stargate demo`)."""
    return _together(
        option(
            "--http-listen-addr",
            envvar=f"{env_prefix}_HTTP_LISTEN_ADDR",
            type=LISTEN_ADDRESS,
            default=f"{host}:8000",
            help="HTTP listener: the OpenAI-compatible proxy and the /healthz and /readyz probes.",
        ),
        option(
            "--listen-addr",
            envvar=f"{env_prefix}_LISTEN_ADDR",
            type=LISTEN_ADDRESS,
            default=f"{host}:50071",
            help="Control-plane gRPC listener that Pylons register with.",
        ),
        option(
            "--model-discovery-listen-addr",
            envvar=f"{env_prefix}_MODEL_DISCOVERY_LISTEN_ADDR",
            type=LISTEN_ADDRESS,
            default=f"{host}:50073",
            help="Model-discovery gRPC listener (StargateModelDiscovery/ListModels only).",
        ),
    )


def metrics_listener_options(env_prefix: str, host: str) -> Callable[[F], F]:
    """The metrics listener: `--metrics-listen-addr`, and the older `--metrics-port` (the port on
    `host`, the default address's host), kept working for compatibility."""
    return _together(
        option(
            "--metrics-listen-addr",
            envvar=f"{env_prefix}_METRICS_LISTEN_ADDR",
            type=LISTEN_ADDRESS,
            default=None,
            help=f"Prometheus /metrics listener (IP:PORT, [v6]:PORT). [default: {host}:9090]",
        ),
        option(
            "--metrics-port",
            envvar=f"{env_prefix}_METRICS_PORT",
            type=PORT,
            default=None,
            help=f"Older way to set the metrics listener: this port on {host}. Not with "
            "--metrics-listen-addr.",
        ),
    )


def _metrics_listener(
    listen_addr: ListenAddress | None, port: int | None, host: str
) -> ListenAddress:
    """The metrics address from `--metrics-listen-addr` or `--metrics-port`; both is a usage
    error naming the two flags (whether they came from the command line or the environment)."""
    if listen_addr is not None and port is not None:
        raise click.UsageError(METRICS_FLAGS_CONFLICT)
    if listen_addr is not None:
        return listen_addr
    return ListenAddress(host, DEFAULT_METRICS_LISTEN_ADDR.port if port is None else port)


def warmup_options(env_prefix: str) -> Callable[[F], F]:
    """The three readiness-warmup flags (docs/decisions.md, D2)."""
    return _together(
        option(
            "--readiness-warmup-ms",
            envvar=f"{env_prefix}_READINESS_WARMUP_MS",
            type=NON_NEGATIVE_INT,
            default=60_000,
            help="Upper bound of the readiness warmup: /readyz answers 503 until the backend "
            "count is stable or this deadline passes. 0 = ready at start.",
        ),
        option(
            "--warmup-sample-interval-ms",
            envvar=f"{env_prefix}_WARMUP_SAMPLE_INTERVAL_MS",
            type=POSITIVE_INT,
            default=1_000,
            help="How often warmup samples the total active backend count. Must be > 0.",
        ),
        option(
            "--warmup-stabilization-window",
            envvar=f"{env_prefix}_WARMUP_STABILIZATION_WINDOW",
            type=POSITIVE_INT,
            default=5,
            help="Consecutive equal, nonzero samples that end warmup early. Must be > 0.",
        ),
    )


class _Main(click.Group):
    """The `stargate` group: an HTTP stack its patches were not written for is refused with the
    patch table's own message (what differs, what to do), not a traceback, whichever command
    first imports the serving code (stargate/hypercorn_patches/table.py)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RuntimeError as error:
            # Not imported up front: `--help` must not pay for the HTTP stack's imports. When
            # the error is the table's, its module is loaded already.
            patches = sys.modules.get("stargate.hypercorn_patches")
            if patches is not None and isinstance(error, patches.PatchTableMismatch):
                raise click.ClickException(str(error)) from None
            raise


@click.group(
    cls=_Main,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="stargate")
def main() -> None:
    """stargate: an LLM request router replica (Pylon registration, OpenAI-compatible proxy)."""


# `stargate serve --help` lists these under their own headings (README: TLS, Worker
# authentication, Tracing).
SERVE_SECTIONS = {
    "TLS": ("tls_cert_path", "tls_key_path", "tls_reload_interval_ms"),
    "Worker authentication": (
        "worker_auth_endpoint",
        "worker_auth_ca_file",
        "secrets_path",
        "secrets_json_path",
        "oauth2_provider_host",
        "registration_token_file",
    ),
    "Tracing": ("otel_endpoint", "otel_service_name"),
    "Model pools": (
        "pool_config",
        "pool_resync_interval_ms",
        "pool_controller_timeout_ms",
        "pool_ownership",
        "pool_lease_namespace",
        "pool_lease_prefix",
        "pool_lease_duration_ms",
        "pool_lease_renew_deadline_ms",
        "pool_lease_retry_period_ms",
        "pool_owner_url",
    ),
}


@main.command(cls=sectioned(SERVE_SECTIONS))
@option(
    "--stargate-id",
    envvar="STARGATE_ID",
    default=None,
    help="Identity of this replica in logs, discovery and /debug/state. [default: the hostname]",
)
@listener_options("STARGATE", "0.0.0.0")
@option(
    "--advertise-addr",
    envvar="STARGATE_ADVERTISE_ADDR",
    type=LISTEN_ADDRESS,
    default=None,
    help="This replica's gRPC address as published to Pylons by WatchStargates. [default: the "
    "--listen-addr IP, or this host's address when that is 0.0.0.0/::, with the bound port]",
)
@option(
    "--stargate-discovery-dns-name",
    envvar="STARGATE_DISCOVERY_DNS_NAME",
    default=None,
    help="DNS name whose A/AAAA records are this replica's peers (in Kubernetes, the headless "
    "Service), polled every --dns-poll-ms.",
)
@option(
    "--peer",
    "peers",
    envvar="STARGATE_PEERS",
    multiple=True,
    callback=comma_list,
    help="A peer replica's gRPC address (HOST:PORT or ID=HOST:PORT) for static discovery; "
    "repeatable or comma-separated.",
)
@option(
    "--peer-absent-after-ms",
    envvar="STARGATE_PEER_ABSENT_AFTER_MS",
    type=NON_NEGATIVE_INT,
    default=30_000,
    help="A static peer that fails its gRPC health checks (one every --dns-poll-ms) for this long "
    "is left out of WatchStargates until it answers again (0 = never checked, always listed).",
)
@option(
    "--disable-dns-discovery",
    envvar="STARGATE_DISABLE_DNS_DISCOVERY",
    is_flag=True,
    default=False,
    help="Publish only this replica in WatchStargates.",
)
@option(
    "--dns-poll-ms",
    envvar="STARGATE_DNS_POLL_MS",
    type=POSITIVE_INT,
    default=1_000,
    help="Discovery poll period of the WatchStargates publisher. Must be > 0.",
)
@option(
    "--watch-heartbeat-ms",
    envvar="STARGATE_WATCH_HEARTBEAT_MS",
    type=NON_NEGATIVE_INT,
    default=5_000,
    help="Longest interval between re-publications of an unchanged WatchStargates snapshot "
    "(0 = every poll).",
)
@option(
    "--remote-stargate-url",
    "remote_stargate_urls",
    envvar="STARGATE_REMOTE_WATCH_URLS",
    multiple=True,
    callback=comma_list,
    help="Extra WatchStargates seeds (other regions) passed on to Pylons; repeatable or "
    "comma-separated. Never registration targets.",
)
@option(
    "--grpc-pylon-dial-addr",
    envvar="STARGATE_GRPC_PYLON_DIAL_ADDR",
    default=None,
    help="Address Pylons dial instead of each replica's advertise address (e.g. a load "
    "balancer), published on every WatchStargates entry.",
)
@option(
    "--registration-update-idle-timeout-ms",
    envvar="STARGATE_REGISTRATION_UPDATE_IDLE_TIMEOUT_MS",
    type=NON_NEGATIVE_INT,
    default=60_000,
    help="Floor of a registration stream's idle timeout (3 x the Pylon heartbeat). 0 disables "
    "idle enforcement.",
)
@option(
    "--registration-update-max-idle-timeout-ms",
    envvar="STARGATE_REGISTRATION_UPDATE_MAX_IDLE_TIMEOUT_MS",
    type=NON_NEGATIVE_INT,
    default=300_000,
    help="Cap of the idle timeout, and its value when the Pylon sends no heartbeat header. "
    "0 disables idle enforcement.",
)
@option(
    "--grpc-max-message-bytes",
    envvar="STARGATE_GRPC_MAX_MESSAGE_BYTES",
    type=POSITIVE_INT,
    default=4 * 1024 * 1024,
    help="Largest gRPC message accepted; larger ones end the call with RESOURCE_EXHAUSTED.",
)
@option(
    "--worker-auth-endpoint",
    envvar="STARGATE_WORKER_AUTH_ENDPOINT",
    default=None,
    help="The llm_gateway.LlmGateway service (HOST:PORT, http://HOST:PORT, or https://HOST:PORT "
    "for TLS) whose AuthLlmWorker maps a Pylon's bearer token to its routing key; checked at "
    "start-up. Without it (and without a token file) registration is open.",
)
@option(
    "--worker-auth-ca-file",
    envvar="STARGATE_WORKER_AUTH_CA_FILE",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    default=None,
    help="CA certificates (PEM) to verify the worker-auth gateway with: the replica then dials "
    "it over TLS (an https:// endpoint does so with the system store).",
)
@option(
    "--secrets-path",
    envvar="SECRETS_PATH",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    default=None,
    help="JSON secrets file of the replica itself: the bearer it presents to the worker-auth "
    "gateway (at --secrets-json-path), OAuth2 client credentials (clientId, clientSecret) and "
    "the trace exporter's tracingAccessToken. Re-read when it changes; never logged.",
)
@option(
    "--secrets-json-path",
    envvar="SECRETS_JSON_PATH",
    default="authToken",
    help="Dot-separated location of the worker-auth bearer in the secrets file.",
)
@option(
    "--oauth2-provider-host",
    envvar="OAUTH2_PROVIDER_HOST",
    default=None,
    help="Mint the worker-auth bearer by OAuth2 client credentials at <host>/token (scope "
    "llm:check_worker), refreshed before it expires. Requires --secrets-path.",
)
@option(
    "--registration-token-file",
    envvar="STARGATE_REGISTRATION_TOKEN_FILE",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    default=None,
    help="File holding a shared bearer token every Pylon must present (no routing key).",
)
@option(
    "--health-check-timeout-ms",
    envvar="STARGATE_HEALTH_CHECK_TIMEOUT_MS",
    type=POSITIVE_INT,
    default=5_000,
    help="Timeout of one backend health probe (GET {url}/health); a backend that fails it is "
    "not routable until a later probe succeeds.",
)
@option(
    "--backend-connectivity",
    envvar="STARGATE_BACKEND_CONNECTIVITY",
    type=click.Choice(["direct", "reverse"]),
    default="direct",
    callback=_connectivity,
    help="How backends are reached. Only direct (HTTP) is offered; reverse is refused.",
)
@option(
    "--proxy-max-connect-retries",
    envvar="STARGATE_PROXY_MAX_CONNECT_RETRIES",
    type=NON_NEGATIVE_INT,
    default=2,
    help="Per request: how many times a transport failure (refused, reset, response-head "
    "timeout) may move the request to another backend.",
)
@option(
    "--proxy-max-request-retries",
    envvar="STARGATE_PROXY_MAX_REQUEST_RETRIES",
    type=NON_NEGATIVE_INT,
    default=2,
    help="Per request: how many retryable upstream 429/503 responses may be retried elsewhere.",
)
@option(
    "--proxy-max-replay-body-bytes",
    envvar="STARGATE_PROXY_MAX_REPLAY_BODY_BYTES",
    type=NON_NEGATIVE_INT,
    default=64 * 1024 * 1024,
    help="Largest request body accepted (kept in memory for replay on a retry); larger is 413.",
)
@option(
    "--proxy-require-pylon-retry-signal",
    envvar="STARGATE_PROXY_REQUIRE_PYLON_RETRY_SIGNAL",
    type=click.BOOL,
    default=True,
    help="Retry an upstream 429/503 only when it carries x-stargate-retryable: true "
    "(takes a value: --proxy-require-pylon-retry-signal=false).",
)
@option(
    "--proxy-retry-budget-header",
    envvar="STARGATE_PROXY_RETRY_BUDGET_HEADER",
    default="x-stargate-max-wait-ms",
    help="Request header carrying a retry budget in ms (retries start only within it); "
    "empty disables.",
)
@option(
    "--proxy-response-header-timeout-ms",
    envvar="STARGATE_PROXY_RESPONSE_HEADER_TIMEOUT_MS",
    type=POSITIVE_INT,
    default=30_000,
    help="Longest wait for a backend's response head (then 502 or a retry); the streamed body "
    "has no timeout.",
)
@option(
    "--proxy-connect-timeout-ms",
    envvar="STARGATE_PROXY_CONNECT_TIMEOUT_MS",
    type=POSITIVE_INT,
    default=5_000,
    help="Timeout of one TCP (and TLS) connect to a backend.",
)
@option(
    "--proxy-max-connections-per-backend",
    envvar="STARGATE_PROXY_MAX_CONNECTIONS_PER_BACKEND",
    type=POSITIVE_INT,
    default=DEFAULT_MAX_CONNECTIONS_PER_BACKEND,
    help="Upstream connections one backend may have open, so concurrent requests and streams "
    "to it. Requests go to a backend below its cap first; when every candidate is at its cap "
    "a request waits up to 5 s for a free connection, then gets 503. Engines batch hundreds of "
    "sequences; each connection is one descriptor.",
)
@option(
    "--accept-openai-requests",
    envvar="STARGATE_ACCEPT_OPENAI_REQUESTS",
    is_flag=True,
    default=False,
    help="Let plain OpenAI clients through: without x-model, the model comes from the JSON body, "
    "x-request-id is generated and returned, x-input-tokens is estimated.",
)
@option(
    "--unmeasured-backends",
    envvar="STARGATE_UNMEASURED_BACKENDS",
    type=click.Choice(["estimate", "exclude"]),
    default="estimate",
    help="How load balancers see a backend whose Pylon has published no input TPS yet (a "
    "fresh engine: the Pylon publishes it after 5 completed requests or a calibration). "
    "estimate: as the mean of the model's measured backends (or all alike when none is), so "
    "every algorithm can route by the queue counts from the first request. exclude: the Rust "
    "rule, no capacity (pulsar and wait-and-widen skip it; with none measured they answer 503).",
)
@option(
    "--derive-affinity-key",
    envvar="STARGATE_DERIVE_AFFINITY_KEY",
    is_flag=True,
    default=False,
    help="Route a request without x-cache-affinity-key as if it carried one derived from a hash "
    "of its prompt's start (system/developer messages, then the first "
    "--derive-affinity-key-bytes of the conversation), so cache-affinity balancers keep a "
    "conversation's turns together. Routing only: nothing is added upstream.",
)
@option(
    "--derive-affinity-key-bytes",
    envvar="STARGATE_DERIVE_AFFINITY_KEY_BYTES",
    type=POSITIVE_INT,
    default=DEFAULT_DERIVE_AFFINITY_KEY_BYTES,
    help="How many bytes of the conversation (after the system/developer messages) a derived "
    "affinity key covers.",
)
@option(
    "--lb-config-path",
    envvar="STARGATE_LB_CONFIG_PATH",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    default=None,
    help="JSON load-balancer config (default algorithm, per-model algorithms, header "
    "overrides). Without it: power-of-n, with every algorithm selectable by x-routing-method.",
)
@option(
    "--upstream-ca-file",
    envvar="STARGATE_UPSTREAM_CA_FILE",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    default=None,
    help="Extra CA certificates (PEM) trusted for https:// backends, besides the system store.",
)
@option(
    "--tls-cert-path",
    envvar="STARGATE_TLS_CERT_PATH",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    default=None,
    help="Certificate chain (PEM) served on the HTTP and both gRPC listeners. With "
    "--tls-key-path; re-read every --tls-reload-interval-ms.",
)
@option(
    "--tls-key-path",
    envvar="STARGATE_TLS_KEY_PATH",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    default=None,
    help="Private key (PEM) of --tls-cert-path.",
)
@option(
    "--tls-reload-interval-ms",
    envvar="STARGATE_TLS_RELOAD_INTERVAL_MS",
    type=POSITIVE_INT,
    default=30_000,
    help="How often the TLS pair is re-read; a changed, valid pair is served to new "
    "connections, an invalid one is refused (ERROR) and the last good one kept.",
)
@option(
    "--otel-endpoint",
    envvar="OTEL_EXPORTER_OTLP_ENDPOINT",
    default=None,
    help="OTLP/gRPC collector (http://host:4317) to export request traces to. Without it no "
    "span is recorded and traceparent is forwarded untouched.",
)
@option(
    "--otel-service-name",
    envvar="OTEL_SERVICE_NAME",
    default="stargate",
    help="service.name of the exported spans.",
)
@option(
    "--pool-config",
    envvar="STARGATE_POOL_CONFIG",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    default=None,
    help="YAML file of model pools: models sharing one slot, swapped on demand while requests "
    "for a non-resident member are held. Without it no request is held.",
)
@option(
    "--pool-resync-interval-ms",
    envvar="STARGATE_POOL_RESYNC_INTERVAL_MS",
    type=POSITIVE_INT,
    default=5_000,
    help="At most this often a pool re-checks which member is resident.",
)
@option(
    "--pool-controller-timeout-ms",
    envvar="STARGATE_POOL_CONTROLLER_TIMEOUT_MS",
    type=POSITIVE_INT,
    default=10_000,
    help="Timeout of each pool controller call (scale, patch, process start/stop), so a hung "
    "API server cannot freeze the pools.",
)
@option(
    "--pool-ownership",
    envvar="STARGATE_POOL_OWNERSHIP",
    type=click.Choice(["local", "lease"]),
    default="local",
    help="Who runs each pool's activator: local (this replica, for every pool: one replica or "
    "the process controller) or lease (one Kubernetes Lease per pool; its holder decides and "
    "the other replicas hand it their requests for the pool).",
)
@option(
    "--pool-lease-namespace",
    envvar="STARGATE_POOL_LEASE_NAMESPACE",
    default=None,
    help="Namespace of the pool Leases. Default: the replica's own (POD_NAMESPACE, else the "
    "service account's).",
)
@option(
    "--pool-lease-prefix",
    envvar="STARGATE_POOL_LEASE_PREFIX",
    default="stargate",
    help="Pool Leases are named <prefix>-pool-<pool>; the chart passes its release name.",
)
@option(
    "--pool-lease-duration-ms",
    envvar="STARGATE_POOL_LEASE_DURATION_MS",
    type=POSITIVE_INT,
    default=15_000,
    help="A pool Lease not renewed for this long may be taken over (the failover time after a "
    "crash).",
)
@option(
    "--pool-lease-renew-deadline-ms",
    envvar="STARGATE_POOL_LEASE_RENEW_DEADLINE_MS",
    type=POSITIVE_INT,
    default=10_000,
    help="A pool owner whose renewals have failed for this long stops deciding for the pool "
    "(before its Lease can expire).",
)
@option(
    "--pool-lease-retry-period-ms",
    envvar="STARGATE_POOL_LEASE_RETRY_PERIOD_MS",
    type=POSITIVE_INT,
    default=2_000,
    help="How often an owner renews its pool Leases and the other replicas re-read them.",
)
@option(
    "--pool-owner-url",
    envvar="STARGATE_POOL_OWNER_URL",
    default=None,
    help="This replica's HTTP listener as its peers reach it (http://POD_IP:8000), recorded in "
    "the Leases it holds. Default: the advertise host with the HTTP port.",
)
@metrics_listener_options("STARGATE", "0.0.0.0")
@option(
    "--metrics-prefix",
    envvar="STARGATE_METRICS_PREFIX",
    default="stargate_",
    callback=_metrics_prefix,
    help="Prefix of every metric name (e.g. llm_request_router_).",
)
@option(
    "--debug-endpoints/--no-debug-endpoints",
    envvar="STARGATE_DEBUG_ENDPOINTS",
    default=True,
    help="Serve GET /debug/state (listener addresses and active model ids) on the HTTP "
    "listener; --no-debug-endpoints makes it a 404 like any unknown path.",
)
@option(
    "--shutdown-delay-ms",
    envvar="STARGATE_SHUTDOWN_DELAY_MS",
    type=NON_NEGATIVE_INT,
    default=5_000,
    help="After SIGTERM, how long the replica keeps serving while it leaves the Service "
    "(/readyz 503, connections told to close) before it stops accepting. Cover your endpoint "
    "propagation time. SIGINT skips it; 0 stops accepting at once.",
)
@option(
    "--shutdown-drain-timeout-ms",
    envvar="STARGATE_SHUTDOWN_DRAIN_TIMEOUT_MS",
    type=NON_NEGATIVE_INT,
    default=30_000,
    help="After SIGTERM/SIGINT, how long in-flight requests and streams may take to finish "
    "before the process exits 1.",
)
@option(
    "--request-body-timeout-ms",
    envvar="STARGATE_REQUEST_BODY_TIMEOUT_MS",
    type=NON_NEGATIVE_INT,
    default=30_000,
    help="A request on the HTTP listener whose body has not fully arrived this long after its "
    "head is answered 408 and its connection closed (HTTP/2: its stream reset), so a stalled "
    "upload cannot hold a connection, an in-flight slot or a drain. 0 disables.",
)
@option(
    "--max-client-connections",
    envvar="STARGATE_MAX_CLIENT_CONNECTIONS",
    type=NON_NEGATIVE_INT,
    default=DEFAULT_MAX_CLIENT_CONNECTIONS,
    help="Open client connections the HTTP listener serves; 32 more serve only /healthz and "
    "/readyz (other requests: 503 too_many_connections), and beyond those a new connection is "
    "closed at once. The default keeps 2 descriptors per connection (client and upstream) plus "
    "the reserve under the usual 1,024 open-file limit. 0 = unlimited.",
)
@warmup_options("STARGATE")
@log_level_option("STARGATE_LOG_LEVEL")
@log_format_option("STARGATE_LOG_FORMAT")
def serve(
    stargate_id: str | None,
    http_listen_addr: ListenAddress,
    listen_addr: ListenAddress,
    model_discovery_listen_addr: ListenAddress,
    advertise_addr: ListenAddress | None,
    stargate_discovery_dns_name: str | None,
    peers: tuple[str, ...],
    peer_absent_after_ms: int,
    disable_dns_discovery: bool,
    dns_poll_ms: int,
    watch_heartbeat_ms: int,
    remote_stargate_urls: tuple[str, ...],
    grpc_pylon_dial_addr: str | None,
    registration_update_idle_timeout_ms: int,
    registration_update_max_idle_timeout_ms: int,
    grpc_max_message_bytes: int,
    worker_auth_endpoint: str | None,
    worker_auth_ca_file: Path | None,
    secrets_path: Path | None,
    secrets_json_path: str,
    oauth2_provider_host: str | None,
    registration_token_file: Path | None,
    health_check_timeout_ms: int,
    backend_connectivity: str,
    proxy_max_connect_retries: int,
    proxy_max_request_retries: int,
    proxy_max_replay_body_bytes: int,
    proxy_require_pylon_retry_signal: bool,
    proxy_retry_budget_header: str,
    proxy_response_header_timeout_ms: int,
    proxy_connect_timeout_ms: int,
    proxy_max_connections_per_backend: int,
    accept_openai_requests: bool,
    unmeasured_backends: str,
    derive_affinity_key: bool,
    derive_affinity_key_bytes: int,
    lb_config_path: Path | None,
    upstream_ca_file: Path | None,
    tls_cert_path: Path | None,
    tls_key_path: Path | None,
    tls_reload_interval_ms: int,
    otel_endpoint: str | None,
    otel_service_name: str,
    pool_config: Path | None,
    pool_resync_interval_ms: int,
    pool_controller_timeout_ms: int,
    pool_ownership: str,
    pool_lease_namespace: str | None,
    pool_lease_prefix: str,
    pool_lease_duration_ms: int,
    pool_lease_renew_deadline_ms: int,
    pool_lease_retry_period_ms: int,
    pool_owner_url: str | None,
    metrics_listen_addr: ListenAddress | None,
    metrics_port: int | None,
    metrics_prefix: str,
    debug_endpoints: bool,
    shutdown_delay_ms: int,
    shutdown_drain_timeout_ms: int,
    request_body_timeout_ms: int,
    max_client_connections: int,
    readiness_warmup_ms: int,
    warmup_sample_interval_ms: int,
    warmup_stabilization_window: int,
    log_level: str,
    log_format: str,
) -> None:
    """Run one replica until SIGTERM or SIGINT."""
    configure_logging(log_level, log_format)
    try:
        config = ServeConfig(
            stargate_id=stargate_id or socket.gethostname(),
            http_listen_addr=http_listen_addr,
            listen_addr=listen_addr,
            model_discovery_listen_addr=model_discovery_listen_addr,
            advertise_addr=advertise_addr,
            metrics_listen_addr=_metrics_listener(metrics_listen_addr, metrics_port, "0.0.0.0"),
            metrics_prefix=metrics_prefix,
            debug_endpoints=debug_endpoints,
            shutdown_delay_ms=shutdown_delay_ms,
            shutdown_drain_timeout_ms=shutdown_drain_timeout_ms,
            request_body_timeout_ms=request_body_timeout_ms,
            max_client_connections=max_client_connections,
            warmup=WarmupConfig(
                warmup_ms=readiness_warmup_ms,
                sample_interval_ms=warmup_sample_interval_ms,
                stabilization_window=warmup_stabilization_window,
            ),
            discovery=DiscoveryConfig(
                dns_name=(stargate_discovery_dns_name or "").strip() or None,
                peers=peers,
                disable_dns_discovery=disable_dns_discovery,
                dns_poll_ms=dns_poll_ms,
                watch_heartbeat_ms=watch_heartbeat_ms,
                remote_stargate_urls=remote_stargate_urls,
                grpc_pylon_dial_addr=(grpc_pylon_dial_addr or "").strip() or None,
                peer_absent_after_ms=peer_absent_after_ms,
            ),
            control_plane=ControlPlaneConfig(
                idle_timeout_ms=registration_update_idle_timeout_ms,
                max_idle_timeout_ms=registration_update_max_idle_timeout_ms,
                grpc_max_message_bytes=grpc_max_message_bytes,
                worker_auth_endpoint=(worker_auth_endpoint or "").strip() or None,
                registration_token_file=registration_token_file,
                health_check_timeout_ms=health_check_timeout_ms,
                oauth2_provider_host=(oauth2_provider_host or "").strip() or None,
                worker_auth_ca_file=worker_auth_ca_file,
            ),
            proxy=ProxyConfig(
                max_connect_retries=proxy_max_connect_retries,
                max_request_retries=proxy_max_request_retries,
                max_replay_body_bytes=proxy_max_replay_body_bytes,
                require_pylon_retry_signal=proxy_require_pylon_retry_signal,
                retry_budget_header=proxy_retry_budget_header.strip().lower() or None,
                response_header_timeout_ms=proxy_response_header_timeout_ms,
                connect_timeout_ms=proxy_connect_timeout_ms,
                max_connections_per_backend=proxy_max_connections_per_backend,
                accept_openai_requests=accept_openai_requests,
                estimate_unmeasured_backends=unmeasured_backends == "estimate",
                derive_affinity_key=derive_affinity_key,
                derive_affinity_key_bytes=derive_affinity_key_bytes,
                lb_config_path=lb_config_path,
                upstream_ca_file=upstream_ca_file,
            ),
            activator=ActivatorConfig(
                pool_config_path=pool_config,
                resync_interval_ms=pool_resync_interval_ms,
                controller_timeout_ms=pool_controller_timeout_ms,
                ownership=PoolOwnershipConfig(
                    mode=pool_ownership,
                    lease_namespace=(pool_lease_namespace or "").strip() or None,
                    lease_prefix=pool_lease_prefix.strip(),
                    lease_duration_ms=pool_lease_duration_ms,
                    renew_deadline_ms=pool_lease_renew_deadline_ms,
                    retry_period_ms=pool_lease_retry_period_ms,
                    owner_url=(pool_owner_url or "").strip().rstrip("/") or None,
                ),
            ),
            tls=TlsConfig.of(tls_cert_path, tls_key_path, tls_reload_interval_ms),
            secrets=SecretsConfig(secrets_path, secrets_json_path.strip()),
            tracing=TracingConfig((otel_endpoint or "").strip() or None, otel_service_name),
        )
    except ConfigError as error:
        raise click.UsageError(str(error)) from None
    from stargate import runtime  # imported here so `--help` stays fast

    sys.exit(runtime.run(config))


@main.command()
@listener_options("STARGATE_DEMO", "127.0.0.1")
@metrics_listener_options("STARGATE_DEMO", "127.0.0.1")
@warmup_options("STARGATE_DEMO")
def demo(
    http_listen_addr: ListenAddress,
    listen_addr: ListenAddress,
    model_discovery_listen_addr: ListenAddress,
    metrics_listen_addr: ListenAddress | None,
    metrics_port: int | None,
    readiness_warmup_ms: int,
    warmup_sample_interval_ms: int,
    warmup_stabilization_window: int,
) -> None:
    """Run a replica, two mock engines and two Pylons here; Ctrl-C stops them all."""
    import trio

    from stargate.demo import DemoConfig, run_demo

    config = DemoConfig(
        http_listen_addr=http_listen_addr,
        listen_addr=listen_addr,
        model_discovery_listen_addr=model_discovery_listen_addr,
        metrics_listen_addr=_metrics_listener(metrics_listen_addr, metrics_port, "127.0.0.1"),
        warmup=WarmupConfig(
            warmup_ms=readiness_warmup_ms,
            sample_interval_ms=warmup_sample_interval_ms,
            stabilization_window=warmup_stabilization_window,
        ),
    )
    sys.exit(trio.run(run_demo, config))


def _register_subcommands() -> None:
    from stargate.mock.cli import mock_backend_command
    from stargate.pylon.cli import pylon_command

    main.add_command(mock_backend_command)
    main.add_command(pylon_command)


_register_subcommands()
