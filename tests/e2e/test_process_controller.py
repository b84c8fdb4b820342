"""The `process` member controller (docs/decisions.md, D7) with real engine processes on loopback.

Members are `stargate mock-backend` processes; the real clock runs throughout, so every wait is
on an event (the routing state's count changes, fed to a `MemberAvailability`) under a bound.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry

from stargate.activator.members import MemberAvailability
from stargate.activator.metrics import ActivatorMetrics
from stargate.activator.pool import Activator, PoolSpec
from stargate.activator.process import MemberCommand, ProcessController
from stargate.routing.state import RoutingState, RoutingTargetKey
from tests.e2e.processes import mock_engine_command

POOL = "local"
WAIT = 15.0  # bound on any single wait for a real process (startup is well under a second)


def mock_engine(model: str) -> MemberCommand:
    return MemberCommand(tuple(mock_engine_command(model)))


MEMBERS = {"model-a": mock_engine("model-a"), "model-b": mock_engine("model-b")}


@dataclass
class Rig:
    controller: ProcessController
    routing: RoutingState
    availability: MemberAvailability
    client: httpx.AsyncClient
    nursery: trio.Nursery

    def count(self, model: str) -> int:
        return self.routing.active_backend_count(RoutingTargetKey(None, model))

    async def wait_available(self, model: str, ready: bool = True) -> None:
        with trio.fail_after(WAIT):
            while self.availability.is_available(model) != ready:
                await self.availability.wait_changed(model)
        assert (self.count(model) > 0) == ready

    def pid(self, member: str) -> int:
        pid = self.controller.pid(member)
        assert pid is not None
        return pid


@asynccontextmanager
async def running(
    members: Mapping[str, MemberCommand] = MEMBERS, **kwargs: Any
) -> AsyncIterator[Rig]:
    """A controller over a fresh routing state; every engine is stopped at the end."""
    kwargs.setdefault("stop_grace", 3.0)
    kwargs.setdefault("health_interval", 0.2)
    availability = MemberAvailability()
    routing = RoutingState(on_target_count=availability.on_target_count)
    async with httpx.AsyncClient(trust_env=False) as client, trio.open_nursery() as nursery:
        controller = ProcessController(
            POOL, members, routing, nursery, health_client=client, **kwargs
        )
        try:
            yield Rig(controller, routing, availability, client, nursery)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(WAIT):
                await controller.aclose()
            nursery.cancel_scope.cancel()


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll `check` (a process's exit has no event to wait on from outside the controller)."""
    with trio.fail_after(WAIT):
        while True:
            if await check():
                return
            await trio.sleep(0.02)


async def stopped(rig: Rig, member: str) -> None:
    async def check() -> bool:
        return await rig.controller.phase(member) == "Stopped"

    await eventually(check)


def gone(pid: int) -> bool:
    """True once `pid` has exited and been reaped (the controller reaps what it starts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_activate_registers_and_serves() -> None:
    async with running() as rig:
        await rig.controller.activate("model-a")
        assert await rig.controller.phase("model-a") == "Starting"
        assert rig.count("model-a") == 0  # activate does not wait for health
        await rig.wait_available("model-a")
        assert await rig.controller.phase("model-a") == "Running"

        (registration,) = rig.routing.registrations()
        identity = registration.identity
        assert identity.inference_server_id == "process:local:model-a"
        assert identity.cluster_id == "process:local:model-a"
        assert identity.routing_key is None
        assert identity.url == rig.controller.url("model-a")
        assert identity.url.startswith("http://127.0.0.1:")
        snapshot = rig.routing.snapshot(RoutingTargetKey(None, "model-a"))
        assert snapshot is not None
        (backend,) = snapshot.clusters[0].backends
        assert backend.rtt_ns > 0

        response = await rig.client.get(identity.url + "/v1/models")
        assert response.status_code == 200
        assert [m["id"] for m in response.json()["data"]] == ["model-a"]


async def test_activate_is_idempotent() -> None:
    async with running() as rig:
        await rig.controller.activate("model-a")
        pid = rig.pid("model-a")
        await rig.controller.activate("model-a")  # while starting
        assert rig.pid("model-a") == pid
        await rig.wait_available("model-a")
        await rig.controller.activate("model-a")  # while running
        assert rig.pid("model-a") == pid
        assert rig.count("model-a") == 1
        assert len(rig.routing.registrations()) == 1


async def test_activate_other_member_stops_incumbent() -> None:
    async with running() as rig:
        await rig.controller.activate("model-a")
        await rig.wait_available("model-a")
        pid_a = rig.pid("model-a")

        await rig.controller.activate("model-b")
        # The incumbent is unregistered and reaped before the new member is even spawned.
        assert rig.count("model-a") == 0
        assert gone(pid_a)
        assert rig.controller.pid("model-a") is None
        assert await rig.controller.phase("model-a") == "Stopped"
        assert await rig.controller.phase("model-b") == "Starting"

        await rig.wait_available("model-b")
        assert rig.count("model-a") == 0
        assert [r.identity.inference_server_id for r in rig.routing.registrations()] == [
            "process:local:model-b"
        ]


async def test_deactivate_unregisters_and_stops() -> None:
    async with running() as rig:
        await rig.controller.activate("model-a")
        await rig.wait_available("model-a")
        pid = rig.pid("model-a")

        await rig.controller.deactivate("model-a")
        assert rig.count("model-a") == 0
        assert rig.routing.registrations() == []
        assert gone(pid)
        assert await rig.controller.phase("model-a") == "Stopped"
        await rig.controller.deactivate("model-a")  # stopped already: no-op
        await rig.controller.deactivate("model-b")  # never started: no-op


async def test_deactivate_while_starting_stops_it() -> None:
    async with running() as rig:
        await rig.controller.activate("model-a")
        pid = rig.pid("model-a")
        await rig.controller.deactivate("model-a")
        assert gone(pid)
        assert rig.routing.registrations() == []
        await trio.sleep(0.3)  # a stopped engine's health loop never registers it late
        assert rig.routing.registrations() == []


async def test_engine_that_dies_is_unregistered(caplog: pytest.LogCaptureFixture) -> None:
    async with running() as rig:
        await rig.controller.activate("model-a")
        await rig.wait_available("model-a")
        os.kill(rig.pid("model-a"), signal.SIGKILL)

        await rig.wait_available("model-a", ready=False)
        assert rig.routing.registrations() == []
        await stopped(rig, "model-a")
        assert any(
            r.levelno == logging.WARNING and "exited on its own" in r.getMessage()
            for r in caplog.records
        )

        # The member is no longer running, so activate starts it again.
        await rig.controller.activate("model-a")
        await rig.wait_available("model-a")


async def test_never_healthy_stays_unregistered_and_is_stopped() -> None:
    hang = MemberCommand((sys.executable, "-c", "import time; time.sleep(60)"))
    async with running({"hang": hang}, startup_timeout=0.5) as rig:
        await rig.controller.activate("hang")
        pid = rig.pid("hang")
        await stopped(rig, "hang")
        assert gone(pid)
        assert rig.count("hang") == 0
        assert rig.routing.registrations() == []


async def test_unhealthy_engine_loses_route_until_it_recovers() -> None:
    async with running(health_interval=0.05) as rig:
        await rig.controller.activate("model-a")
        await rig.wait_available("model-a")
        url = rig.controller.url("model-a")
        target = RoutingTargetKey(None, "model-a")

        (await rig.client.post(f"{url}/test-control", json={"healthy": False})).raise_for_status()
        await rig.wait_available("model-a", ready=False)
        assert rig.routing.is_advertised(target)  # listed, not routable: 503 rather than 404
        assert await rig.controller.phase("model-a") == "Running"

        (await rig.client.post(f"{url}/test-control", json={"healthy": True})).raise_for_status()
        await rig.wait_available("model-a")


async def test_sigkill_after_grace_even_if_deactivate_is_cancelled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "ignoring-sigterm"
    stubborn = MemberCommand(
        (
            sys.executable,
            "-c",
            "import pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "pathlib.Path(sys.argv[1]).touch()\n"
            "time.sleep(60)\n",
            str(marker),
        )
    )
    async with running({"stubborn": stubborn}, stop_grace=0.3) as rig:
        await rig.controller.activate("stubborn")
        pid = rig.pid("stubborn")
        await eventually(lambda: trio.Path(marker).exists())
        started = trio.current_time()
        with trio.move_on_after(0.05):  # the activator's controller timeout, in miniature
            await rig.controller.deactivate("stubborn")
        assert not gone(pid)  # SIGTERM is ignored, grace not over yet
        assert await rig.controller.phase("stubborn") == "Stopping"
        await stopped(rig, "stubborn")
        assert trio.current_time() - started >= 0.3
        assert gone(pid)
        assert any("sending SIGKILL" in r.getMessage() for r in caplog.records)


async def test_aclose_stops_everything() -> None:
    async with running() as rig:
        await rig.controller.activate("model-a")
        await rig.wait_available("model-a")
        pid = rig.pid("model-a")
        await rig.controller.aclose()
        assert gone(pid)
        assert rig.routing.registrations() == []
        assert await rig.controller.phase("model-a") == "Stopped"
        with pytest.raises(RuntimeError):
            await rig.controller.activate("model-b")


async def test_unknown_member_and_bad_command() -> None:
    async with running() as rig:
        with pytest.raises(ValueError):
            await rig.controller.activate("nope")
        with pytest.raises(ValueError):
            await rig.controller.deactivate("nope")
        assert await rig.controller.phase("nope") is None
    missing = MemberCommand(("/nonexistent/engine", "--port", "{port}"))
    async with running({"missing": missing}) as rig:
        with pytest.raises(FileNotFoundError):
            await rig.controller.activate("missing")
        assert await rig.controller.phase("missing") == "Stopped"
    assert MemberCommand(("x", "--port={port}", '{"a": 1}')).argv(80) == [
        "x",
        "--port=80",
        '{"a": 1}',
    ]


async def test_activator_swaps_through_process_controller() -> None:
    """End to end: the real activator over this controller, availability from the routing state."""
    async with running() as rig:
        activator = Activator(
            [PoolSpec(POOL, ("model-a", "model-b"))],
            {POOL: rig.controller},
            rig.availability,
            metrics=ActivatorMetrics.create(CollectorRegistry()),
        )
        await rig.nursery.start(activator.run)

        with await activator.acquire("model-a", hold_budget=20.0):
            assert rig.count("model-a") == 1
        pid_a = rig.pid("model-a")

        grant = await activator.acquire("model-b", hold_budget=20.0)
        try:
            assert grant.member == "model-b"
            assert rig.count("model-b") == 1
            assert rig.count("model-a") == 0
            assert gone(pid_a)
            assert activator.snapshot()[POOL]["resident"] == "model-b"
            url = rig.controller.url("model-b")
            response = await rig.client.get(f"{url}/v1/models")
            assert [m["id"] for m in response.json()["data"]] == ["model-b"]
        finally:
            grant.release()
