"""The routing state: which backends serve which (routing key, model) targets.

This is the seam every other part meets at: the control plane writes it as Pylons register, the
readiness sampler counts it, the proxy and the activator read it. It imports nothing of ours.
"""

from stargate.routing.state import BackendEntry, RoutingState, RoutingTargetKey

__all__ = ["BackendEntry", "RoutingState", "RoutingTargetKey"]
