"""`stargate.addresses`: the one `host:port` parser and formatter, and its callers' rules."""

from __future__ import annotations

import pytest

from stargate.addresses import (
    AddressError,
    AddressProblem,
    HostPort,
    canonical_host,
    format_host_port,
    ip_literal,
    is_host_name,
    parse_host_port,
)
from stargate.config import ConfigError, ListenAddress, parse_listen_address
from stargate.control_plane.discovery import parse_peer
from stargate.pylon.config import DialTarget, PylonConfigError, parse_dial_target

P = AddressProblem


def test_format_host_port_brackets_ipv6_only() -> None:
    assert format_host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert format_host_port("host.example", 1) == "host.example:1"
    assert format_host_port("::1", 8000) == "[::1]:8000"
    assert str(HostPort("fd00::2", 5)) == "[fd00::2]:5"


def test_host_helpers() -> None:
    assert ip_literal("FD00:0::2") == "fd00::2"
    assert ip_literal("10.0.0.1") == "10.0.0.1"
    assert ip_literal("host") is None
    assert canonical_host("Host.Example.") == "host.example"
    assert canonical_host("0:0::1") == "::1"
    for name in ("a", "my_host", "a-b.c", "x." * 10 + "y", "trailing.dot.", "a" * 63):
        assert is_host_name(name), name
    for bad in ("", "-a", "a-", "a..b", "a b", "bad!", "a" * 64, ("a." * 127) + "ab"):
        assert not is_host_name(bad), bad


@pytest.mark.parametrize(
    ("text", "names", "min_port", "expected"),
    [
        ("10.0.0.1:80", False, 1, HostPort("10.0.0.1", 80)),
        ("[FD00::2]:1", False, 1, HostPort("fd00::2", 1)),
        ("0.0.0.0:0", False, 0, HostPort("0.0.0.0", 0)),
        ("Host.Example.:65535", True, 1, HostPort("host.example", 65535)),
    ],
)
def test_parse_host_port_accepts(text: str, names: bool, min_port: int, expected: HostPort) -> None:
    assert parse_host_port(text, names=names, min_port=min_port) == expected


@pytest.mark.parametrize(
    ("text", "names", "min_port", "problems"),
    [
        ("10.0.0.1", True, 1, {P.SYNTAX}),
        (":80", True, 1, {P.SYNTAX}),
        ("h:", True, 1, {P.SYNTAX}),
        ("h:0", True, 1, {P.PORT}),
        ("h:65536", True, 0, {P.PORT}),
        ("h:x", True, 1, {P.PORT}),
        ("h:\u0668", True, 1, {P.PORT}),  # a non-ASCII digit is not a port
        ("::1:80", True, 1, {P.BRACKETS}),
        ("::1:99999", True, 1, {P.BRACKETS, P.PORT}),
        ("host:80", False, 1, {P.HOST}),
        ("bad!:80", True, 1, {P.HOST}),
        ("[zz]:80", True, 1, {P.HOST}),
        ("[1.2.3.4]:80", True, 1, {P.HOST}),
        ("bad!:0", True, 1, {P.HOST, P.PORT}),
    ],
)
def test_parse_host_port_reports_every_problem(
    text: str, names: bool, min_port: int, problems: set[AddressProblem]
) -> None:
    with pytest.raises(AddressError) as caught:
        parse_host_port(text, names=names, min_port=min_port)
    assert caught.value.problems == problems


def test_ipv4_in_brackets_is_opt_in() -> None:
    assert parse_host_port("[1.2.3.4]:80", names=False, min_port=0, ipv4_in_brackets=True) == (
        HostPort("1.2.3.4", 80)
    )
    with pytest.raises(AddressError) as caught:
        parse_host_port("[zz]:80", names=False, min_port=0, ipv4_in_brackets=True)
    assert caught.value.host == "zz"
    assert caught.value.bracketed


# Each caller keeps its own rule and wording.


def test_listen_addresses_are_ip_literals() -> None:
    assert parse_listen_address(" [::1]:0 ") == ListenAddress("::1", 0)
    assert str(parse_listen_address("[0:0::1]:8000")) == "[::1]:8000"
    cases = {
        "localhost:8000": "'localhost:8000': 'localhost' is not an IP address",
        "0.0.0.0": "'0.0.0.0' is not an IP:PORT socket address (e.g. 0.0.0.0:8000)",
        "0.0.0.0:99999": "'0.0.0.0:99999': port must be a number from 0 to 65535",
        "::1:80": "'::1:80': an IPv6 address must be written in brackets, e.g. [::]:8000",
        # The host is named before the port, as it always was.
        "localhost:99999": "'localhost:99999': 'localhost' is not an IP address",
        "[zz]:1": "'[zz]:1': 'zz' is not an IP address",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            parse_listen_address(text)
        assert str(caught.value) == message


def test_peers_may_be_host_names() -> None:
    assert parse_peer("Host.Example.:7") == ("", "host.example:7")
    cases = {
        "h": "peer 'h' is not HOST:PORT (e.g. 10.0.0.2:50071)",
        "h:0": "peer 'h:0': port must be a number from 1 to 65535",
        # The port is named before the host, as it always was.
        "bad!:0": "peer 'bad!:0': port must be a number from 1 to 65535",
        "[1.2.3.4]:5": "peer '[1.2.3.4]:5': '[1.2.3.4]' is not an IPv6 address",
        "::1:5": "peer '::1:5': an IPv6 address must be written in brackets",
        "bad!:5": "peer 'bad!:5': 'bad!' is neither an IP address nor a host name",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            parse_peer(text)
        assert str(caught.value) == message


def test_dial_targets_share_the_host_rule() -> None:
    assert parse_dial_target("grpc://[FD00::1]:9") == DialTarget("[fd00::1]:9")
    assert parse_dial_target("Host.Example.:1") == DialTarget("host.example:1")
    with pytest.raises(PylonConfigError) as caught:
        parse_dial_target("bad!:1")
    assert str(caught.value) == "'bad!:1': 'bad!' is neither an IP address nor a host name"
