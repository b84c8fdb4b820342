"""TLS on the replica's listeners: the served identity and its hot reload (docs/tls.md)."""

from stargate.tls.identity import Identity, IdentityError, is_expired, load_identity
from stargate.tls.reloader import MATERIAL_TYPE, ServedIdentity

__all__ = [
    "MATERIAL_TYPE",
    "Identity",
    "IdentityError",
    "ServedIdentity",
    "is_expired",
    "load_identity",
]
