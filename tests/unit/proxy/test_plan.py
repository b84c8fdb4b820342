"""The request plan (stargate/proxy/plan.py): the algorithm resolved and the key requirement
checked (docs/data-plane.md, Header contract, steps 2 and 3), the balancers' input, and the metric
labels, which stand for every unregistered target with one fixed pair until a backend registers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stargate.load_balancing.balancers import RoutingRequest
from stargate.load_balancing.config import parse_lb_config
from stargate.proxy.contract import ContractError, ProxyRequest
from stargate.proxy.plan import UNREGISTERED, Planner
from stargate.routing import (
    BackendRoute,
    ModelStats,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)

LB_CONFIG = parse_lb_config(
    {
        "default": "power-of-n",
        "request_algorithms": {"random": "random"},
        "models": {"aff": {"algorithm": "round-robin", "require_cache_affinity_key": True}},
    }
)


def _request(model: str = "m", **fields: object) -> ProxyRequest:
    request = ProxyRequest(
        endpoint="chat_completions",
        target_path=b"/v1/chat/completions",
        request_id="r",
        model_id=model,
        input_tokens=7,
        routing_key=None,
        routing_method=None,
        priority=3,
        max_wait_ms=None,
        request_slo_ms=250,
        cache_affinity_key=None,
        retry_budget_ms=None,
        headers=[],
    )
    return replace(request, **fields)  # type: ignore[arg-type]


def _register(routing: RoutingState, model: str, routing_key: str | None = None) -> None:
    server_id = f"b{len(routing.targets()) + 1}"
    registration = routing.begin(
        RegistrationIdentity(server_id, "c1", f"http://{server_id}", routing_key)
    )
    routing.apply(registration, {model: BackendRoute(ModelStats(), 1_000_000, 0.0)})


def test_a_plan_holds_the_algorithm_the_target_and_the_routing_input() -> None:
    routing = RoutingState()
    _register(routing, "m")
    plan = Planner(routing, LB_CONFIG).plan(_request(routing_method="Random"))
    assert plan.spec.name == "random"
    assert plan.target == RoutingTargetKey(None, "m")
    assert plan.routing == RoutingRequest(
        model_id="m", input_tokens=7, priority=3, request_slo_ms=250, routing_key=None
    )
    assert plan.labels == ("m", "") and plan.registered


@pytest.mark.parametrize("method", ["no-such-algorithm", "pulsar"])
def test_an_unknown_or_disallowed_algorithm_is_a_400(method: str) -> None:
    planner = Planner(RoutingState(), LB_CONFIG)
    with pytest.raises(ContractError) as error:
        planner.algorithm(_request(routing_method=method))
    assert error.value.status == 400
    with pytest.raises(ContractError):
        planner.plan(_request(routing_method=method))


def test_the_key_requirement_is_the_plans_not_the_algorithms() -> None:
    """For derived keys: the algorithm is checked before the body is read, the requirement once
    the key is known (docs/data-plane.md, Derived affinity keys)."""
    planner = Planner(RoutingState(), LB_CONFIG)
    spec = planner.algorithm(_request("aff"))  # no key yet: not refused here
    assert spec.require_cache_affinity_key
    with pytest.raises(ContractError) as error:
        planner.plan(_request("aff"), spec)
    assert error.value.status == 400
    plan = planner.plan(_request("aff", cache_affinity_key="prefix:abc"), spec)
    assert plan.spec is spec  # not resolved again
    assert plan.routing.cache_affinity_key == "prefix:abc"


@pytest.mark.parametrize(
    ("routing_key", "unregistered"),
    [(None, (UNREGISTERED, "")), ("tenant", (UNREGISTERED, UNREGISTERED))],
)
def test_labels_of_an_unregistered_target_follow_its_first_registration(
    routing_key: str | None, unregistered: tuple[str, str]
) -> None:
    """Client input creates no series; a request planned before its target's first registration
    (the first request to a cold model pool) is counted under its own labels once it has one."""
    routing = RoutingState()
    planner = Planner(routing, LB_CONFIG)
    plan = planner.plan(_request(routing_key=routing_key))
    assert plan.labels == unregistered and not plan.registered
    assert planner.labels(plan) == unregistered
    _register(routing, "other", routing_key)
    assert planner.labels(plan) == unregistered
    _register(routing, "m", routing_key)
    assert planner.labels(plan) == ("m", routing_key or "")
    assert planner.plan(_request(routing_key=routing_key)).registered
