"""The `stargate` command line: flags and environment variables become config objects.

Each command's flags are one table of `Setting`s (stargate/settings.py): flag, environment
variable, help, default, type, parsing and the config field it fills, written once; the click
command is generated from it and its body builds the config. Every flag has help text and an
explicit environment variable (named on the flag, not derived, so renaming a command can never
silently change it). Malformed values are click usage errors (exit 2) that name the flag; problems
only visible at start-up, such as an occupied port, exit 1 with a message naming the listener.
"""

from __future__ import annotations

import importlib
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from stargate import __version__
from stargate.clitools import LISTEN_ADDRESS, NON_NEGATIVE_INT, PORT, POSITIVE_INT, log_settings
from stargate.config import (
    DEFAULT_METRICS_LISTEN_ADDR,
    METRICS_FLAGS_CONFLICT,
    ConfigError,
    Connectivity,
    DemoConfig,
    ListenAddress,
    ServeConfig,
    TlsConfig,
    parse_tunnel_protocol,
    validate_metrics_prefix,
)
from stargate.logs import configure_logging
from stargate.settings import Derived, Setting, Settings, SettingsCommand, trimmed

__all__ = ["DEMO", "SERVE", "main"]

READABLE_FILE = click.Path(exists=True, dir_okay=False, readable=True, path_type=Path)


def listener_settings(env_prefix: str, host: str) -> tuple[Setting, ...]:
    """The HTTP and the two gRPC listen addresses (`stargate serve` and `stargate demo`)."""
    return (
        Setting(
            "--http-listen-addr",
            env=f"{env_prefix}_HTTP_LISTEN_ADDR",
            to="http_listen_addr",
            type=LISTEN_ADDRESS,
            default=f"{host}:8000",
            help="HTTP listener: the OpenAI-compatible proxy and the /healthz and /readyz probes.",
        ),
        Setting(
            "--listen-addr",
            env=f"{env_prefix}_LISTEN_ADDR",
            to="listen_addr",
            type=LISTEN_ADDRESS,
            default=f"{host}:50071",
            help="Control-plane gRPC listener that Pylons register with.",
        ),
        Setting(
            "--model-discovery-listen-addr",
            env=f"{env_prefix}_MODEL_DISCOVERY_LISTEN_ADDR",
            to="model_discovery_listen_addr",
            type=LISTEN_ADDRESS,
            default=f"{host}:50073",
            help="Model-discovery gRPC listener (StargateModelDiscovery/ListModels only).",
        ),
    )


def metrics_listener_settings(env_prefix: str, host: str) -> tuple[Setting | Derived, ...]:
    """The metrics listener: `--metrics-listen-addr`, and the older `--metrics-port` (the port on
    `host`, the default address's host), kept working for compatibility. Both is a usage error
    naming the two flags (whether they came from the command line or the environment)."""

    def address(values: Mapping[str, Any]) -> ListenAddress:
        listen_addr, port = values["metrics_listen_addr"], values["metrics_port"]
        if listen_addr is not None and port is not None:
            raise click.UsageError(METRICS_FLAGS_CONFLICT)
        if listen_addr is not None:
            return listen_addr  # type: ignore[no-any-return]
        return ListenAddress(host, DEFAULT_METRICS_LISTEN_ADDR.port if port is None else port)

    return (
        Setting(
            "--metrics-listen-addr",
            env=f"{env_prefix}_METRICS_LISTEN_ADDR",
            to=None,
            type=LISTEN_ADDRESS,
            default=None,
            help=f"Prometheus /metrics listener (IP:PORT, [v6]:PORT). [default: {host}:9090]",
        ),
        Setting(
            "--metrics-port",
            env=f"{env_prefix}_METRICS_PORT",
            to=None,
            type=PORT,
            default=None,
            help=f"Older way to set the metrics listener: this port on {host}. Not with "
            "--metrics-listen-addr.",
        ),
        Derived("metrics_listen_addr", address),
    )


def warmup_settings(env_prefix: str) -> tuple[Setting, ...]:
    """The three readiness-warmup flags (docs/decisions.md, D2); defaults: `WarmupConfig`'s."""
    return (
        Setting(
            "--readiness-warmup-ms",
            env=f"{env_prefix}_READINESS_WARMUP_MS",
            to="warmup.warmup_ms",
            type=NON_NEGATIVE_INT,
            help="Upper bound of the readiness warmup: /readyz answers 503 until the backend "
            "count is stable or this deadline passes. 0 = ready at start.",
        ),
        Setting(
            "--warmup-sample-interval-ms",
            env=f"{env_prefix}_WARMUP_SAMPLE_INTERVAL_MS",
            to="warmup.sample_interval_ms",
            type=POSITIVE_INT,
            help="How often warmup samples the total active backend count. Must be > 0.",
        ),
        Setting(
            "--warmup-stabilization-window",
            env=f"{env_prefix}_WARMUP_STABILIZATION_WINDOW",
            to="warmup.stabilization_window",
            type=POSITIVE_INT,
            help="Consecutive equal, nonzero samples that end warmup early. Must be > 0.",
        ),
    )


_LAZY_COMMANDS = {
    "mock-backend": ("stargate.mock.cli", "mock_backend_command"),
    "pylon": ("stargate.pylon.cli", "pylon_command"),
}
"""Commands imported only when run or listed: each pulls a stack of its own (the mock engine; the
Pylon's HTTP client, listener and stats) that no other command needs. `python -m stargate
mock-backend` took 0.95 s of CPU to import before it did anything, 0.45 s without the others."""


class _Main(click.Group):
    """The `stargate` group: an HTTP stack its patches were not written for is refused with the
    patch table's own message (what differs, what to do), not a traceback, whichever command
    first imports the serving code (stargate/hypercorn_patches/table.py). The commands of
    `_LAZY_COMMANDS` are imported when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _LAZY_COMMANDS and cmd_name not in self.commands:
            module, attribute = _LAZY_COMMANDS[cmd_name]
            command: click.Command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

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


# `stargate serve`: defaults are `ServeConfig`'s unless given. The README's flag table and the
# chart's values (helm/stargate/templates/_helpers.tpl) list every one
# (tests/unit/test_flag_docs.py).
def _auto_or_count(value: str) -> int | None:
    """`--max-client-connections`: `auto` (None: computed at start-up) or a count, 0 or more."""
    if value.strip().lower() == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"expected auto or an integer, got {value!r}") from None
    if count < 0:
        raise ValueError(f"must not be negative (0 = unlimited), got {count}")
    return count


SERVE = Settings(
    ServeConfig,
    Setting(
        "--stargate-id",
        env="STARGATE_ID",
        to="stargate_id",
        default=None,
        parse=lambda value: value or socket.gethostname(),
        help="Identity of this replica in logs, discovery and /debug/state. [default: the "
        "hostname]",
    ),
    *listener_settings("STARGATE", "0.0.0.0"),
    Setting(
        "--advertise-addr",
        env="STARGATE_ADVERTISE_ADDR",
        to="advertise_addr",
        type=LISTEN_ADDRESS,
        help="This replica's gRPC address as published to Pylons by WatchStargates. [default: the "
        "--listen-addr IP, or this host's address when that is 0.0.0.0/::, with the bound port]",
    ),
    Setting(
        "--stargate-discovery-dns-name",
        env="STARGATE_DISCOVERY_DNS_NAME",
        to="discovery.dns_name",
        parse=trimmed,
        help="DNS name whose A/AAAA records are this replica's peers (in Kubernetes, the headless "
        "Service), polled every --dns-poll-ms.",
    ),
    Setting(
        "--peer",
        env="STARGATE_PEERS",
        to="discovery.peers",
        kind="list",
        help="A peer replica's gRPC address (HOST:PORT or ID=HOST:PORT) for static discovery; "
        "repeatable or comma-separated.",
    ),
    Setting(
        "--peer-absent-after-ms",
        env="STARGATE_PEER_ABSENT_AFTER_MS",
        to="discovery.peer_absent_after_ms",
        type=NON_NEGATIVE_INT,
        default=30_000,  # `DiscoveryConfig` built in code checks no peer (0)
        help="A static peer that fails its gRPC health checks (one every --dns-poll-ms) for this "
        "long is left out of WatchStargates until it answers again (0 = never checked, always "
        "listed).",
    ),
    Setting(
        "--disable-dns-discovery",
        env="STARGATE_DISABLE_DNS_DISCOVERY",
        to="discovery.disable_dns_discovery",
        kind="switch",
        help="Publish only this replica in WatchStargates.",
    ),
    Setting(
        "--dns-poll-ms",
        env="STARGATE_DNS_POLL_MS",
        to="discovery.dns_poll_ms",
        type=POSITIVE_INT,
        help="Discovery poll period of the WatchStargates publisher. Must be > 0.",
    ),
    Setting(
        "--watch-heartbeat-ms",
        env="STARGATE_WATCH_HEARTBEAT_MS",
        to="discovery.watch_heartbeat_ms",
        type=NON_NEGATIVE_INT,
        help="Longest interval between re-publications of an unchanged WatchStargates snapshot "
        "(0 = every poll).",
    ),
    Setting(
        "--remote-stargate-url",
        env="STARGATE_REMOTE_WATCH_URLS",
        to="discovery.remote_stargate_urls",
        kind="list",
        help="Extra WatchStargates seeds (other regions) passed on to Pylons; repeatable or "
        "comma-separated. Never registration targets.",
    ),
    Setting(
        "--grpc-pylon-dial-addr",
        env="STARGATE_GRPC_PYLON_DIAL_ADDR",
        to="discovery.grpc_pylon_dial_addr",
        parse=trimmed,
        help="Address Pylons dial instead of each replica's advertise address (e.g. a load "
        "balancer), published on every WatchStargates entry.",
    ),
    Setting(
        "--registration-update-idle-timeout-ms",
        env="STARGATE_REGISTRATION_UPDATE_IDLE_TIMEOUT_MS",
        to="control_plane.idle_timeout_ms",
        type=NON_NEGATIVE_INT,
        help="Floor of a registration stream's idle timeout (3 x the Pylon heartbeat). 0 disables "
        "idle enforcement.",
    ),
    Setting(
        "--registration-update-max-idle-timeout-ms",
        env="STARGATE_REGISTRATION_UPDATE_MAX_IDLE_TIMEOUT_MS",
        to="control_plane.max_idle_timeout_ms",
        type=NON_NEGATIVE_INT,
        help="Cap of the idle timeout, and its value when the Pylon sends no heartbeat header. "
        "0 disables idle enforcement.",
    ),
    Setting(
        "--grpc-max-message-bytes",
        env="STARGATE_GRPC_MAX_MESSAGE_BYTES",
        to="control_plane.grpc_max_message_bytes",
        type=POSITIVE_INT,
        help="Largest gRPC message accepted; larger ones end the call with RESOURCE_EXHAUSTED.",
    ),
    Setting(
        "--worker-auth-endpoint",
        env="STARGATE_WORKER_AUTH_ENDPOINT",
        to="control_plane.worker_auth_endpoint",
        parse=trimmed,
        section="Worker authentication",
        help="The llm_gateway.LlmGateway service (HOST:PORT, http://HOST:PORT, or "
        "https://HOST:PORT for TLS) whose AuthLlmWorker maps a Pylon's bearer token to its routing "
        "key; checked at start-up. Without it (and without a token file) registration is open.",
    ),
    Setting(
        "--worker-auth-ca-file",
        env="STARGATE_WORKER_AUTH_CA_FILE",
        to="control_plane.worker_auth_ca_file",
        type=READABLE_FILE,
        section="Worker authentication",
        help="CA certificates (PEM) to verify the worker-auth gateway with: the replica then dials "
        "it over TLS (an https:// endpoint does so with the system store).",
    ),
    Setting(
        "--secrets-path",
        env="SECRETS_PATH",
        to="secrets.path",
        type=READABLE_FILE,
        section="Worker authentication",
        help="JSON secrets file of the replica itself: the bearer it presents to the worker-auth "
        "gateway (at --secrets-json-path), OAuth2 client credentials (clientId, clientSecret) and "
        "the trace exporter's tracingAccessToken. Re-read when it changes; never logged.",
    ),
    Setting(
        "--secrets-json-path",
        env="SECRETS_JSON_PATH",
        to="secrets.json_path",
        parse=str.strip,
        section="Worker authentication",
        help="Dot-separated location of the worker-auth bearer in the secrets file.",
    ),
    Setting(
        "--oauth2-provider-host",
        env="OAUTH2_PROVIDER_HOST",
        to="control_plane.oauth2_provider_host",
        parse=trimmed,
        section="Worker authentication",
        help="Mint the worker-auth bearer by OAuth2 client credentials at <host>/token (scope "
        "llm:check_worker), refreshed before it expires. Requires --secrets-path.",
    ),
    Setting(
        "--registration-token-file",
        env="STARGATE_REGISTRATION_TOKEN_FILE",
        to="control_plane.registration_token_file",
        type=READABLE_FILE,
        section="Worker authentication",
        help="File holding a shared bearer token every Pylon must present (no routing key).",
    ),
    Setting(
        "--health-check-timeout-ms",
        env="STARGATE_HEALTH_CHECK_TIMEOUT_MS",
        to="control_plane.health_check_timeout_ms",
        type=POSITIVE_INT,
        help="Timeout of one backend health probe (GET {url}/health); a backend that fails it is "
        "not routable until a later probe succeeds.",
    ),
    Setting(
        "--backend-connectivity",
        env="STARGATE_BACKEND_CONNECTIVITY",
        to="tunnels.connectivity",
        type=click.Choice(["direct", "reverse"]),
        default="direct",
        parse=Connectivity,
        section="Tunnels",
        help="direct: the replica dials quic:// backends (and reaches http(s):// ones over "
        "HTTP). reverse: also listen on --reverse-tunnel-listen-addr (UDP) for Pylons that dial "
        "in (registrations with reverse_tunnel). Must match the Pylons.",
    ),
    Setting(
        "--tunnel-protocol",
        env="STARGATE_TUNNEL_PROTOCOL",
        to="tunnels.protocol",
        default="raw-quic",
        parse=parse_tunnel_protocol,
        section="Tunnels",
        metavar="raw-quic|http3",
        help="Stream protocol inside QUIC tunnels: raw-quic (Cap'n Proto messages, no ALPN) or "
        "http3 (alias h3; ALPN h3). webtransport is refused for now. Must match the Pylons.",
    ),
    Setting(
        "--direct-quic-connections",
        env="STARGATE_DIRECT_QUIC_CONNECTIONS",
        to="tunnels.direct_connections",
        type=POSITIVE_INT,
        section="Tunnels",
        help="QUIC connections dialed per quic:// backend (all must succeed; requests round-robin "
        "over the healthy ones).",
    ),
    Setting(
        "--reverse-tunnel-listen-addr",
        env="STARGATE_REVERSE_TUNNEL_LISTEN_ADDR",
        to="tunnels.reverse_listen_addr",
        type=LISTEN_ADDRESS,
        section="Tunnels",
        help="UDP address of the reverse tunnel listener (needs --backend-connectivity reverse).",
    ),
    Setting(
        "--reverse-tunnel-pylon-dial-addr",
        env="STARGATE_REVERSE_TUNNEL_PYLON_DIAL_ADDR",
        to="tunnels.reverse_pylon_dial_addr",
        parse=trimmed,
        section="Tunnels",
        metavar="HOST:PORT",
        help="Address Pylons dial for the reverse tunnel (e.g. a UDP load balancer), sent in "
        "every ack; default: the advertised host and the bound UDP port.",
    ),
    Setting(
        "--reverse-tunnel-connect-timeout-ms",
        env="STARGATE_REVERSE_TUNNEL_CONNECT_TIMEOUT_MS",
        to="tunnels.reverse_connect_timeout_ms",
        type=NON_NEGATIVE_INT,
        section="Tunnels",
        help="How long a registration update waits for its Pylon's reverse tunnel after the "
        "first ack told it where to dial; without one its models are INACTIVE.",
    ),
    Setting(
        "--quic-connect-timeout-ms",
        env="STARGATE_QUIC_CONNECT_TIMEOUT_MS",
        to="tunnels.connect_timeout_ms",
        type=POSITIVE_INT,
        section="Tunnels",
        help="Bound of one QUIC dial (and tunnel set-up) to a quic:// backend; also bounds a "
        "reverse handshake and the delivery of its refusal.",
    ),
    Setting(
        "--quic-request-timeout-ms",
        env="STARGATE_QUIC_REQUEST_TIMEOUT_MS",
        to="tunnels.request_timeout_ms",
        type=POSITIVE_INT,
        section="Tunnels",
        help="One budget per tunneled attempt, from opening its stream to the response head "
        "(also bounds the /health probe through the tunnel); past it the attempt is a 502.",
    ),
    Setting(
        "--quic-insecure",
        env="STARGATE_QUIC_INSECURE",
        to="tunnels.insecure",
        kind="switch",
        section="Tunnels",
        help="Do not verify the certificates of quic:// backends. Without it they are checked "
        "against --quic-tls-cert-path, and quic:// registrations are refused when it is not set.",
    ),
    Setting(
        "--quic-tls-cert-path",
        env="STARGATE_QUIC_TLS_CERT_PATH",
        to="tunnels.cert_path",
        type=READABLE_FILE,
        section="Tunnels",
        help="QUIC certificate chain (PEM): the reverse tunnel listener's identity (with "
        "--quic-tls-key-path; a generated self-signed one, SANs localhost and stargate, without "
        "it), and the certificates trusted when dialing quic:// backends. Re-read every "
        "--tls-reload-interval-ms. (The Rust replica's TLS pair; ours is the HTTP one.)",
    ),
    Setting(
        "--quic-tls-key-path",
        env="STARGATE_QUIC_TLS_KEY_PATH",
        to="tunnels.key_path",
        type=READABLE_FILE,
        section="Tunnels",
        help="Private key (PEM) of --quic-tls-cert-path.",
    ),
    Derived("tunnels.reload_interval_ms", lambda values: values["tls_reload_interval_ms"]),
    Setting(
        "--proxy-max-connect-retries",
        env="STARGATE_PROXY_MAX_CONNECT_RETRIES",
        to="proxy.max_connect_retries",
        type=NON_NEGATIVE_INT,
        help="Per request: how many times a transport failure (refused, reset, response-head "
        "timeout) may move the request to another backend.",
    ),
    Setting(
        "--proxy-max-request-retries",
        env="STARGATE_PROXY_MAX_REQUEST_RETRIES",
        to="proxy.max_request_retries",
        type=NON_NEGATIVE_INT,
        help="Per request: how many retryable upstream 429/503 responses may be retried elsewhere.",
    ),
    Setting(
        "--proxy-max-replay-body-bytes",
        env="STARGATE_PROXY_MAX_REPLAY_BODY_BYTES",
        to="proxy.max_replay_body_bytes",
        type=NON_NEGATIVE_INT,
        help="Largest request body accepted (kept in memory for replay on a retry); larger is 413.",
    ),
    Setting(
        "--proxy-require-pylon-retry-signal",
        env="STARGATE_PROXY_REQUIRE_PYLON_RETRY_SIGNAL",
        to="proxy.require_pylon_retry_signal",
        type=click.BOOL,
        help="Retry an upstream 429/503 only when it carries x-stargate-retryable: true "
        "(takes a value: --proxy-require-pylon-retry-signal=false).",
    ),
    Setting(
        "--proxy-retry-budget-header",
        env="STARGATE_PROXY_RETRY_BUDGET_HEADER",
        to="proxy.retry_budget_header",
        parse=lambda value: value.strip().lower() or None,
        help="Request header carrying a retry budget in ms (retries start only within it); "
        "empty disables.",
    ),
    Setting(
        "--proxy-response-header-timeout-ms",
        env="STARGATE_PROXY_RESPONSE_HEADER_TIMEOUT_MS",
        to="proxy.response_header_timeout_ms",
        type=POSITIVE_INT,
        help="Longest wait for a backend's response head (then 502 or a retry); the streamed body "
        "has no timeout.",
    ),
    Setting(
        "--proxy-connect-timeout-ms",
        env="STARGATE_PROXY_CONNECT_TIMEOUT_MS",
        to="proxy.connect_timeout_ms",
        type=POSITIVE_INT,
        help="Timeout of one TCP (and TLS) connect to a backend.",
    ),
    Setting(
        "--proxy-max-connections-per-backend",
        env="STARGATE_PROXY_MAX_CONNECTIONS_PER_BACKEND",
        to="proxy.max_connections_per_backend",
        type=POSITIVE_INT,
        help="Upstream connections one backend may have open, so concurrent requests and streams "
        "to it. Requests go to a backend below its cap first; when every candidate is at its cap "
        "a request waits up to 5 s for a free connection, then gets 503. Engines batch hundreds of "
        "sequences; each connection is one descriptor.",
    ),
    Setting(
        "--accept-openai-requests",
        env="STARGATE_ACCEPT_OPENAI_REQUESTS",
        to="proxy.accept_openai_requests",
        kind="switch",
        help="Let plain OpenAI clients through: without x-model, the model comes from the JSON "
        "body, x-request-id is generated and returned, x-input-tokens is estimated.",
    ),
    Setting(
        "--unmeasured-backends",
        env="STARGATE_UNMEASURED_BACKENDS",
        to="proxy.estimate_unmeasured_backends",
        type=click.Choice(["estimate", "exclude"]),
        default="estimate",
        parse=lambda value: value == "estimate",
        help="How load balancers see a backend whose Pylon has published no input TPS yet (a "
        "fresh engine: the Pylon publishes it after 5 completed requests or a calibration). "
        "estimate: as the mean of the model's measured backends (or all alike when none is), so "
        "every algorithm can route by the queue counts from the first request. exclude: the Rust "
        "rule, no capacity (pulsar and wait-and-widen skip it; with none measured they answer "
        "503).",
    ),
    # docs/outliers.md: outlier ejection and slow start.
    Setting(
        "--outlier-consecutive-failures",
        env="STARGATE_OUTLIER_CONSECUTIVE_FAILURES",
        to="proxy.outlier_consecutive_failures",
        type=NON_NEGATIVE_INT,
        help="Eject a backend after this many final 5xx responses in a row, or transport "
        "failures in a row (a retryable 429/503 is load, not a failure; a success resets). "
        "0 = no outlier ejection.",
    ),
    Setting(
        "--outlier-base-ejection-ms",
        env="STARGATE_OUTLIER_BASE_EJECTION_MS",
        to="proxy.outlier_base_ejection_ms",
        type=POSITIVE_INT,
        help="An ejection lasts this long times the number of times the backend has been "
        "ejected; then it is routed again, no probe needed.",
    ),
    Setting(
        "--outlier-max-ejection-ms",
        env="STARGATE_OUTLIER_MAX_EJECTION_MS",
        to="proxy.outlier_max_ejection_ms",
        type=POSITIVE_INT,
        help="Longest ejection (at least --outlier-base-ejection-ms).",
    ),
    Setting(
        "--outlier-max-ejection-percent",
        env="STARGATE_OUTLIER_MAX_EJECTION_PERCENT",
        to="proxy.outlier_max_ejection_percent",
        type=click.IntRange(0, 100),
        help="At most this percentage of the registered backends is ejected at once (rounded "
        "down), but at least one.",
    ),
    Setting(
        "--outlier-decay-interval-ms",
        env="STARGATE_OUTLIER_DECAY_INTERVAL_MS",
        to="proxy.outlier_decay_interval_ms",
        type=POSITIVE_INT,
        help="The ejection count of a backend back in rotation drops by one per interval, so "
        "one that recovered is next ejected for the base time again.",
    ),
    Setting(
        "--slow-start-window-ms",
        env="STARGATE_SLOW_START_WINDOW_MS",
        to="proxy.slow_start_window_ms",
        type=NON_NEGATIVE_INT,
        help="A backend that joins a model after the replica's warmup ramps up to its full "
        "share over this window, while some other backend of the model is past its own. "
        "0 = no slow start.",
    ),
    Setting(
        "--slow-start-aggression",
        env="STARGATE_SLOW_START_AGGRESSION",
        to="proxy.slow_start_aggression",
        type=click.FloatRange(min=0, min_open=True),
        help="Shape of the ramp: the share is (time in window / window) ^ (1 / aggression); "
        "1.0 is linear, larger values ramp faster at first.",
    ),
    Setting(
        "--slow-start-min-weight-percent",
        env="STARGATE_SLOW_START_MIN_WEIGHT_PERCENT",
        to="proxy.slow_start_min_weight_percent",
        type=click.FloatRange(0, 100),
        help="The least share (percent of a full one) a ramping backend gets.",
    ),
    Setting(
        "--derive-affinity-key",
        env="STARGATE_DERIVE_AFFINITY_KEY",
        to="proxy.derive_affinity_key",
        kind="switch",
        help="Route a request without x-cache-affinity-key as if it carried one derived from "
        "its prompt: a hash of its opening (system/developer messages and the first user turn), "
        "the same for every turn of a conversation, plus a chain of block hashes for the "
        "prefix-aware balancer. Routing only: nothing is added upstream.",
    ),
    Setting(
        "--derive-affinity-key-block-bytes",
        env="STARGATE_DERIVE_AFFINITY_KEY_BLOCK_BYTES",
        to="proxy.derive_affinity_key_block_bytes",
        type=POSITIVE_INT,
        help="Bytes per block of a derived prefix chain; the conversations sharing a system "
        "prompt of at least one block form a group.",
    ),
    Setting(
        "--derive-affinity-key-depth",
        env="STARGATE_DERIVE_AFFINITY_KEY_DEPTH",
        to="proxy.derive_affinity_key_depth",
        type=POSITIVE_INT,
        help="Blocks a derived prefix chain holds at most: block bytes x depth is how much of a "
        "prompt is read (at most 16 MiB).",
    ),
    Setting(
        "--loading-comments/--no-loading-comments",
        env="STARGATE_LOADING_COMMENTS",
        to="proxy.loading_comments",
        kind="toggle",
        help="A streaming request (stream: true) held for a model pool's swap or a routing "
        "wait gets, half a second into the hold, its 200 text/event-stream head and an SSE "
        "comment (': loading model "
        "M eta 12s') every --loading-comment-interval-ms until its engine answers, so idle "
        "timeouts of proxies and SDKs do not cut it; a failure then ends the stream with an "
        "error event and [DONE].",
    ),
    Setting(
        "--loading-comment-interval-ms",
        env="STARGATE_LOADING_COMMENT_INTERVAL_MS",
        to="proxy.loading_comment_interval_ms",
        type=POSITIVE_INT,
        help="Time between the loading comments of a held streaming request (100 to 9999: below "
        "the 10 s idle read timeout common in SDKs).",
    ),
    Setting(
        "--lb-config-path",
        env="STARGATE_LB_CONFIG_PATH",
        to="proxy.lb_config_path",
        type=READABLE_FILE,
        help="JSON load-balancer config (default algorithm, per-model algorithms, header "
        "overrides). Without it: power-of-n, with every algorithm selectable by x-routing-method.",
    ),
    Setting(
        "--upstream-ca-file",
        env="STARGATE_UPSTREAM_CA_FILE",
        to="proxy.upstream_ca_file",
        type=READABLE_FILE,
        help="Extra CA certificates (PEM) trusted for https:// backends, besides the system store.",
    ),
    Setting(
        "--tls-cert-path",
        env="STARGATE_TLS_CERT_PATH",
        to="tls.cert_path",
        type=READABLE_FILE,
        default=None,
        section="TLS",
        help="Certificate chain (PEM) served on the HTTP and both gRPC listeners. With "
        "--tls-key-path; re-read every --tls-reload-interval-ms.",
    ),
    Setting(
        "--tls-key-path",
        env="STARGATE_TLS_KEY_PATH",
        to="tls.key_path",
        type=READABLE_FILE,
        default=None,
        section="TLS",
        help="Private key (PEM) of --tls-cert-path.",
    ),
    Setting(
        "--tls-reload-interval-ms",
        env="STARGATE_TLS_RELOAD_INTERVAL_MS",
        to="tls.reload_interval_ms",
        type=POSITIVE_INT,
        section="TLS",
        help="How often the TLS pair is re-read; a changed, valid pair is served to new "
        "connections, an invalid one is refused (ERROR) and the last good one kept.",
    ),
    Setting(
        "--otel-endpoint",
        env="OTEL_EXPORTER_OTLP_ENDPOINT",
        to="tracing.endpoint",
        parse=trimmed,
        section="Tracing",
        help="OTLP/gRPC collector (http://host:4317) to export request traces to. Without it no "
        "span is recorded and traceparent is forwarded untouched.",
    ),
    Setting(
        "--otel-service-name",
        env="OTEL_SERVICE_NAME",
        to="tracing.service_name",
        section="Tracing",
        help="service.name of the exported spans.",
    ),
    Setting(
        "--pool-config",
        env="STARGATE_POOL_CONFIG",
        to="activator.pool_config_path",
        type=READABLE_FILE,
        section="Model pools",
        help="YAML file of model pools: models sharing one slot, swapped on demand while requests "
        "for a non-resident member are held. Without it no request is held.",
    ),
    Setting(
        "--pool-resync-interval-ms",
        env="STARGATE_POOL_RESYNC_INTERVAL_MS",
        to="activator.resync_interval_ms",
        type=POSITIVE_INT,
        section="Model pools",
        help="At most this often a pool re-checks which member is resident.",
    ),
    Setting(
        "--pool-controller-timeout-ms",
        env="STARGATE_POOL_CONTROLLER_TIMEOUT_MS",
        to="activator.controller_timeout_ms",
        type=POSITIVE_INT,
        section="Model pools",
        help="Timeout of each pool controller call (scale, patch, process start/stop), so a hung "
        "API server cannot freeze the pools.",
    ),
    Setting(
        "--pool-breaker-failures",
        env="STARGATE_POOL_BREAKER_FAILURES",
        to="activator.breaker_failures",
        type=NON_NEGATIVE_INT,
        section="Model pools",
        help="After this many failed swaps in a row to a pool member, its breaker opens: requests "
        "for it fail fast (503 pool_member_unavailable) and start no swap until the cooldown "
        "ends, then one probe swap decides. 0 turns the breaker off. A pool's breakerFailures "
        "overrides it.",
    ),
    Setting(
        "--pool-breaker-cooldown-ms",
        env="STARGATE_POOL_BREAKER_COOLDOWN_MS",
        to="activator.breaker_cooldown_ms",
        type=POSITIVE_INT,
        section="Model pools",
        help="How long an open member breaker refuses before its probe swap; doubled after each "
        "failed probe, up to 8 x. A pool's breakerCooldown overrides it.",
    ),
    Setting(
        "--pool-ownership",
        env="STARGATE_POOL_OWNERSHIP",
        to="activator.ownership.mode",
        type=click.Choice(["local", "lease"]),
        section="Model pools",
        help="Who runs each pool's activator: local (this replica, for every pool: one replica or "
        "the process controller) or lease (one Kubernetes Lease per pool; its holder decides and "
        "the other replicas hand it their requests for the pool).",
    ),
    Setting(
        "--pool-lease-namespace",
        env="STARGATE_POOL_LEASE_NAMESPACE",
        to="activator.ownership.lease_namespace",
        parse=trimmed,
        section="Model pools",
        help="Namespace of the pool Leases. Default: the replica's own (POD_NAMESPACE, else the "
        "service account's).",
    ),
    Setting(
        "--pool-lease-prefix",
        env="STARGATE_POOL_LEASE_PREFIX",
        to="activator.ownership.lease_prefix",
        parse=str.strip,
        section="Model pools",
        help="Pool Leases are named <prefix>-pool-<pool>; the chart passes its release name.",
    ),
    Setting(
        "--pool-lease-duration-ms",
        env="STARGATE_POOL_LEASE_DURATION_MS",
        to="activator.ownership.lease_duration_ms",
        type=POSITIVE_INT,
        section="Model pools",
        help="A pool Lease not renewed for this long may be taken over (the failover time after "
        "a crash).",
    ),
    Setting(
        "--pool-lease-renew-deadline-ms",
        env="STARGATE_POOL_LEASE_RENEW_DEADLINE_MS",
        to="activator.ownership.renew_deadline_ms",
        type=POSITIVE_INT,
        section="Model pools",
        help="A pool owner whose renewals have failed for this long stops deciding for the pool "
        "(before its Lease can expire).",
    ),
    Setting(
        "--pool-lease-retry-period-ms",
        env="STARGATE_POOL_LEASE_RETRY_PERIOD_MS",
        to="activator.ownership.retry_period_ms",
        type=POSITIVE_INT,
        section="Model pools",
        help="How often an owner renews its pool Leases and the other replicas re-read them.",
    ),
    Setting(
        "--pool-owner-url",
        env="STARGATE_POOL_OWNER_URL",
        to="activator.ownership.owner_url",
        parse=lambda value: (value or "").strip().rstrip("/") or None,
        section="Model pools",
        help="This replica's HTTP listener as its peers reach it (http://POD_IP:8000), recorded "
        "in the Leases it holds. Default: the advertise host with the HTTP port.",
    ),
    *metrics_listener_settings("STARGATE", "0.0.0.0"),
    Setting(
        "--metrics-prefix",
        env="STARGATE_METRICS_PREFIX",
        to="metrics_prefix",
        parse=validate_metrics_prefix,
        help="Prefix of every metric name (e.g. llm_request_router_).",
    ),
    Setting(
        "--debug-endpoints/--no-debug-endpoints",
        env="STARGATE_DEBUG_ENDPOINTS",
        to="debug_endpoints",
        kind="toggle",
        help="Serve GET /debug/state (listener addresses and active model ids) on the HTTP "
        "listener; --no-debug-endpoints makes it a 404 like any unknown path.",
    ),
    Setting(
        "--shutdown-delay-ms",
        env="STARGATE_SHUTDOWN_DELAY_MS",
        to="shutdown_delay_ms",
        type=NON_NEGATIVE_INT,
        help="After SIGTERM, how long the replica keeps serving while it leaves the Service "
        "(/readyz 503, connections told to close) before it stops accepting. Cover your endpoint "
        "propagation time. SIGINT skips it; 0 stops accepting at once.",
    ),
    Setting(
        "--shutdown-drain-timeout-ms",
        env="STARGATE_SHUTDOWN_DRAIN_TIMEOUT_MS",
        to="shutdown_drain_timeout_ms",
        type=NON_NEGATIVE_INT,
        help="After SIGTERM/SIGINT, how long in-flight requests and streams may take to finish "
        "before the process exits 1.",
    ),
    Setting(
        "--request-body-timeout-ms",
        env="STARGATE_REQUEST_BODY_TIMEOUT_MS",
        to="request_body_timeout_ms",
        type=NON_NEGATIVE_INT,
        help="A request on the HTTP listener whose body has not fully arrived this long after its "
        "head is answered 408 and its connection closed (HTTP/2: its stream reset), so a stalled "
        "upload cannot hold a connection, an in-flight slot or a drain. 0 disables.",
    ),
    Setting(
        "--max-client-connections",
        env="STARGATE_MAX_CLIENT_CONNECTIONS",
        to="max_client_connections",
        default="auto",
        metavar="auto|INTEGER",
        parse=_auto_or_count,
        help="Open client connections the HTTP listener serves; 32 more serve only /healthz and "
        "/readyz (other requests: 503 too_many_connections), and past those a connection is "
        "answered the same 503 (HTTP/2: its streams refused) and closed. auto computes it at "
        "start-up from the open-file limit: 2 descriptors per connection (client and upstream) "
        "after the reserve and 128 of headroom. 0 = unlimited.",
    ),
    *warmup_settings("STARGATE"),
    *log_settings("STARGATE_LOG_LEVEL", "STARGATE_LOG_FORMAT"),
    # Listed in --help under these headings, after the other options (README: TLS, Worker
    # authentication, Tracing, Model pools).
    sections=("Tunnels", "TLS", "Worker authentication", "Tracing", "Model pools"),
    # Both paths or neither; one alone is a usage error naming the other.
    factories={"tls": TlsConfig.of},
)


@main.command(cls=SettingsCommand, settings=SERVE)
def serve(**values: Any) -> None:
    """Run one replica until SIGTERM or SIGINT."""
    configure_logging(values["log_level"], values["log_format"])
    try:
        config = SERVE.build(values)
    except ConfigError as error:
        raise click.UsageError(str(error)) from None
    from stargate import runtime  # imported here so `--help` stays fast

    sys.exit(runtime.run(config))


DEMO = Settings(
    DemoConfig,
    *listener_settings("STARGATE_DEMO", "127.0.0.1"),
    *metrics_listener_settings("STARGATE_DEMO", "127.0.0.1"),
    *warmup_settings("STARGATE_DEMO"),
    Setting(
        "--tunnel",
        env="STARGATE_DEMO_TUNNEL",
        to="tunnel",
        type=click.Choice(["http", "raw-quic", "http3"]),
        help="How the replica reaches the Pylons: http, or a QUIC tunnel (docs/tunnels.md).",
    ),
    Setting(
        "--tunnel-connectivity",
        env="STARGATE_DEMO_TUNNEL_CONNECTIVITY",
        to="tunnel_connectivity",
        type=click.Choice(["direct", "reverse"]),
        help="With --tunnel: direct (the replica dials each Pylon's UDP listener) or reverse "
        "(each Pylon dials the replica's).",
    ),
)


@main.command(cls=SettingsCommand, settings=DEMO)
def demo(**values: Any) -> None:
    """Run a replica, two mock engines and two Pylons here; Ctrl-C stops them all."""
    import trio

    from stargate.demo import run_demo

    sys.exit(trio.run(run_demo, DEMO.build(values)))
