"""The routing state: which backends serve which (routing key, model) targets.

This is the seam every other part meets at: the control plane writes it as Pylons register, the
readiness sampler counts it, the proxy and the activator read it. It imports nothing of ours.
"""

from stargate.routing.state import (
    AlreadyRegistered,
    BackendRoute,
    BackendSnapshot,
    ClusterSnapshot,
    Registration,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
    TargetSnapshot,
)
from stargate.routing.stats import ModelStats

__all__ = [
    "AlreadyRegistered",
    "BackendRoute",
    "BackendSnapshot",
    "ClusterSnapshot",
    "ModelStats",
    "Registration",
    "RegistrationIdentity",
    "RoutingState",
    "RoutingTargetKey",
    "TargetSnapshot",
]
