"""The registration admission rules of `stargate/control_plane/admission.py`, without processes.

These functions are pure (a message and a few values in, a value or a `GrpcError` out; no I/O, no
clock, no routing state), so every rule of docs/control-plane.md, "Admission", "Idle timeout" and
"Model status", and of docs/decisions.md, D3 (http/https backends only, host names allowed), is
pinned here in milliseconds: the backend URL rules, admission of a stream's first message and the
identity it yields, the identity every later message must keep, the bearer token of the
`authorization` header, the idle-timeout negotiation, the wire-to-routing-state stats conversion
and each listed model's effective route. tests/e2e/test_control_plane.py checks the same rules
through a real process and the gRPC wire; this file checks the corner cases that are too many to
drive that way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping

import pytest

from stargate.control_plane.admission import (
    HEARTBEAT_HEADER,
    admit,
    bearer_token,
    check_identity,
    negotiate_idle_timeout,
    routes_for_update,
    stats_from_wire,
    validate_backend_url,
)
from stargate.grpc_asgi import GrpcError, GrpcStatus
from stargate.protocol import stargate_pb2 as pb
from stargate.routing import BackendRoute, ModelStats, RegistrationIdentity

LOGGER = "stargate.control_plane.admission"

ACTIVE = pb.INFERENCE_SERVER_STATUS_ACTIVE
INACTIVE = pb.INFERENCE_SERVER_STATUS_INACTIVE
UNKNOWN = pb.INFERENCE_SERVER_STATUS_UNKNOWN

SERVER_ID = "pylon-0"
URL = "http://10.0.0.7:8000"

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1

# The messages of docs/control-plane.md, Admission: URL problems share one prefix.
URL_PREFIX = "invalid inference_server_url: inference_server_url "
NOT_A_URL = URL_PREFIX + "must be a valid URL"
BAD_SCHEME = URL_PREFIX + "scheme must be quic, http or https"
REVERSE_BAD_SCHEME = URL_PREFIX + "scheme must be http or https"
NO_HOST = URL_PREFIX + "must include host"
ID_EMPTY = "inference_server_id is empty"
URL_EMPTY = "inference_server_url is empty"
REVERSE_REFUSED = "reverse tunnel flag set but no reverse tunnel config"

# Idle-timeout flags: the defaults of docs/control-plane.md, Idle timeout (60 s floor, 300 s cap).
FLOOR_MS = 60_000
CAP_MS = 300_000


def _message(
    server_id: str = SERVER_ID,
    url: str = URL,
    *,
    cluster_id: str = "",
    reverse_tunnel: bool = False,
    models: Mapping[str, pb.InferenceServerModelRegistration] | None = None,
) -> pb.InferenceServerRegistration:
    return pb.InferenceServerRegistration(
        inference_server_id=server_id,
        inference_server_url=url,
        cluster_id=cluster_id,
        reverse_tunnel=reverse_tunnel,
        models=models or {},
    )


def _model(
    status: pb.InferenceServerStatus = ACTIVE, stats: pb.ModelStats | None = None
) -> pb.InferenceServerModelRegistration:
    """A model entry; `stats=None` leaves the stats field absent (not default)."""
    return pb.InferenceServerModelRegistration(stats=stats, status=status)


def _rejection(call: Callable[[], object]) -> GrpcError:
    with pytest.raises(GrpcError) as excinfo:
        call()
    return excinfo.value


def _assert_invalid(error: GrpcError, message: str) -> None:
    assert error.status is GrpcStatus.INVALID_ARGUMENT
    assert error.message == message


# ---- validate_backend_url: docs/control-plane.md, Admission; docs/decisions.md, D3 -------------

ACCEPTED_URLS = [
    pytest.param("http://10.0.0.7:8000", id="http-ipv4-port"),
    pytest.param("https://10.0.0.7:8443", id="https-ipv4-port"),
    # "no port and no scheme default" cannot happen: http and https default to 80 and 443.
    pytest.param("http://10.0.0.7", id="http-default-port"),
    pytest.param("https://pylon", id="https-default-port"),
    pytest.param("http://pylon:", id="empty-port-means-default"),
    # D3: host names are accepted as well as IP literals (an HTTP client resolves them).
    pytest.param("http://pylon-0.pylon.models.svc.cluster.local:8000", id="dns-name"),
    pytest.param("http://localhost:8000", id="localhost"),
    # Schemes are case-insensitive (RFC 3986).
    pytest.param("HTTP://10.0.0.7:8000", id="upper-case-http"),
    pytest.param("HttpS://pylon:8443", id="mixed-case-https"),
    pytest.param("http://[::1]:8000", id="ipv6-loopback"),
    pytest.param("https://[2001:db8::7]", id="ipv6-default-port"),
    pytest.param("http://user:secret@pylon:8000", id="userinfo"),
    pytest.param("http://user@10.0.0.7:8000", id="user-only"),
    pytest.param("http://pylon:8000/v1/prefix?x=1#frag", id="path-query-fragment"),
    pytest.param("http://pylon:0", id="port-0"),
    pytest.param("http://pylon:65535", id="port-max"),
]


@pytest.mark.parametrize("url", ACCEPTED_URLS)
def test_absolute_http_and_https_urls_with_a_host_are_accepted(url: str) -> None:
    validate_backend_url(url)  # returns None; raising is the only way to refuse


NOT_URLS = [
    pytest.param("", id="empty"),
    pytest.param("pylon", id="bare-host"),
    pytest.param("//pylon:8000", id="scheme-relative"),
    pytest.param("1http://pylon:8000", id="scheme-starts-with-digit"),
    pytest.param("http://pylon:65536", id="port-above-65535"),
    pytest.param("http://pylon:-1", id="negative-port"),
    pytest.param("http://pylon:+80", id="signed-port"),
    pytest.param("http://pylon: 80", id="space-in-port"),
    pytest.param("http://pylon:http", id="named-port"),
    pytest.param("http://pylon:80:90", id="two-ports"),
    pytest.param("http://pylon:\u0668\u0660", id="non-ascii-digit-port"),
    pytest.param("http://[::1", id="unclosed-ipv6-bracket"),
    pytest.param("http://::1:8000", id="ipv6-without-brackets"),
    pytest.param("http://[pylon]:8000", id="brackets-around-a-name"),
]


@pytest.mark.parametrize("url", NOT_URLS)
def test_urls_that_do_not_parse_are_invalid_without_parser_detail(url: str) -> None:
    _assert_invalid(_rejection(lambda: validate_backend_url(url)), NOT_A_URL)


@pytest.mark.parametrize(
    "url",
    [
        # A single colon parses as `scheme:path` under RFC 3986 but has no authority: refused
        # either way (which of the two messages applies is the parser's business).
        pytest.param("pylon:8000", id="host-port-without-scheme"),
        pytest.param("http:pylon", id="no-double-slash"),
        pytest.param("http:/pylon", id="one-slash"),
    ],
)
def test_urls_without_an_authority_are_refused(url: str) -> None:
    error = _rejection(lambda: validate_backend_url(url))
    assert error.status is GrpcStatus.INVALID_ARGUMENT
    assert error.message.startswith(URL_PREFIX)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("grpc://10.0.0.7:50051", id="grpc"),
        pytest.param("h2c://pylon:8000", id="h2c"),
        pytest.param("ws://pylon:8000", id="ws"),
        pytest.param("ftp://pylon", id="ftp"),
        pytest.param("httpx://pylon:8000", id="http-prefix"),
        pytest.param("http+unix://pylon", id="http-plus"),
        # The scheme is checked before the host: a hostless URL still names the scheme problem.
        pytest.param("grpc://", id="grpc-without-host"),
    ],
)
def test_other_schemes_are_refused_naming_quic_http_and_https(url: str) -> None:
    _assert_invalid(_rejection(lambda: validate_backend_url(url)), BAD_SCHEME)
    # A reverse registration names only what it may use: its engine's http(s) URL.
    _assert_invalid(_rejection(lambda: validate_backend_url(url, True)), REVERSE_BAD_SCHEME)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("quic://10.0.0.7:4433", id="quic"),
        pytest.param("QUIC://10.0.0.7:4433", id="upper-case-quic"),
        pytest.param("quic://[::1]:4433", id="quic-ipv6"),
    ],
)
def test_a_direct_tunnel_url_is_quic_with_an_ip_literal_and_a_port(url: str) -> None:
    # docs/tunnels.md, Admission: the Rust rules for quic:// (the replica dials it).
    validate_backend_url(url)
    _assert_invalid(_rejection(lambda: validate_backend_url(url, True)), REVERSE_BAD_SCHEME)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        pytest.param("quic://pylon:4433", URL_PREFIX + "host must be an IP address", id="name"),
        pytest.param("quic://10.0.0.7", URL_PREFIX + "must include port", id="no-port"),
        pytest.param("quic://10.0.0.7:", URL_PREFIX + "must include port", id="empty-port"),
        pytest.param("quic://", NO_HOST, id="no-host"),
    ],
)
def test_a_quic_url_without_an_ip_literal_or_a_port_is_refused(url: str, message: str) -> None:
    _assert_invalid(_rejection(lambda: validate_backend_url(url)), message)


def test_a_reverse_registration_is_admitted_where_a_reverse_listener_is_configured() -> None:
    identity = admit(_message(reverse_tunnel=True), None, reverse_listener=True)
    assert identity.reverse_tunnel
    assert not admit(_message(), None, reverse_listener=True).reverse_tunnel


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("http://", id="nothing-after-scheme"),
        pytest.param("https://:8443", id="port-only"),
        pytest.param("http://user:secret@:8000", id="userinfo-only"),
        pytest.param("http://?x=1", id="query-only"),
        pytest.param("http://#frag", id="fragment-only"),
    ],
)
def test_urls_without_a_host_are_refused(url: str) -> None:
    _assert_invalid(_rejection(lambda: validate_backend_url(url)), NO_HOST)


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("http://pyl on:8000", id="space-in-host"),
        pytest.param("http://[::1]junk:8000", id="text-after-ipv6-bracket"),
    ],
)
def test_urls_with_a_malformed_host_do_not_parse(url: str) -> None:
    _assert_invalid(_rejection(lambda: validate_backend_url(url)), NOT_A_URL)


# ---- admit: the first message (docs/control-plane.md, Admission) ------------------------------


@pytest.mark.parametrize(
    ("cluster_id", "routing_key", "expected_cluster_id"),
    [
        pytest.param("", None, SERVER_ID, id="no-cluster-is-the-server-id"),
        pytest.param("shared", None, "shared", id="explicit-cluster"),
        pytest.param("", "tenant-a", SERVER_ID, id="routing-key-kept"),
        pytest.param("shared", "tenant-a", "shared", id="cluster-and-routing-key"),
    ],
)
def test_admission_derives_the_identity(
    cluster_id: str, routing_key: str | None, expected_cluster_id: str
) -> None:
    identity = admit(_message(cluster_id=cluster_id), routing_key)
    assert identity == RegistrationIdentity(
        inference_server_id=SERVER_ID,
        cluster_id=expected_cluster_id,
        url=URL,
        routing_key=routing_key,
    )


def test_the_admitted_url_is_kept_verbatim() -> None:
    # Later messages are compared to it as a string, so it must not be normalised.
    url = "HTTP://Pylon-0:8000/prefix/"
    assert admit(_message(url=url), None).url == url


@pytest.mark.parametrize(
    "server_id",
    [
        pytest.param(" ", id="blank"),
        pytest.param(" pylon-0 ", id="surrounding-spaces"),
        pytest.param("\u00e9", id="non-ascii"),
    ],
)
def test_only_an_empty_server_id_is_refused(server_id: str) -> None:
    # The rule is "empty", not "blank": ids are not trimmed.
    assert admit(_message(server_id), None).inference_server_id == server_id


@pytest.mark.parametrize(
    "models",
    [
        pytest.param({}, id="no-models-is-a-heartbeat"),
        pytest.param({"": _model(), " m ": _model()}, id="ids-not-validated"),
        pytest.param({"m": _model(stats=None)}, id="missing-stats"),
        pytest.param({"m": _model(INACTIVE)}, id="inactive"),
        pytest.param({"m": _model(UNKNOWN)}, id="unknown-status"),
    ],
)
def test_models_play_no_part_in_admission(
    models: Mapping[str, pb.InferenceServerModelRegistration],
) -> None:
    assert admit(_message(models=models), None) == admit(_message(), None)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        pytest.param(_message(""), ID_EMPTY, id="empty-id"),
        pytest.param(_message("", ""), ID_EMPTY, id="id-before-url"),
        pytest.param(_message("", "quic://10.0.0.7:1"), ID_EMPTY, id="id-before-scheme"),
        pytest.param(_message("", reverse_tunnel=True), ID_EMPTY, id="id-before-reverse"),
        pytest.param(_message(url=""), URL_EMPTY, id="empty-url"),
        pytest.param(_message(url="", reverse_tunnel=True), URL_EMPTY, id="url-before-reverse"),
        pytest.param(_message(url="pylon"), NOT_A_URL, id="unparsable-url"),
        pytest.param(_message(url="grpc://pylon:1"), BAD_SCHEME, id="scheme"),
        pytest.param(_message(url="http://"), NO_HOST, id="host"),
        pytest.param(
            _message(url="grpc://pylon:1", reverse_tunnel=True),
            REVERSE_BAD_SCHEME,
            id="url-then-reverse",
        ),
        pytest.param(_message(reverse_tunnel=True), REVERSE_REFUSED, id="reverse-tunnel"),
        pytest.param(
            _message(cluster_id="c", reverse_tunnel=True),
            REVERSE_REFUSED,
            id="reverse-with-cluster",
        ),
    ],
)
def test_admission_rejections_in_order(
    message: pb.InferenceServerRegistration, expected: str
) -> None:
    _assert_invalid(_rejection(lambda: admit(message, None)), expected)


@pytest.mark.parametrize(
    "url",
    [*NOT_URLS[1:], "grpc://pylon:1", "quic://pylon:4433", "https://:8443", "http://#frag"],
)
def test_admission_applies_every_url_rule(url: str) -> None:
    # The empty URL has its own message (see above); every other URL rule is validate_backend_url.
    refused = _rejection(lambda: validate_backend_url(url))
    error = _rejection(lambda: admit(_message(url=url), "tenant-a"))
    assert (error.status, error.message) == (refused.status, refused.message)


@pytest.mark.parametrize("url", ACCEPTED_URLS)
def test_admission_accepts_every_accepted_url(url: str) -> None:
    assert admit(_message(url=url), None).url == url


# ---- check_identity: every later message keeps the admitted identity --------------------------


def _admitted(cluster_id: str = "") -> RegistrationIdentity:
    return admit(_message(cluster_id=cluster_id), "tenant-a")


@pytest.mark.parametrize(
    ("admitted_cluster", "message"),
    [
        pytest.param("", _message(), id="the-first-message-again"),
        pytest.param("c", _message(cluster_id="c"), id="same-explicit-cluster"),
        # The effective cluster id is compared: "" means the server id.
        pytest.param("", _message(cluster_id=SERVER_ID), id="explicit-server-id-as-cluster"),
        pytest.param(SERVER_ID, _message(), id="empty-cluster-equals-server-id"),
        pytest.param(
            "", _message(models={"m": _model(), "n": _model(INACTIVE)}), id="models-may-change"
        ),
        pytest.param("", _message(models={"m": _model(stats=None)}), id="stats-may-go-missing"),
    ],
)
def test_messages_that_keep_the_identity_pass(
    admitted_cluster: str, message: pb.InferenceServerRegistration
) -> None:
    check_identity(message, _admitted(admitted_cluster))  # no exception


@pytest.mark.parametrize(
    ("admitted_cluster", "message", "expected"),
    [
        pytest.param(
            "", _message(reverse_tunnel=True), "reverse tunnel flag changed", id="reverse-flag"
        ),
        pytest.param(
            "", _message(url="http://10.0.0.8:8000"), "inference_server_url changed", id="url-host"
        ),
        # Compared as strings: an equivalent spelling is still a change.
        pytest.param(
            "", _message(url=URL + "/"), "inference_server_url changed", id="url-trailing-slash"
        ),
        pytest.param(
            "", _message(url=URL.upper()), "inference_server_url changed", id="url-letter-case"
        ),
        # No URL validation mid-stream: an invalid URL is just a changed one.
        pytest.param("", _message(url=""), "inference_server_url changed", id="url-emptied"),
        pytest.param(
            "", _message(url="quic://10.0.0.7:1"), "inference_server_url changed", id="url-quic"
        ),
        pytest.param("", _message("pylon-1"), "inference_server_id changed", id="server-id"),
        pytest.param("", _message(""), "inference_server_id changed", id="server-id-emptied"),
        pytest.param(
            "c", _message("pylon-1", cluster_id="c"), "inference_server_id changed", id="id-only"
        ),
        pytest.param("", _message(cluster_id="c"), "cluster_id changed", id="cluster-set"),
        pytest.param("c", _message(), "cluster_id changed", id="cluster-emptied"),
        pytest.param("c", _message(cluster_id="d"), "cluster_id changed", id="cluster-replaced"),
        # Checked in the order reverse flag, URL, id, cluster id.
        pytest.param(
            "",
            _message("pylon-1", "http://10.0.0.8:1", cluster_id="c", reverse_tunnel=True),
            "reverse tunnel flag changed",
            id="reverse-first",
        ),
        pytest.param(
            "",
            _message("pylon-1", "http://10.0.0.8:1", cluster_id="c"),
            "inference_server_url changed",
            id="url-before-id",
        ),
        pytest.param(
            "", _message("pylon-1", cluster_id="c"), "inference_server_id changed", id="id-first"
        ),
        # With no explicit cluster the effective cluster changes with the id; the id is named.
        pytest.param(
            "", _message("pylon-1"), "inference_server_id changed", id="id-before-implied-cluster"
        ),
    ],
)
def test_identity_changes_are_invalid_argument(
    admitted_cluster: str, message: pb.InferenceServerRegistration, expected: str
) -> None:
    _assert_invalid(
        _rejection(lambda: check_identity(message, _admitted(admitted_cluster))), expected
    )


# ---- bearer_token -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("authorization", "expected"),
    [
        pytest.param("Bearer abc", "abc", id="plain"),
        pytest.param("Bearer eyJ.a-b_c=", "eyJ.a-b_c=", id="jwt-characters"),
        # The token is everything after the exact prefix "Bearer ", untrimmed.
        pytest.param("Bearer  abc", " abc", id="second-space-kept"),
        pytest.param("Bearer abc ", "abc ", id="trailing-space-kept"),
        pytest.param("Bearer a b", "a b", id="inner-space-kept"),
        pytest.param("Bearer Bearer abc", "Bearer abc", id="prefix-stripped-once"),
        pytest.param("Bearer ", "", id="empty-token"),
        # Anything else is no token at all.
        pytest.param(None, None, id="no-header"),
        pytest.param("", None, id="empty-header"),
        pytest.param("Bearer", None, id="scheme-without-space"),
        pytest.param("Bearerabc", None, id="no-separator"),
        pytest.param("bearer abc", None, id="lower-case"),
        pytest.param("BEARER abc", None, id="upper-case"),
        pytest.param(" Bearer abc", None, id="leading-space"),
        pytest.param("Bearer\tabc", None, id="tab-separator"),
        pytest.param("Basic dXNlcjpwdw==", None, id="basic"),
        pytest.param("Token abc", None, id="other-scheme"),
        pytest.param("abc", None, id="bare-token"),
    ],
)
def test_bearer_token_is_an_exact_case_sensitive_prefix(
    authorization: str | None, expected: str | None
) -> None:
    assert bearer_token(authorization) == expected


# ---- negotiate_idle_timeout: docs/control-plane.md, Idle timeout -------------------------------


@pytest.mark.parametrize(
    ("header", "floor_ms", "cap_ms"),
    [
        pytest.param(None, 0, CAP_MS, id="floor-0"),
        pytest.param("1000", 0, CAP_MS, id="floor-0-with-header"),
        pytest.param(None, FLOOR_MS, 0, id="cap-0"),
        pytest.param("1000", FLOOR_MS, 0, id="cap-0-with-header"),
        pytest.param("1000", 0, 0, id="both-0"),
        pytest.param("garbage", 0, CAP_MS, id="floor-0-with-malformed-header"),
    ],
)
def test_a_zero_floor_or_cap_disables_the_idle_timeout(
    header: str | None, floor_ms: int, cap_ms: int
) -> None:
    assert negotiate_idle_timeout(header, floor_ms, cap_ms) is None


@pytest.mark.parametrize(
    ("floor_ms", "cap_ms", "expected"),
    [
        pytest.param(FLOOR_MS, CAP_MS, 300.0, id="defaults"),
        pytest.param(FLOOR_MS, 600_000, 600.0, id="larger-cap"),
        pytest.param(FLOOR_MS, 10_000, 10.0, id="cap-below-floor"),
        pytest.param(1, 5, 0.005, id="milliseconds"),
    ],
)
def test_without_a_header_the_cap_applies(
    floor_ms: int, cap_ms: int, expected: float, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert negotiate_idle_timeout(None, floor_ms, cap_ms) == expected
    assert not caplog.records  # a missing header is normal, not malformed


@pytest.mark.parametrize(
    "header",
    [
        pytest.param("", id="empty"),
        pytest.param(" ", id="blank"),
        pytest.param("-1000", id="negative"),
        pytest.param("+1000", id="plus-sign"),
        pytest.param(" 1000", id="leading-space"),
        pytest.param("1000 ", id="trailing-space"),
        pytest.param("1000ms", id="unit"),
        pytest.param("1000.0", id="decimal"),
        pytest.param("1e3", id="exponent"),
        pytest.param("1_000", id="underscore"),
        pytest.param("0x3e8", id="hex"),
        pytest.param("abc", id="text"),
        # str.isdigit() and int() accept these; the header must be ASCII digits.
        pytest.param("\u0661\u0660\u0660\u0660", id="arabic-indic-digits"),
        pytest.param("\uff11\uff10\uff10\uff10", id="fullwidth-digits"),
        pytest.param("\u00b2", id="superscript-two"),
    ],
)
def test_a_malformed_header_falls_back_to_the_cap_with_a_warning(
    header: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert negotiate_idle_timeout(header, FLOOR_MS, CAP_MS) == CAP_MS / 1000
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert HEARTBEAT_HEADER in warnings[0]
    assert HEARTBEAT_HEADER == "x-stargate-registration-heartbeat-ms"


@pytest.mark.parametrize(
    ("header", "floor_ms", "cap_ms", "expected"),
    [
        # min(max(3 h, floor), cap), in seconds.
        pytest.param("1000", FLOOR_MS, CAP_MS, 60.0, id="pylon-default-raised-to-floor"),
        pytest.param("0", FLOOR_MS, CAP_MS, 60.0, id="zero-heartbeat-is-the-floor"),
        pytest.param("20000", FLOOR_MS, CAP_MS, 60.0, id="3h-equals-floor"),
        pytest.param("20001", FLOOR_MS, CAP_MS, 60.003, id="3h-just-above-floor"),
        pytest.param("50000", FLOOR_MS, CAP_MS, 150.0, id="3h-between"),
        pytest.param("100000", FLOOR_MS, CAP_MS, 300.0, id="3h-equals-cap"),
        pytest.param("120000", FLOOR_MS, CAP_MS, 300.0, id="3h-above-cap"),
        pytest.param("120000", FLOOR_MS, 600_000, 360.0, id="3h-under-larger-cap"),
        pytest.param("1000", FLOOR_MS, 600_000, 60.0, id="floor-under-larger-cap"),
        pytest.param("1000", FLOOR_MS, 10_000, 10.0, id="cap-wins-below-floor"),
        pytest.param("120000", FLOOR_MS, 10_000, 10.0, id="cap-wins-below-floor-and-3h"),
        pytest.param("333", 1, CAP_MS, 0.999, id="millisecond-precision"),
        pytest.param("0001000", FLOOR_MS, CAP_MS, 60.0, id="leading-zeros"),
        pytest.param(str(U64_MAX), FLOOR_MS, CAP_MS, 300.0, id="u64-max-saturates-to-cap"),
        pytest.param("9" * 40, FLOOR_MS, CAP_MS, 300.0, id="beyond-u64-saturates-to-cap"),
    ],
)
def test_a_heartbeat_is_tripled_and_clamped_with_the_cap_winning(
    header: str, floor_ms: int, cap_ms: int, expected: float
) -> None:
    assert negotiate_idle_timeout(header, floor_ms, cap_ms) == expected


# ---- stats_from_wire ----------------------------------------------------------------------------

FULL_WIRE_STATS = pb.ModelStats(
    last_mean_input_tps=1.5,
    output_tps=2.5,
    queue_size=3,
    queued_input_size=4,
    max_output_tps=5.5,
    kv_cache_capacity_tokens=6,
    kv_cache_used_tokens=7,
    kv_cache_free_tokens=8,
    num_running_queries=9,
    max_engine_concurrency=10,
    total_query_input_size=11,
    queue_time_estimate_ms_by_priority={900: 90, 100: 10, 500: 50, 0: 5},
    input_processing_queries=13,
    output_generation_queries=14,
    stats_observed_at_unix_ms=1_700_000_000_015,
    stats_capabilities=["queue_time_estimate", "kv_cache"],
    stats_sources=["vllm", "pylon", "vllm"],
)

FULL_STATS = ModelStats(
    last_mean_input_tps=1.5,
    output_tps=2.5,
    queue_size=3,
    queued_input_size=4,
    max_output_tps=5.5,
    kv_cache_capacity_tokens=6,
    kv_cache_used_tokens=7,
    kv_cache_free_tokens=8,
    num_running_queries=9,
    max_engine_concurrency=10,
    total_query_input_size=11,
    queue_time_estimate_ms_by_priority=((0, 5), (100, 10), (500, 50), (900, 90)),  # by priority
    input_processing_queries=13,
    output_generation_queries=14,
    stats_observed_at_unix_ms=1_700_000_000_015,
    stats_capabilities=("queue_time_estimate", "kv_cache"),  # order kept
    stats_sources=("vllm", "pylon", "vllm"),  # duplicates kept
)


def test_the_routing_stats_mirror_the_wire_message_field_for_field() -> None:
    wire_fields = {field.name for field in pb.ModelStats.DESCRIPTOR.fields}
    assert {field.name for field in dataclasses.fields(ModelStats)} == wire_fields


def test_every_field_is_converted() -> None:
    converted = stats_from_wire(FULL_WIRE_STATS)
    assert converted == FULL_STATS
    # Every field of the fixture differs from its default, so none can be silently dropped.
    default = ModelStats()
    for field in dataclasses.fields(ModelStats):
        assert getattr(converted, field.name) != getattr(default, field.name), field.name


@pytest.mark.parametrize(
    "estimates",
    [
        pytest.param({900: 90, 100: 10, 500: 50, 0: 5}, id="sparse"),
        pytest.param({U32_MAX: 4, 5: 2, 1_000_003: 3, 77: 1}, id="wide"),
        pytest.param({2: 20, 1: 10, 0: 0}, id="dense-descending"),
    ],
)
def test_per_priority_estimates_are_sorted_by_priority_whatever_the_wire_order(
    estimates: dict[int, int],
) -> None:
    expected = tuple(sorted(estimates.items()))
    built = pb.ModelStats(queue_time_estimate_ms_by_priority=estimates)
    # A decoded message's map order is the protobuf runtime's, not the sender's.
    decoded = pb.ModelStats.FromString(built.SerializeToString())
    for wire in (built, decoded):
        assert stats_from_wire(wire).queue_time_estimate_ms_by_priority == expected


def test_unset_values_convert_to_the_defaults() -> None:
    # 0 keeps its wire meaning: "not reported" (max_engine_concurrency), "unknown" (observed at).
    assert stats_from_wire(pb.ModelStats()) == ModelStats()


def test_maximum_values_are_kept_exactly() -> None:
    wire = pb.ModelStats(
        last_mean_input_tps=math.inf,
        output_tps=1.7976931348623157e308,
        max_output_tps=-math.inf,
        queue_size=U64_MAX,
        queued_input_size=U64_MAX,
        kv_cache_capacity_tokens=U64_MAX,
        kv_cache_used_tokens=U64_MAX,
        kv_cache_free_tokens=U64_MAX,
        num_running_queries=U64_MAX,
        max_engine_concurrency=U64_MAX,
        total_query_input_size=U64_MAX,
        queue_time_estimate_ms_by_priority={U32_MAX: U64_MAX, 0: 0},
        input_processing_queries=U64_MAX,
        output_generation_queries=U64_MAX,
        stats_observed_at_unix_ms=U64_MAX,
    )
    assert stats_from_wire(wire) == ModelStats(
        last_mean_input_tps=math.inf,
        output_tps=1.7976931348623157e308,
        max_output_tps=-math.inf,
        queue_size=U64_MAX,
        queued_input_size=U64_MAX,
        kv_cache_capacity_tokens=U64_MAX,
        kv_cache_used_tokens=U64_MAX,
        kv_cache_free_tokens=U64_MAX,
        num_running_queries=U64_MAX,
        max_engine_concurrency=U64_MAX,
        total_query_input_size=U64_MAX,
        queue_time_estimate_ms_by_priority=((0, 0), (U32_MAX, U64_MAX)),
        input_processing_queries=U64_MAX,
        output_generation_queries=U64_MAX,
        stats_observed_at_unix_ms=U64_MAX,
    )


def test_values_are_not_validated() -> None:
    # docs/control-plane.md keeps the Rust rule: stats values are taken as sent.
    converted = stats_from_wire(
        pb.ModelStats(last_mean_input_tps=math.nan, output_tps=-1.0, max_output_tps=-0.0)
    )
    assert math.isnan(converted.last_mean_input_tps)
    assert converted.output_tps == -1.0
    assert math.copysign(1.0, converted.max_output_tps) == -1.0


def test_the_conversion_is_an_immutable_snapshot() -> None:
    wire = pb.ModelStats()
    wire.CopyFrom(FULL_WIRE_STATS)
    converted = stats_from_wire(wire)
    assert isinstance(converted.queue_time_estimate_ms_by_priority, tuple)
    assert isinstance(converted.stats_capabilities, tuple)
    assert isinstance(converted.stats_sources, tuple)
    hash(converted)  # shareable with readers: no protobuf container survives
    wire.queue_time_estimate_ms_by_priority[1] = 1
    wire.stats_capabilities.append("later")
    wire.stats_sources[0] = "changed"
    wire.queue_size = 99
    assert converted == FULL_STATS


# ---- routes_for_update: docs/control-plane.md, Model status ------------------------------------

RTT_NS = 1_500_000
RECEIVED_AT = 1234.5
STATS = pb.ModelStats(queue_size=2, output_tps=40.0, stats_sources=["pylon"])


def _unknown_status_model(number: int) -> pb.InferenceServerModelRegistration:
    """A model whose status is an enum number this build does not know, as decoded off the wire."""
    known = _model(ACTIVE, STATS).SerializeToString()
    decoded = pb.InferenceServerModelRegistration.FromString(known + bytes([0x10, number]))
    assert decoded.status == number and decoded.HasField("stats")
    return decoded


@pytest.mark.parametrize(
    ("model", "rtt_ns", "routable"),
    [
        pytest.param(_model(ACTIVE, STATS), RTT_NS, True, id="active-with-rtt"),
        pytest.param(_model(ACTIVE, STATS), 0, True, id="active-with-zero-rtt"),
        pytest.param(_model(ACTIVE, STATS), None, False, id="active-without-rtt"),
        pytest.param(_model(INACTIVE, STATS), RTT_NS, False, id="inactive"),
        pytest.param(_model(UNKNOWN, STATS), RTT_NS, False, id="unknown"),
        pytest.param(_unknown_status_model(7), RTT_NS, False, id="unknown-enum-number"),
        pytest.param(_model(ACTIVE, None), RTT_NS, False, id="active-without-stats"),
        pytest.param(_model(INACTIVE, None), RTT_NS, False, id="inactive-without-stats"),
        # Presence matters: default (all-zero) stats are stats.
        pytest.param(_model(ACTIVE, pb.ModelStats()), RTT_NS, True, id="active-default-stats"),
    ],
)
def test_a_model_is_routable_only_when_active_with_stats_and_an_rtt(
    model: pb.InferenceServerModelRegistration, rtt_ns: int | None, routable: bool
) -> None:
    routes = routes_for_update(_message(models={"m": model}), rtt_ns, RECEIVED_AT)
    assert list(routes) == ["m"]  # listed, so advertised, whatever the status
    if routable:
        assert rtt_ns is not None
        assert routes["m"] == BackendRoute(stats_from_wire(model.stats), rtt_ns, RECEIVED_AT)
    else:
        assert routes["m"] is None


def test_every_listed_model_gets_its_own_verdict_and_nothing_else_is_listed() -> None:
    message = _message(
        models={
            "active": _model(ACTIVE, FULL_WIRE_STATS),
            "also-active": _model(ACTIVE, STATS),
            "inactive": _model(INACTIVE, STATS),
            "no-stats": _model(ACTIVE, None),
            " spaced ": _model(ACTIVE, STATS),  # ids are neither validated nor trimmed
            "": _model(ACTIVE, STATS),
        }
    )
    routes = routes_for_update(message, RTT_NS, RECEIVED_AT)
    assert routes == {
        "active": BackendRoute(FULL_STATS, RTT_NS, RECEIVED_AT),
        "also-active": BackendRoute(stats_from_wire(STATS), RTT_NS, RECEIVED_AT),
        "inactive": None,
        "no-stats": None,
        " spaced ": BackendRoute(stats_from_wire(STATS), RTT_NS, RECEIVED_AT),
        "": BackendRoute(stats_from_wire(STATS), RTT_NS, RECEIVED_AT),
    }


def test_without_an_rtt_no_active_model_is_routable_but_all_stay_listed() -> None:
    message = _message(models={"a": _model(ACTIVE, STATS), "b": _model(ACTIVE, STATS)})
    assert routes_for_update(message, None, RECEIVED_AT) == {"a": None, "b": None}


def test_an_empty_model_map_is_a_pure_heartbeat() -> None:
    assert routes_for_update(_message(), RTT_NS, RECEIVED_AT) == {}


def test_a_dropped_model_is_absent_while_an_inactive_one_is_listed() -> None:
    # "Removing a model from the map and sending it INACTIVE are not the same": the first is not
    # a key of the result (route and advertisement go), the second is a key mapped to None.
    before = _message(models={"kept": _model(ACTIVE, STATS), "dropped": _model(ACTIVE, STATS)})
    assert set(routes_for_update(before, RTT_NS, RECEIVED_AT)) == {"kept", "dropped"}
    after = _message(models={"kept": _model(INACTIVE, STATS), "added": _model(ACTIVE, STATS)})
    routes = routes_for_update(after, RTT_NS, RECEIVED_AT + 1)
    assert routes == {
        "kept": None,
        "added": BackendRoute(stats_from_wire(STATS), RTT_NS, RECEIVED_AT + 1),
    }
    assert "dropped" not in routes


@pytest.mark.parametrize(
    ("model", "rtt_ns", "expected_warning"),
    [
        pytest.param(_model(ACTIVE, None), RTT_NS, "missing model stats", id="no-stats"),
        pytest.param(_model(INACTIVE, None), RTT_NS, "missing model stats", id="no-stats-inactive"),
        pytest.param(_model(ACTIVE, STATS), None, "missing connection RTT", id="no-rtt"),
        pytest.param(_model(ACTIVE, STATS), RTT_NS, None, id="routable"),
        pytest.param(_model(INACTIVE, STATS), None, None, id="inactive-needs-no-rtt"),
        pytest.param(_model(UNKNOWN, STATS), RTT_NS, None, id="unknown"),
    ],
)
def test_missing_stats_and_a_missing_rtt_are_warned_about(
    model: pb.InferenceServerModelRegistration,
    rtt_ns: int | None,
    expected_warning: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    routes_for_update(_message(models={"model-x": model}), rtt_ns, RECEIVED_AT)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if expected_warning is None:
        assert warnings == []
    else:
        assert len(warnings) == 1
        assert expected_warning in warnings[0]
        assert SERVER_ID in warnings[0]
        assert "model-x" in warnings[0]
