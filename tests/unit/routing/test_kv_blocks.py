"""A replica applying its Pylons' KV-block deltas (stargate/routing/kv_blocks.py and
`RoutingState.apply_kv_blocks`): one set per backend, shared by reference with every snapshot,
replaced by a reset, bounded, and gone with the registration; then the same through the real
registration service and the `/debug/routing` view."""

from __future__ import annotations

import json
from collections.abc import Callable

import trio
from trio.testing import MockClock

from stargate.admin_app import create_admin_app
from stargate.config import WarmupConfig
from stargate.control_plane.auth import OpenAuthenticator
from stargate.control_plane.registration import RegistrationConfig, RegistrationService
from stargate.grpc_asgi import RequestStream, RpcContext
from stargate.protocol import stargate_pb2 as pb
from stargate.readiness import Readiness
from stargate.routing import (
    BackendRoute,
    BackendSnapshot,
    ModelStats,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)
from stargate.routing.kv_blocks import KvBlocks
from stargate.routing.state import NO_KV_BLOCKS
from tests.fakes.pylon import registration

M = RoutingTargetKey(None, "m")
N = RoutingTargetKey(None, "n")


def identity(server_id: str) -> RegistrationIdentity:
    return RegistrationIdentity(server_id, server_id, f"http://127.0.0.1:1/{server_id}", None)


def route() -> BackendRoute:
    return BackendRoute(ModelStats(), 1_000, 0.0)


def backend(state: RoutingState, target: RoutingTargetKey = M) -> BackendSnapshot:
    snapshot = state.snapshot(target)
    assert snapshot is not None
    (cluster,) = snapshot.clusters
    (only,) = cluster.backends
    return only


def test_a_backend_without_kv_events_shows_an_empty_frozenset() -> None:
    state = RoutingState()
    reg = state.begin(identity("a"))
    state.apply(reg, {"m": route()})
    assert backend(state).kv_blocks is NO_KV_BLOCKS
    assert backend(state).kv_blocks == frozenset()
    # Built directly (as the balancers' tests do), a snapshot has none either.
    assert BackendSnapshot(reg, ModelStats(), 1, 0.0).kv_blocks == frozenset()


def test_deltas_apply_in_order_and_every_snapshot_shares_the_set() -> None:
    state = RoutingState()
    reg = state.begin(identity("a"))
    assert state.apply_kv_blocks(reg, reset=True, added=[1, 2, 3], removed=[])
    state.apply(reg, {"m": route(), "n": route()})
    first = backend(state, M)
    assert set(first.kv_blocks) == {1, 2, 3} and 2 in first.kv_blocks
    assert backend(state, N).kv_blocks is first.kv_blocks  # one set per backend, not per model
    # Added, then removed: a block in both ends up absent.
    state.apply_kv_blocks(reg, reset=False, added=[4, 5], removed=[1, 5, 99])
    assert set(first.kv_blocks) == {2, 3, 4}  # the snapshot taken before sees it: no copy
    state.apply(reg, {"m": route(), "n": route()})  # a heartbeat: new snapshots, the same set
    assert backend(state, M).kv_blocks is first.kv_blocks
    # A reset replaces the set.
    state.apply_kv_blocks(reg, reset=True, added=[7], removed=[])
    assert set(backend(state).kv_blocks) == {7}
    assert first.kv_blocks == {7}  # set comparisons work on the view
    assert "kv_blocks" not in repr(first)  # a million hashes never land in a log line


def test_the_first_delta_after_the_routes_reaches_the_stored_snapshots() -> None:
    state = RoutingState()
    reg = state.begin(identity("a"))
    state.apply(reg, {"m": route()})
    held = state.snapshot(M)
    state.apply_kv_blocks(reg, reset=True, added=[1], removed=[])
    assert set(backend(state).kv_blocks) == {1}
    assert held is not state.snapshot(M)  # the cached target snapshot was rebuilt


def test_a_backend_that_leaves_drops_its_set() -> None:
    state = RoutingState()
    reg = state.begin(identity("a"))
    state.apply_kv_blocks(reg, reset=True, added=[1, 2], removed=[])
    state.apply(reg, {"m": route()})
    held = backend(state)
    assert state.end(reg)
    assert reg.kv_blocks is None and len(held.kv_blocks) == 0
    assert not state.apply_kv_blocks(reg, reset=True, added=[3], removed=[])  # ended: ignored
    # The same backend back on a new stream starts from nothing (its first message resets).
    again = state.begin(identity("a"))
    state.apply(again, {"m": route()})
    assert backend(state).kv_blocks == frozenset()


def test_the_set_is_bounded_dropping_the_oldest() -> None:
    blocks = KvBlocks(max_blocks=3)
    blocks.apply(reset=False, added=[1, 2, 3], removed=[])
    blocks.apply(reset=False, added=[1, 4], removed=[])  # 1 again: the newest; 2 goes
    assert list(blocks.view) == [3, 1, 4] and blocks.dropped_over_bound == 1
    blocks.apply(reset=True, added=range(10), removed=[])
    assert list(blocks.view) == [7, 8, 9] and len(blocks) == 3


# ---- through the registration service and the debug view --------------------------------------


class Probe:
    async def __call__(self, url: str) -> int:
        await trio.sleep(0.01)
        return 1_000


async def until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 (routing state changes have no event)
            await trio.sleep(0.01)


def debug_counts(state: RoutingState) -> dict[str, int]:
    app = create_admin_app(Readiness(WarmupConfig(0)), state, stargate_id="r")
    answer = app._answer("GET", "/debug/routing", b"")
    body = json.loads(answer.body)
    return {
        entry["inference_server_id"]: entry["kv_blocks"]
        for target in body["targets"]
        for cluster in target["clusters"]
        for entry in cluster["backends"]
    }


async def test_registration_messages_carry_the_deltas_to_the_routing_state(
    autojump_clock: MockClock,
) -> None:
    state = RoutingState()
    service = RegistrationService(
        state, OpenAuthenticator(), Probe(), RegistrationConfig(idle_timeout_ms=0)
    )
    send, receive = trio.open_memory_channel[pb.InferenceServerRegistration](10)
    acks: list[pb.InferenceServerAck] = []

    async def ack(message: pb.InferenceServerAck) -> None:
        acks.append(message)

    context = RpcContext(
        method="/stargate.StargateControlPlane/RegisterInferenceServer",
        metadata={"x-stargate-registration-heartbeat-ms": "1000"},
        deadline=None,
        peer="",
    )

    def message(**kv: object) -> pb.InferenceServerRegistration:
        base = registration("a", "http://127.0.0.1:1", ["m"])
        base.MergeFrom(pb.InferenceServerRegistration(**kv))  # type: ignore[arg-type]
        return base

    async with trio.open_nursery() as nursery:
        nursery.start_soon(service.register, RequestStream(receive), context, ack)
        plain = registration("b", "http://127.0.0.1:2", ["m"])
        other_send, other_receive = trio.open_memory_channel[pb.InferenceServerRegistration](1)
        nursery.start_soon(service.register, RequestStream(other_receive), context, ack)
        await other_send.send(plain)  # a Pylon without KV events

        await send.send(message(kv_blocks_reset=True, kv_blocks_added=[1, 2, 3]))
        await until(lambda: len(acks) == 2)
        assert debug_counts(state) == {"a": 3, "b": 0}
        await send.send(message(kv_blocks_added=[4], kv_blocks_removed=[1]))
        await send.send(message())  # a heartbeat without changes changes nothing
        await until(lambda: len(acks) == 4)
        assert debug_counts(state) == {"a": 3, "b": 0}
        await send.send(message(kv_blocks_reset=True))  # the engine cleared its cache
        await until(lambda: len(acks) == 5)
        assert debug_counts(state) == {"a": 0, "b": 0}
        (registered,) = (r for r in state.registrations() if r.identity.inference_server_id == "a")
        await send.aclose()  # the stream ends: the set goes with it
        await until(lambda: registered.ended)
        assert registered.kv_blocks is None
        service.shutdown()
