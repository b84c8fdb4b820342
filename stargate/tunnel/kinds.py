"""Which transport reaches a backend, from its registration identity alone (pure, no imports
of the QUIC machinery: the control plane asks this of every registration)."""

from __future__ import annotations

from stargate.routing import RegistrationIdentity

__all__ = ["is_direct", "is_tunnel"]


def is_direct(identity: RegistrationIdentity) -> bool:
    """A `quic://` registration: the replica dials the Pylon (docs/tunnels.md)."""
    return identity.url[:7].lower() == "quic://"


def is_tunnel(identity: RegistrationIdentity) -> bool:
    """Whether the replica reaches this backend through a tunnel (else over HTTP)."""
    return identity.reverse_tunnel or is_direct(identity)
