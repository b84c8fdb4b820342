"""What the proxy decides about a request before routing it, decided once: its `RequestPlan`.

A plan holds the resolved algorithm definition, the routing target and the balancers' input (the
`RoutingRequest`, with the cache-affinity key the request routes by, sent or derived), and the
`(model, routing_key)` metric label values. `ProxyApp` builds it once per request with the
`Planner` and hands it to the forwarder; neither asks for any of it again.

docs/data-plane.md, Header contract, validation steps 2 and 3: `Planner.algorithm` resolves the
definition (an `x-routing-method` that is unknown or not allowed for the model is a 400), and
`Planner.plan` checks the key requirement (the definition requires a cache-affinity key and the
request has none: 400). The two are separate for derived keys ("Derived affinity keys"): the
algorithm is checked before the body is read, the requirement once the body has given its key.
"""

from __future__ import annotations

from dataclasses import dataclass

from stargate.load_balancing.balancers import RoutingRequest
from stargate.load_balancing.config import (
    AlgorithmSpec,
    AlgorithmUnavailable,
    LbConfig,
    UnknownAlgorithm,
    parse_algorithm_header,
    resolve,
)
from stargate.proxy.contract import ContractError, ProxyRequest
from stargate.routing import RoutingState, RoutingTargetKey

__all__ = ["UNREGISTERED", "Planner", "RequestPlan"]

UNREGISTERED = "__unregistered__"
"""The metric label standing for every model (and routing key) that no backend ever registered:
client input must not create series (docs/clients.md, "Metrics")."""


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request's routing decisions, made once (`Planner.plan`).

    `labels` are the `(model, routing_key)` metric label values: the request's own when some
    backend has registered its target (now or before), else the `UNREGISTERED` pair, so client
    input creates no series. A target becomes registered at most once and never stops being so,
    and only an unregistered plan's labels can be out of date: read them with `Planner.labels`.
    """

    request: ProxyRequest  # with a derived cache-affinity key, if one was derived
    spec: AlgorithmSpec
    target: RoutingTargetKey
    routing: RoutingRequest  # the balancers' input; `waited_ms` 0 (the first selection)
    labels: tuple[str, str]
    registered: bool  # `labels` are the request's own (final)


class Planner:
    """Builds `RequestPlan`s from the LB config and the routing state's registered targets."""

    __slots__ = ("_lb_config", "_routing")

    def __init__(self, routing: RoutingState, lb_config: LbConfig) -> None:
        self._routing = routing
        self._lb_config = lb_config

    def algorithm(self, request: ProxyRequest) -> AlgorithmSpec:
        """The algorithm definition for `request`, or a bare 400 (validation step 2). The key
        requirement is `plan`'s."""
        header = None
        if request.routing_method is not None:
            try:
                header = parse_algorithm_header(request.routing_method)
            except UnknownAlgorithm:
                raise ContractError(
                    400,
                    message=f"unknown x-routing-method {request.routing_method!r}",
                    code="invalid_header",
                ) from None
        try:
            return resolve(self._lb_config, request.model_id, header)
        except AlgorithmUnavailable:
            raise ContractError(
                400,
                message=f"x-routing-method {request.routing_method!r} is not allowed for model "
                f"{request.model_id!r}",
                code="invalid_header",
            ) from None

    def plan(self, request: ProxyRequest, spec: AlgorithmSpec | None = None) -> RequestPlan:
        """The plan of `request`, routed by its `cache_affinity_key`; `spec` when the algorithm
        was resolved already (`algorithm`), else resolved here. A bare 400 when the definition
        requires a cache-affinity key and the request has none (validation step 3)."""
        if spec is None:
            spec = self.algorithm(request)
        if spec.require_cache_affinity_key and request.cache_affinity_key is None:
            raise ContractError(
                400,
                message=f"model {request.model_id!r} requires an x-cache-affinity-key header",
                code="invalid_header",
            )
        model_id, routing_key = request.model_id, request.routing_key
        target = RoutingTargetKey(routing_key, model_id)
        registered = self._routing.is_known(target)
        return RequestPlan(
            request,
            spec,
            target,
            RoutingRequest(
                model_id=model_id,
                routing_key=routing_key,
                input_tokens=request.input_tokens,
                priority=request.priority,
                cache_affinity_key=request.cache_affinity_key,
                request_slo_ms=request.request_slo_ms,
                prefix_chain=request.prefix_chain,
                prefix_group=request.prefix_group,
            ),
            _labels(registered, model_id, routing_key),
            registered,
        )

    def labels(self, plan: RequestPlan) -> tuple[str, str]:
        """`plan.labels`, brought up to date: a target nobody had registered when the plan was
        made may have been registered since (the first request to a cold model pool waits for
        its member to start and register)."""
        if plan.registered or not self._routing.is_known(plan.target):
            return plan.labels
        return _labels(True, plan.target.model_id, plan.target.routing_key)


def _labels(registered: bool, model_id: str, routing_key: str | None) -> tuple[str, str]:
    if registered:
        return model_id, routing_key or ""
    return UNREGISTERED, "" if routing_key is None else UNREGISTERED
