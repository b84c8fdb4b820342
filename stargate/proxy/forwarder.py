"""Forwarding one proxied request: routing attempts, upstream attempts, retries.

docs/data-plane.md, "Forwarding" to "Retries".

The outer loop takes a fresh snapshot of the target, asks the load balancer for a cluster
(excluding clusters this request already failed) and picks a backend in it by the cluster's round
robin; the inner loop runs attempts on that cluster. Transport failures move to a sibling backend
(then to another cluster); a retryable upstream 429/503 moves to another cluster, or to a sibling
for `queue_estimate_mismatch`. Both retry counters are per request. Once a response head is
accepted as final nothing is retried: its body is streamed to the client as it arrives. The rules
themselves are pure functions in `retry.py`; this module runs the loop, the I/O and the metrics.
Each attempt's outcome becomes its decision, metrics, log line and side effects in one place,
`Forwarder._conclude`.

A request comes with its `RequestPlan` (stargate/proxy/plan.py): the algorithm, target, routing
input and metric labels were decided once, before the forwarder saw it, and are not asked again.

The request body is read whole before routing (bounded by `--proxy-max-replay-body-bytes`), so a
retry can always replay it. That trades the Rust replica's streaming first upload for a simpler,
always-replayable attempt; LLM request bodies are small next to the default 64 MiB bound.

An attempt still waiting for its response head is cancelled when its backend stops being routable
for the target (its probe failed, its Pylon marked the model INACTIVE, or its registration ended:
`backend_unroutable`, the routing state's listener). It then fails over like a transport failure,
within the same connect-retry budget, instead of waiting out the head timeout on a backend the
control plane has given up on (docs/stale-routes.md). Once the head has arrived nothing is cut.

A backend with every connection of `--proxy-max-connections-per-backend` in use counts as full:
while some candidate has a free connection, full clusters are left out of the balancer's choice
and full backends out of the cluster's round robin; only when every candidate is full does a
request queue on one, for at most the pool's acquire timeout, then 503 (docs/data-plane.md,
"Per-backend connections"). The pool answers "full?" in O(1), and says in O(1) when nothing is,
so the common case costs one attribute read.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import trio

from stargate.config import ProxyConfig
from stargate.load_balancing.balancers import choose_backend, expected_queue_ms
from stargate.load_balancing.config import AlgorithmSpec, LbConfig
from stargate.load_balancing.registry import BalancerRegistry, input_work_rejection_for
from stargate.metrics import ProxyMetrics
from stargate.proxy.contract import ContractError, Headers, ProxyRequest, first_header
from stargate.proxy.plan import UNREGISTERED, Planner, RequestPlan
from stargate.proxy.retry import (
    Action,
    Attempts,
    Decision,
    FailureKind,
    RetryPolicy,
    UpstreamHead,
    decide_response,
    decide_transport_failure,
    expired,
    record,
)
from stargate.proxy.routing_wait import RoutingWaits
from stargate.routing import (
    BackendSnapshot,
    ClusterSnapshot,
    Registration,
    RoutingState,
    RoutingTargetKey,
)
from stargate.routing.outliers import (
    Ejection,
    EjectionPolicy,
    OutlierDetector,
    Result,
    classify_response,
)
from stargate.routing.slow_start import SlowStart, SlowStartPolicy
from stargate.tunnel.kinds import is_tunnel
from stargate.upstream import (
    BackendResponse,
    ConnectError,
    ConnectionPool,
    ConnectionPoolTimeout,
    UpstreamError,
)

if TYPE_CHECKING:  # the tracing modules load OpenTelemetry: only with tracing on (docs/tracing.md)
    from stargate.routing.state import Reservation
    from stargate.tracing.request import AttemptSpan, RequestSpan

__all__ = [
    "UNREGISTERED",
    "BackendCapacity",
    "Forwarded",
    "Forwarder",
    "HeadWaits",
    "LocalError",
    "TunnelTransport",
    "no_eligible_candidates",
]

log = logging.getLogger(__name__)

# (`UNREGISTERED`, the metric label of targets nobody registered, is stargate/proxy/plan.py's.)


def _coded_error(
    status: int, code: str, rust_text: str, message: str, param: str | None = None
) -> ContractError:
    """One of the two local errors with a body in the Rust form (docs/data-plane.md,
    Local answers): `{"error","code"}` and `x-stargate-error-code`; `message` is what an OpenAI-form
    answer says instead."""
    body = json.dumps({"error": rust_text, "code": code}, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"x-stargate-error-code", code.encode())]
    return ContractError(status, body, headers, message=message, code=code, param=param)


def input_work_limit_exceeded(model_id: str) -> ContractError:
    return _coded_error(
        503,
        "input_work_limit_exceeded",
        "input work admission limit exceeded",
        f"input work admission limit exceeded for model {model_id!r}; retry later",
    )


def no_eligible_candidates(model_id: str) -> ContractError:
    return _coded_error(
        404,
        "no_eligible_candidates",
        "no eligible candidates",
        f"the model {model_id!r} does not exist or no backend serves it",
        param="model",
    )


@dataclass(frozen=True, slots=True)
class LocalError:
    """A response the replica generates itself (no backend produced it)."""

    error: ContractError
    waited: float = 0.0  # seconds of routing wait before it (stargate/proxy/server_timing.py)


@dataclass(slots=True)
class Forwarded:
    """The final upstream response and the backend that produced it."""

    response: BackendResponse
    backend: BackendSnapshot
    waited: float = 0.0  # seconds from the request's start to its backend's choice, if it waited


class TunnelTransport(Protocol):
    """How an attempt reaches a tunnel backend (`stargate/tunnel/backends.py`)."""

    async def request(
        self,
        registration: Registration,
        method: str,
        path_and_query: bytes,
        headers: Headers,
        body: bytes | bytearray,
    ) -> BackendResponse: ...


HeadWaitKey = tuple[Registration, RoutingTargetKey]


class BackendCapacity(Protocol):
    """Whether backends have a free upstream connection (docs/data-plane.md, Per-backend
    connections): `ConnectionPool` is one. Both answers must be O(1)."""

    @property
    def any_full(self) -> bool:
        """False when no backend is at its cap (then `has_free_slot` need not be asked)."""
        ...

    def has_free_slot(self, url: str) -> bool:
        """A request to the backend at `url` would get a connection without waiting."""
        ...


class HeadWaits:
    """The cancel scopes of attempts waiting for a response head, by (registration, target).

    Keyed by the `Registration` object (compared by identity), not the server id: a same-id
    replacement is another backend generation, and its removal must not cancel attempts on this
    one. Sets are dropped when they empty, so the map holds only attempts in flight.
    """

    __slots__ = ("_scopes",)

    def __init__(self) -> None:
        self._scopes: dict[HeadWaitKey, set[trio.CancelScope]] = {}

    @property
    def pairs(self) -> int:
        """(registration, target) pairs with an attempt waiting: 0 once every attempt ended."""
        return len(self._scopes)

    def open(self, registration: Registration, target: RoutingTargetKey) -> trio.CancelScope:
        """A new scope for one attempt; `close` it when the attempt stops waiting."""
        scope = trio.CancelScope()
        self._scopes.setdefault((registration, target), set()).add(scope)
        return scope

    def close(
        self, registration: Registration, target: RoutingTargetKey, scope: trio.CancelScope
    ) -> None:
        key = (registration, target)
        scopes = self._scopes.get(key)
        if scopes is None:
            return
        scopes.discard(scope)
        if not scopes:
            del self._scopes[key]

    def cancel(self, registration: Registration, target: RoutingTargetKey) -> int:
        """Cancel every attempt waiting on this backend for this target; how many there were."""
        scopes = self._scopes.get((registration, target), ())
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    def __len__(self) -> int:
        """Attempts waiting for a head now."""
        return sum(len(scopes) for scopes in self._scopes.values())


@dataclass(slots=True)
class _RequestContext:
    """Everything one proxied request carries through its attempts: its plan and body, its
    metric labels (`Planner.labels`), when it started, and its retry state (`retry.Attempts`)."""

    plan: RequestPlan
    body: bytes | bytearray
    labels: tuple[str, str]
    start: float
    attempts: Attempts
    trace: RequestSpan | None = None  # the request's root span, with tracing on
    # The routing wait (docs/data-plane.md, Forwarding, step 4): called when its first sleep
    # begins (a loading stream starts: stargate/proxy/loading.py); when that was (None: it never
    # waited); from the request's start to its backend's choice after a wait, or to its 503.
    on_hold: Callable[[], None] | None = None
    wait_started: float | None = None
    waited: float = 0.0


@dataclass(frozen=True, slots=True)
class _Report:
    """How an attempt that got no response head is counted and logged."""

    result: str  # the `proxy_attempts_total` result
    level: int
    message: str  # formatted with the request id, the backend id and the error (if any)


_FAILED = _Report(
    "proxy_502", logging.WARNING, "upstream attempt failed: request_id=%s backend=%s error=%s"
)
# docs/data-plane.md, Retries: each kind of failure before a response head, as counted and logged.
_FAILURES: dict[FailureKind, _Report] = {
    FailureKind.CONNECT: _FAILED,
    FailureKind.OTHER: _FAILED,  # head timeout, a reset before the head, an upload error
    # Nothing was received and the body is buffered, so the request moves on as after a
    # transport failure (no demotion: the control plane already took the backend out).
    FailureKind.BACKEND_UNROUTABLE: _Report(
        "proxy_backend_unroutable",
        logging.INFO,
        "upstream attempt moved: request_id=%s backend=%s is no longer routable",
    ),
    # Chosen while every candidate was at its cap, and no connection freed up within the pool's
    # acquire timeout: nothing was sent, and the backend is not at fault.
    FailureKind.BACKEND_FULL: _Report(
        "proxy_503",
        logging.WARNING,
        "no free upstream connection: request_id=%s backend=%s error=%s",
    ),
}

# The reserved backend left its target before the attempt: excluded, with no retry spent.
_BACKEND_LEFT = Decision(Action.SIBLING)


def _health(head: UpstreamHead, headers: Headers) -> Result:
    """What a response head says about its backend (docs/outliers.md): only a 5xx, or a
    429/503 that may carry a load signal, needs its headers read."""
    if head.status < 500 and head.status != 429:
        return Result.SUCCESS
    upstream = first_header(headers, b"x-stargate-upstream-retryable")
    return classify_response(head.status, head.retryable, upstream)


def _failure_kind(error: UpstreamError | None) -> FailureKind:
    """The retry rules' name for an attempt that got no response head: `error`, or none when
    `backend_unroutable` cancelled the wait."""
    if error is None:
        return FailureKind.BACKEND_UNROUTABLE
    if isinstance(error, ConnectionPoolTimeout):
        return FailureKind.BACKEND_FULL
    return FailureKind.CONNECT if isinstance(error, ConnectError) else FailureKind.OTHER


def _deadline(start: float, milliseconds: int | None) -> float | None:
    return None if milliseconds is None else start + milliseconds / 1000


class Forwarder:
    """Chooses backends for proxied requests and runs the attempts against them."""

    def __init__(
        self,
        routing: RoutingState,
        pool: ConnectionPool,
        config: ProxyConfig,
        lb_config: LbConfig,
        metrics: ProxyMetrics,
        *,
        rng: random.Random | None = None,
        on_dispatch_failure: Callable[[str], None] | None = None,
        capacity: BackendCapacity | None = None,
        tunnels: TunnelTransport | None = None,
    ) -> None:
        self._routing = routing
        # Backends registered as `quic://` or with `reverse_tunnel` are reached through it.
        self._tunnels = tunnels
        # Which backends are at their connection cap; the runtime passes the pool itself.
        # Without it every backend counts as having room (no preference).
        self._capacity = capacity
        # Called with the model id whenever an attempt ends without a response head (e.g. a
        # pool's resident died: its pool re-checks residency; docs/activator.md, Self-heal).
        self._on_dispatch_failure = on_dispatch_failure
        self._pool = pool
        self._config = config
        self._retry_policy = RetryPolicy(
            max_connect_retries=config.max_connect_retries,
            max_request_retries=config.max_request_retries,
            require_pylon_retry_signal=config.require_pylon_retry_signal,
        )
        # Builds each request's plan (algorithm, labels, routing input): ProxyApp uses it too.
        self.planner = Planner(routing, lb_config)
        self._balancers = BalancerRegistry()
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._backend_counters: dict[tuple[RoutingTargetKey, str], int] = {}
        self.head_waits = HeadWaits()
        # docs/outliers.md: failing backends are ejected, joining ones ramp up. The runtime
        # settles `slow_start` when warmup ends and calls `sweep_outliers` from its sweep.
        self.outliers = OutlierDetector(
            EjectionPolicy(
                consecutive_failures=config.outlier_consecutive_failures,
                base_ejection=config.outlier_base_ejection_ms / 1000,
                max_ejection=config.outlier_max_ejection_ms / 1000,
                max_ejection_percent=config.outlier_max_ejection_percent,
                decay_interval=config.outlier_decay_interval_ms / 1000,
            )
        )
        self.slow_start = SlowStart(
            SlowStartPolicy(
                window=config.slow_start_window_ms / 1000,
                aggression=config.slow_start_aggression,
                min_weight_percent=config.slow_start_min_weight_percent,
            )
        )
        # Per model, how long requests waited for a backend: the Retry-After of its 503s.
        self.routing_waits = RoutingWaits()

    def forget_target(self, target: RoutingTargetKey) -> None:
        """The target emptied: its load-balancer state and cluster counters start afresh."""
        self._balancers.forget(target)
        for key in [key for key in self._backend_counters if key[0] == target]:
            del self._backend_counters[key]

    def forget_departed(self) -> None:
        """Housekeeping (the runtime's sweep): drop the round-robin counters of clusters that
        left their target, and any balancer of a target with no backend left. A cluster leaving
        a target that keeps other clusters does not empty it, so `forget_target` never sees
        it; and a request that resumes after an await may touch a counter of a cluster that
        left meanwhile. Visits every counter: not for the request path."""
        routing = self._routing
        for key in [key for key in self._backend_counters if not routing.has_cluster(*key)]:
            del self._backend_counters[key]
        for target in self._balancers.targets():
            if isinstance(target, RoutingTargetKey) and not routing.active_backend_count(target):
                self._balancers.forget(target)

    @property
    def retained(self) -> dict[str, int]:
        """What the forwarder keeps between requests, by kind (tests and debugging): balancer
        instances, cluster round-robin counters, (backend, target) pairs with an attempt
        waiting for its head."""
        return {
            "balancers": self._balancers.instance_count(),
            "cluster_counters": len(self._backend_counters),
            "head_waits": self.head_waits.pairs,
        }

    def backend_unroutable(self, registration: Registration, target: RoutingTargetKey) -> None:
        """The routing state's listener: this backend no longer serves `target`, so attempts
        still waiting for its response head move on now rather than at the head timeout."""
        cancelled = self.head_waits.cancel(registration, target)
        if cancelled:
            log.info(
                "backend unroutable; moving %d request(s) waiting for its response head: "
                "backend=%s model=%s",
                cancelled,
                registration.identity.inference_server_id,
                target.model_id,
            )

    def resolve_algorithm(self, request: ProxyRequest) -> AlgorithmSpec:
        """The algorithm for `request`, or a bare 400 (docs/data-plane.md, Header contract,
        validation steps 2-3): for callers without a plan; `ProxyApp` plans with `planner`."""
        return self.planner.plan(request).spec

    async def forward(
        self,
        request: ProxyRequest,
        spec: AlgorithmSpec,
        body: bytes | bytearray,
        trace: RequestSpan | None = None,
    ) -> Forwarded | LocalError:
        """`forward_plan` for callers without a plan (tests, tools): `request` routed by `spec`."""
        return await self.forward_plan(self.planner.plan(request, spec), body, trace)

    async def forward_plan(
        self,
        plan: RequestPlan,
        body: bytes | bytearray,
        trace: RequestSpan | None = None,
        *,
        on_hold: Callable[[], None] | None = None,
    ) -> Forwarded | LocalError:
        """Route and attempt until a final response (or local error) for `plan`'s request;
        `trace` (tracing on) gets the routing decision and a child span per attempt; `on_hold` is
        called once, when the routing wait's first sleep begins (docs/clients.md, "Held streaming
        requests"). The outcome's `waited` is the routing wait it had."""
        request, spec, target = plan.request, plan.spec, plan.target
        labels = self.planner.labels(plan)
        model, routing_key = labels
        start = trio.current_time()
        state = Attempts(budget_deadline=_deadline(start, request.retry_budget_ms))
        context = _RequestContext(plan, body, labels, start, state, trace, on_hold)
        if trace is not None:
            trace.set_request(request, spec.name, len(body))
        routing_request = plan.routing
        first_selection = True
        while True:
            if not first_selection:
                # How long the request has waited so far: wait-and-widen unlocks later TTFT
                # buckets and widens its queue SLO with it (docs/data-plane.md, Wait-and-widen).
                waited_ms = (trio.current_time() - start) * 1000.0
                routing_request = replace(routing_request, waited_ms=waited_ms)
            snapshot = self._routing.snapshot(target)
            clusters = snapshot.clusters if snapshot is not None else ()
            eligible = [c for c in clusters if c.cluster_id not in state.failed_clusters]
            if eligible and spec.max_input_work_seconds is not None:
                rejection = input_work_rejection_for(spec, eligible, request.input_tokens)
                if rejection is not None:
                    self._metrics.count_admission_rejection(model, rejection, routing_key)
                    if trace is not None:
                        trace.admission_rejected(rejection)
                    return LocalError(input_work_limit_exceeded(request.model_id))
            choice = (
                self._balancers.choose(
                    target,
                    spec,
                    clusters,
                    routing_request,
                    self._excluded_clusters(eligible, state),
                )
                if eligible
                else None
            )
            if first_selection:
                first_selection = False
                self._metrics.observe_routing_duration(
                    model, routing_key, trio.current_time() - start
                )
            if choice is None:
                unanswered = await self._nothing_chosen(context, bool(clusters), eligible)
                if unanswered is not None:
                    return unanswered
                continue  # waited, or the queue check waived: choose again
            if context.wait_started is not None:
                self._chosen_after_wait(context)
            if trace is not None:
                trace.routing_choice(
                    len(eligible),
                    choice.rank_depth,
                    choice.cluster.cluster_id,
                    choice.after_kv_free_tokens_skip,
                )
            selection = "primary" if choice.rank_depth <= 1 else "fallback"
            self._metrics.count_selection(spec.name, model, routing_key, selection)
            if choice.after_kv_free_tokens_skip:
                self._metrics.count_kv_free_token_fallback(spec.name, model, routing_key)
            outcome = await self._attempt_cluster(
                context, choice.cluster, choice.backends, choice.queue_allowance_ms
            )
            if outcome is not None:
                if context.waited:
                    if isinstance(outcome, Forwarded):
                        outcome.waited = context.waited
                    else:
                        outcome = replace(outcome, waited=context.waited)
                return outcome
            # None: the cluster failed for this request; choose again with it excluded.

    def _chosen_after_wait(self, context: _RequestContext) -> None:
        """A backend was chosen after a routing wait: the wait (from the request's start) goes
        into its model's average, the `Retry-After` of its 503s (stargate/proxy/routing_wait.py).
        A later wait of the same request (after a failed cluster) counts again, to its end."""
        now = trio.current_time()
        context.waited = now - context.start
        context.wait_started = None
        self.routing_waits.observe(context.labels[0], context.waited, now)

    async def _nothing_chosen(
        self, context: _RequestContext, any_cluster: bool, eligible: Sequence[ClusterSnapshot]
    ) -> LocalError | None:
        """The balancer chose nothing (docs/data-plane.md, Forwarding, step 4): None to choose
        again (after a routing-wait sleep, or with the queue check waived), else the 404 or 503."""
        plan, state = context.plan, context.attempts
        now = trio.current_time()
        wait_deadline = _deadline(context.start, plan.request.max_wait_ms)
        if eligible and wait_deadline is not None and now < wait_deadline:
            if context.wait_started is None:
                context.wait_started = now
                if context.on_hold is not None:  # once: the request is held from now on
                    on_hold, context.on_hold = context.on_hold, None
                    on_hold()
            await trio.sleep(min(wait_deadline - now, self._rng.uniform(0.001, 0.009)))
            return None
        if context.wait_started is not None:
            context.waited = now - context.start  # the wait ran out: all of it was routing wait
        model, routing_key = context.labels
        if not expired(state.budget_deadline, now) and state.waive_queue_check():
            self._metrics.count_retry(model, "queue_check_waived", routing_key)
            return None
        if (
            not any_cluster
            and not self._routing.is_advertised(plan.target)
            and not (state.failed_any and not self._routing.any_demoted)
        ):
            return LocalError(no_eligible_candidates(plan.request.model_id), context.waited)
        error = self._unavailable(plan.request, state, bool(eligible), context.labels)
        return LocalError(error, context.waited)

    def _excluded_backends(self, state: Attempts) -> AbstractSet[str]:
        """Backends no attempt of this request may use: those it failed, the demoted ones, and
        those the current decision leaves out (docs/outliers.md)."""
        excluded: AbstractSet[str] = state.failed_backends
        if self._routing.any_demoted:
            excluded = excluded | self._routing.demoted
        if state.left_out:
            excluded = excluded | state.left_out
        return excluded

    def _leave_out(self, eligible: Sequence[ClusterSnapshot], state: Attempts) -> AbstractSet[str]:
        """The backends one routing decision leaves out (docs/outliers.md): the ejected ones,
        unless every candidate is ejected, and each one in its slow-start window with
        probability 1 - its factor. O(1) while nothing is ejected and nobody is in a window."""
        now = trio.current_time()
        outliers = self.outliers
        if outliers.any_ejected:
            self._expire_ejections(now)
        ejected = outliers.ejected
        ramping = self.slow_start.active(self._routing.last_join, now)
        if not ejected and not ramping:
            return frozenset()
        unusable = self._excluded_backends(state)  # (`state.left_out` is empty here)
        candidates = [
            backend
            for cluster in eligible
            for backend in cluster.backends
            if backend.inference_server_id not in unusable
        ]
        left_out: set[str] = set()
        if ejected:
            left_out = {
                b.inference_server_id for b in candidates if b.inference_server_id in ejected
            }
            if len(left_out) == len(candidates):
                left_out = set()  # every candidate is ejected: route as if none were
        if ramping:
            sat_out = self.slow_start.left_out(
                (
                    (b.inference_server_id, b.joined_at)
                    for b in candidates
                    if b.inference_server_id not in left_out
                ),
                now,
                self._rng.random,
            )
            for backend_id in sat_out:
                self._metrics.count_slow_start_left_out(backend_id)
            left_out |= sat_out
        return left_out

    def _has_room(self, backend: BackendSnapshot) -> bool:
        """The backend is below its connection cap (a request gets a connection at once)."""
        return self._capacity is None or self._capacity.has_free_slot(backend.url)

    @property
    def _any_full(self) -> bool:
        """Some backend is at its connection cap: only then is `_has_room` worth asking."""
        return self._capacity is not None and self._capacity.any_full

    def _excluded_clusters(
        self, eligible: Sequence[ClusterSnapshot], state: Attempts
    ) -> AbstractSet[str]:
        """What the balancer must not choose: the clusters this request failed; the clusters
        whose every candidate this decision leaves out (ejected, or sitting out a slow start:
        docs/outliers.md; drawn here, once per decision, into `state.left_out`); and, while some
        eligible cluster has a backend below its connection cap, the clusters whose every
        candidate backend is at its cap (docs/data-plane.md, Per-backend connections)."""
        failed = state.failed_clusters
        state.left_out = frozenset()
        left_out = state.left_out = self._leave_out(eligible, state)
        if not left_out and not self._any_full:
            return failed
        excluded_backends = self._excluded_backends(state)
        out: set[str] = set()
        if left_out:
            for cluster in eligible:
                ids = [b.inference_server_id for b in cluster.backends]
                if any(i in left_out for i in ids) and all(i in excluded_backends for i in ids):
                    out.add(cluster.cluster_id)
            if not self._any_full:
                return failed | out if out else failed
        full: set[str] = set()
        for cluster in eligible:
            if cluster.cluster_id in out:
                continue
            candidates = [
                b for b in cluster.backends if b.inference_server_id not in excluded_backends
            ]
            if candidates and not any(self._has_room(b) for b in candidates):
                full.add(cluster.cluster_id)
        if not full or len(full) == len(eligible) - len(out):
            # Nothing is full, or everything left is: then a request waits for a slot.
            return failed | out if out else failed
        return failed | out | full

    async def _attempt_cluster(
        self,
        context: _RequestContext,
        cluster: ClusterSnapshot,
        preferred: tuple[BackendSnapshot, ...] = (),
        allowance_ms: int = 0,
    ) -> Forwarded | LocalError | None:
        """Attempts on backends of one cluster until a final answer; None when the whole cluster
        failed for this request (the balancer then chooses again without it). `preferred`: the
        balancer's order of the cluster's backends, else its round robin; `allowance_ms`: the
        queue the balancer accepted on top of the estimate (`Choice.queue_allowance_ms`)."""
        state = context.attempts
        while True:
            backend = self._next_backend(context.plan.target, cluster, state, preferred)
            if backend is None:
                state.failed_clusters.add(cluster.cluster_id)
                return None
            response, decision = await self._attempt(context, cluster, backend, allowance_ms)
            action = decision.action
            if action is Action.RESPOND:
                assert response is not None  # only a response head is passed through
                return Forwarded(response, backend)
            if action is Action.FAIL:
                return LocalError(_upstream_failed(context.plan.request))
            if action is Action.UNAVAILABLE:
                return LocalError(_backends_full(context.plan.request))
            if response is not None:
                await response.aclose()
            if action is Action.OTHER_CLUSTER:
                return None
            # Action.SIBLING: a sibling first, then another cluster. RESEND_WITHOUT_QUEUE_CHECK:
            # this cluster again (the backend is not excluded), without the check.

    def _next_backend(
        self,
        target: RoutingTargetKey,
        cluster: ClusterSnapshot,
        state: Attempts,
        preferred: tuple[BackendSnapshot, ...] = (),
    ) -> BackendSnapshot | None:
        """The cluster's round robin, or the first of `preferred` left (docs/data-plane.md,
        Backend choice); None: none is left."""
        counter = 0
        if not preferred:
            counter_key = (target, cluster.cluster_id)
            counter = self._backend_counters.get(counter_key, 0)
            self._backend_counters[counter_key] = counter + 1
        return choose_backend(
            cluster,
            counter,
            self._excluded_backends(state),
            self._has_room if self._any_full else None,
            preferred,
        )

    async def _attempt(
        self,
        context: _RequestContext,
        cluster: ClusterSnapshot,
        backend: BackendSnapshot,
        allowance_ms: int = 0,
    ) -> tuple[BackendResponse | None, Decision]:
        """One attempt (docs/data-plane.md, One attempt): reserve, send, wait for the head; the
        response head (None: there is none) and what the retry rules decided."""
        plan, state = context.plan, context.attempts
        request = plan.request
        # Each attempt adds its own reservation (docs/data-plane.md, Reservations); only a
        # queue-estimate mismatch releases it early, otherwise the backend's next heartbeat does.
        reservation = self._routing.reserve(
            plan.target,
            cluster.cluster_id,
            backend.registration,
            request.input_tokens,
            request.priority,
        )
        if reservation is None:
            # The backend left the target after this cluster's snapshot was taken (a previous
            # attempt waited): no longer a candidate. Nothing is sent, so no retry is spent.
            state.failed_backends.add(backend.inference_server_id)
            return None, _BACKEND_LEFT
        headers = (
            request.headers
            if state.queue_check_waived
            else _attempt_headers(request.headers, cluster, request.priority, allowance_ms)
        )
        span: AttemptSpan | None = None
        if context.trace is not None:  # its context replaces the client's traceparent
            span = context.trace.start_attempt(
                backend.inference_server_id, cluster.cluster_id, backend.url
            )
            headers = span.inject(headers)
        self._metrics.observe_replay_buffer(request.model_id, len(context.body))
        try:
            response = await self._request_head(
                backend, plan.target, request.target_path, headers, context.body
            )
        except UpstreamError as error:  # no free connection in time included
            return None, self._conclude(context, cluster, backend, reservation, span, None, error)
        except BaseException:
            if span is not None:  # cancelled (the client left, shutdown): end its span
                span.abandon()
            raise
        return response, self._conclude(context, cluster, backend, reservation, span, response)

    def _conclude(
        self,
        context: _RequestContext,
        cluster: ClusterSnapshot,
        backend: BackendSnapshot,
        reservation: Reservation,
        span: AttemptSpan | None,
        response: BackendResponse | None,
        error: UpstreamError | None = None,
    ) -> Decision:
        """The one place an attempt's outcome becomes its decision, metrics, log line and side
        effects. The outcome is a response head, or none: `error` (a transport failure, or no
        connection freed up in time), or neither (`backend_unroutable` cancelled the wait). The
        rules are `retry.py`'s; `_FAILURES` says how a failure is counted and logged."""
        state = context.attempts
        metrics = self._metrics
        model, routing_key = context.labels
        server_id = backend.inference_server_id
        now = trio.current_time()
        if response is not None:
            metrics.count_attempt(server_id, model, f"upstream_{response.status}", routing_key)
            metrics.observe_duration(server_id, model, routing_key, now - context.start)
            head = UpstreamHead.from_headers(response.status, response.headers)
            decision = decide_response(state, head, self._retry_policy, now)
            if decision.release_reservation:
                self._routing.release(reservation)
            self._record_health(server_id, _health(head, response.headers), now)
        else:
            kind = _failure_kind(error)
            report = _FAILURES[kind]
            if span is not None and error is not None:
                span.failed(error)
            metrics.count_attempt(server_id, model, report.result, routing_key)
            request_id = context.plan.request.request_id
            if error is None:
                log.log(report.level, report.message, request_id, server_id)
            else:
                log.log(report.level, report.message, request_id, server_id, error)
            decision = decide_transport_failure(state, kind, self._retry_policy, now)
            if decision.demote:
                self._routing.demote(server_id)
            if kind is FailureKind.CONNECT or kind is FailureKind.OTHER:
                self._record_health(server_id, Result.TRANSPORT_FAILURE, now)
            # Any kind: a pool re-checks its member's residency (docs/activator.md, Self-heal).
            self._dispatch_failed(context.plan.request)
        if decision.exhausted_reason is not None:
            metrics.count_retry_exhausted(model, decision.exhausted_reason, routing_key)
        if decision.retry_reason is not None:
            metrics.count_retry(model, decision.retry_reason, routing_key)
        record(state, decision, server_id, cluster.cluster_id)
        if span is not None:
            span.end(
                None if response is None else response.status,
                decision.retry_reason,
                decision.action is Action.RESPOND,
                state,
            )
        return decision

    def _record_health(self, server_id: str, result: Result, now: float) -> None:
        """One attempt's verdict on its backend, for outlier ejection (docs/outliers.md): the
        ejection it caused, if any, logged and counted. O(1) for a healthy backend."""
        event = self.outliers.record(server_id, result, now, self._routing.backend_count())
        if event is None:
            return
        metrics = self._metrics
        if isinstance(event, Ejection):
            log.warning(
                "outlier ejected: backend=%s reason=%s consecutive=%d ejections=%d ejection_ms=%d",
                server_id,
                event.reason.value,
                event.consecutive,
                event.ejections,
                round(event.duration * 1000),
            )
            metrics.count_outlier_ejection(server_id, event.reason.value)
            metrics.outlier_ejected.set(len(self.outliers.ejected))
        else:
            log.warning(
                "outlier not ejected, --outlier-max-ejection-percent reached: backend=%s "
                "reason=%s consecutive=%d ejected=%d allowed=%d",
                server_id,
                event.reason.value,
                event.consecutive,
                event.ejected,
                event.allowed,
            )
            metrics.count_outlier_ejection_refused(event.reason.value)

    def _expire_ejections(self, now: float) -> None:
        """End the ejections whose time is up, with a log line each (docs/outliers.md)."""
        returned = self.outliers.expire(now)
        for back in returned:
            log.info(
                "outlier returned to routing: backend=%s ejected_ms=%d ejections=%d",
                back.backend_id,
                round(back.duration * 1000),
                back.ejections,
            )
        if returned:
            self._metrics.outlier_ejected.set(len(self.outliers.ejected))

    def sweep_outliers(self) -> None:
        """Housekeeping (the runtime's sweep): end ejections that are due even when no request
        comes, and forget the records of backends that are no longer registered. Visits every
        record: not for the request path."""
        now = trio.current_time()
        self._expire_ejections(now)
        dropped = self.outliers.forget(
            lambda backend_id: self._routing.is_registered(backend_id), now
        )
        if dropped:
            log.info("outlier ejections ended with their registrations: backends=%s", dropped)
            self._metrics.outlier_ejected.set(len(self.outliers.ejected))

    def _dispatch_failed(self, request: ProxyRequest) -> None:
        """An attempt for `request` ended without a response head."""
        if self._on_dispatch_failure is not None:
            self._on_dispatch_failure(request.model_id)

    async def _request_head(
        self,
        backend: BackendSnapshot,
        target: RoutingTargetKey,
        path_and_query: bytes,
        headers: Headers,
        body: bytes | bytearray,
    ) -> BackendResponse | None:
        """Send one attempt and wait for its response head; None when the backend stopped being
        routable for `target` first (`backend_unroutable` cancelled the wait). A tunnel backend
        is reached through its tunnel, any other over HTTP (docs/tunnels.md)."""
        registration = backend.registration
        scope = self.head_waits.open(registration, target)
        try:
            with scope:
                if self._tunnels is not None and is_tunnel(registration.identity):
                    return await self._tunnels.request(
                        registration, "POST", path_and_query, headers, body
                    )
                url = backend.url.rstrip("/") + path_and_query.decode("latin-1")
                return await self._pool.request("POST", url, headers, body)
        finally:
            self.head_waits.close(registration, target, scope)
        return None  # cancelled by `backend_unroutable`; the pool closed the connection

    def _unavailable(
        self, request: ProxyRequest, state: Attempts, choosable: bool, labels: tuple[str, str]
    ) -> ContractError:
        """The bare 503 of docs/data-plane.md, Local answers, with what an OpenAI-form answer says
        about it; with `Retry-After` from how long the model's requests recently waited for a
        backend, when that is measured (stargate/proxy/routing_wait.py)."""
        model = request.model_id
        if state.failed_any:
            label_model, routing_key = labels
            self._metrics.count_retry_exhausted(label_model, "no_eligible_backend", routing_key)
            message = f"every backend tried for model {model!r} failed; retry later"
            code = "no_eligible_backend"
        elif choosable:
            message = f"every backend of model {model!r} is busy; retry later"
            code = "no_available_backend"
        else:
            message = f"model {model!r} is registered but has no active backend; retry later"
            code = "no_active_backend"
        retry_after = self.routing_waits.retry_after(labels[0], trio.current_time())
        headers = None if retry_after is None else [(b"retry-after", b"%d" % retry_after)]
        return ContractError(503, headers=headers, message=message, code=code, param="model")


def _upstream_failed(request: ProxyRequest) -> ContractError:
    """The bare 502 of docs/data-plane.md, Local answers. The message names no backend: clients
    never learn the topology."""
    return ContractError(
        502,
        message=f"the upstream request for model {request.model_id!r} failed; retry later",
        code="upstream_failed",
    )


def _backends_full(request: ProxyRequest) -> ContractError:
    """The bare 503 when every candidate backend stayed at its connection cap for the pool's
    acquire timeout (docs/data-plane.md, Per-backend connections)."""
    return ContractError(
        503,
        message=f"every backend of model {request.model_id!r} is at its connection limit "
        "(--proxy-max-connections-per-backend); retry later",
        code="no_available_backend",
        param="model",
    )


def _attempt_headers(
    headers: Headers, cluster: ClusterSnapshot, priority: int, allowance_ms: int = 0
) -> Headers:
    """The request's filtered headers plus this attempt's expected queue time, if known, raised
    by the queue the balancer accepted for the cache's sake (docs/prefix-routing.md, "The
    Pylon's queue check"), so the Pylon refuses only past what the balancer tolerated."""
    estimate = expected_queue_ms(cluster, priority)
    if estimate is None:
        return headers
    return [*headers, (b"x-stargate-expected-queue-ms", str(estimate + allowance_ms).encode())]
