"""`host:port` parsing and formatting, shared by every address a process reads.

One syntax, one host-name rule, one canonical form; each caller keeps its own rule and its own
messages (docs/architecture.md, Modules):

* listen addresses (`stargate.config.parse_listen_address`) are IP literals, port 0 allowed;
* peers and advertise addresses (`stargate.control_plane.discovery`) may be host names, port
  1-65535, and only IPv6 goes in brackets;
* Pylon dial targets (`stargate.pylon.config.parse_dial_target`) may also carry a URL scheme, so
  they split with `urllib` and share only the host rule and the formatting.

`parse_host_port` reports every problem it finds in an `AddressError`, so each caller picks which
one to name first and words the message its flag has always shown.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass

__all__ = [
    "AddressError",
    "AddressProblem",
    "HostPort",
    "canonical_host",
    "format_host_port",
    "ip_literal",
    "is_host_name",
    "parse_host_port",
]

_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}\.?$){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?$")


def is_host_name(text: str) -> bool:
    """A DNS name: dot-separated labels of 1-63 letters, digits, `_` or inner `-`, 253 at most,
    an optional trailing dot."""
    return _HOST_NAME.match(text) is not None


def ip_literal(text: str) -> str | None:
    """The compressed canonical form of an IPv4 or IPv6 literal, or None when `text` is not one."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def canonical_host(host: str) -> str:
    """Lower-case, without a trailing dot; IP literals in their compressed canonical form.

    Does not validate: a host that is neither an IP nor a name is only lower-cased.
    """
    ip = ip_literal(host)
    return ip if ip is not None else host.rstrip(".").lower()


def format_host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets as every URL and authority needs it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class AddressProblem(enum.Enum):
    """What is wrong with a `host:port` text; a text can have several."""

    SYNTAX = "syntax"
    """No `:`, or nothing on one side of it. Reported alone."""
    PORT = "port"
    """The port is not an ASCII number in the allowed range."""
    BRACKETS = "brackets"
    """An IPv6 address (a `:` in the host) written without brackets."""
    HOST = "host"
    """The host is not an IP literal (in brackets: not an IPv6 literal when `ipv4_in_brackets`
    is off), nor a host name when names are allowed."""


class AddressError(ValueError):
    """A `host:port` text is malformed; `problems` says how, `host` is the host as written
    without brackets, `bracketed` whether it was in brackets."""

    def __init__(self, text: str, problems: frozenset[AddressProblem], host: str, bracketed: bool):
        super().__init__(f"{text!r}: {', '.join(sorted(p.value for p in problems))}")
        self.text = text
        self.problems = problems
        self.host = host
        self.bracketed = bracketed


@dataclass(frozen=True, slots=True)
class HostPort:
    """A parsed address: the canonical host (see `canonical_host`) and the port."""

    host: str
    port: int

    def __str__(self) -> str:
        return format_host_port(self.host, self.port)


def parse_host_port(
    text: str, *, names: bool, min_port: int, ipv4_in_brackets: bool = False
) -> HostPort:
    """Parse `HOST:PORT`, `[v6]:PORT`; the text is taken as is (strip it first if needed).

    `names` allows host names beside IP literals; `min_port` is 0 or 1 (the maximum is 65535);
    `ipv4_in_brackets` accepts `[1.2.3.4]:PORT` as well. Raises `AddressError` listing every
    problem found.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise AddressError(text, frozenset({AddressProblem.SYNTAX}), host, False)
    problems: set[AddressProblem] = set()
    port = int(port_text) if port_text.isascii() and port_text.isdigit() else -1
    if not min_port <= port <= 65535:
        problems.add(AddressProblem.PORT)
    bracketed = host.startswith("[") and host.endswith("]")
    canonical: str | None = None
    if bracketed:
        host = host[1:-1]
        canonical = ip_literal(host)
        if canonical is not None and ":" not in canonical and not ipv4_in_brackets:
            canonical = None
    elif ":" in host:
        problems.add(AddressProblem.BRACKETS)
    else:
        canonical = ip_literal(host)
        if canonical is None and names and is_host_name(host):
            canonical = canonical_host(host)
    if canonical is None and AddressProblem.BRACKETS not in problems:
        problems.add(AddressProblem.HOST)
    if problems or canonical is None:
        raise AddressError(text, frozenset(problems), host, bracketed)
    return HostPort(canonical, port)
