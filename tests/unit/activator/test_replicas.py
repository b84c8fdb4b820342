"""Pools are per replica (README, Model pools): the start-up warning for a replica whose
Kubernetes-controlled pools other replicas may also drive, decided from its discovery config."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from stargate.activator import FakeController, wiring
from stargate.activator.config import PoolsConfig, parse_pool_config
from stargate.activator.wiring import shared_pools_warning
from stargate.config import ActivatorConfig, DiscoveryConfig, ListenAddress, ServeConfig
from stargate.runtime import Replica


def _pools(*kinds: str) -> PoolsConfig:
    pools: list[dict[str, Any]] = []
    for index, kind in enumerate(kinds):
        member = f"model-{index}"
        entry: dict[str, Any] = {
            "kubernetes": {"kind": "Deployment", "name": f"engine-{index}"},
            "process": {"command": ["engine", "--port", "{port}"]},
        }.get(kind, {})
        controller: dict[str, Any] = {"kind": kind}
        if entry:
            controller["members"] = {member: entry}
        pools.append({"name": f"{kind}-pool", "members": [member], "controller": controller})
    return parse_pool_config({"pools": pools})


WARNING = (
    "model pools kubernetes-pool use the kubernetes controller but this replica has {peers}: "
    "every replica runs its own activator with per-process locks, so replicas can scale down each "
    "other's busy members and undo each other's activations; run a single replica while pools "
    "are enabled (README, Model pools)"
)


@pytest.mark.parametrize(
    ("discovery", "peers"),
    [
        (
            DiscoveryConfig(peers=("10.0.0.2:50071", "b=10.0.0.3:50071")),
            "static peers 10.0.0.2:50071, b=10.0.0.3:50071",
        ),
        (
            DiscoveryConfig(dns_name="router-headless.llm.svc.cluster.local"),
            "peers discovered through router-headless.llm.svc.cluster.local",
        ),
    ],
    ids=["static-peers", "dns-name"],
)
def test_kubernetes_pools_with_peers_warn(discovery: DiscoveryConfig, peers: str) -> None:
    warning = shared_pools_warning(_pools("kubernetes", "process"), discovery)
    assert warning == WARNING.format(peers=peers)


@pytest.mark.parametrize(
    ("kinds", "discovery"),
    [
        (("kubernetes",), DiscoveryConfig()),  # alone: nothing to discover
        (("kubernetes",), DiscoveryConfig(disable_dns_discovery=True)),
        (("kubernetes",), DiscoveryConfig(dns_name="x.example", disable_dns_discovery=True)),
        (("process",), DiscoveryConfig(peers=("10.0.0.2:50071",))),  # this replica's own engines
        (("fake",), DiscoveryConfig(dns_name="x.example")),
    ],
    ids=["alone", "dns-disabled", "dns-name-but-disabled", "process-pool", "fake-pool"],
)
def test_no_warning_when_alone_or_nothing_is_shared(
    kinds: tuple[str, ...], discovery: DiscoveryConfig
) -> None:
    assert shared_pools_warning(_pools(*kinds), discovery) is None


async def test_the_replica_logs_the_warning_when_its_activator_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `Replica._start_activator`, as `stargate serve` runs it (a fake-kind pool would not
    warn, so the pool file uses the kubernetes kind with a stand-in controller)."""
    pool_file = tmp_path / "pools.yaml"
    pool_file.write_text(
        "pools:\n"
        "  - name: kubernetes-pool\n"
        "    members: [model-0]\n"
        "    controller:\n"
        "      kind: kubernetes\n"
        "      members:\n"
        "        model-0: {kind: Deployment, name: engine-0}\n"
    )
    config = ServeConfig(
        "r1",
        metrics_listen_addr=ListenAddress("127.0.0.1", 0),
        discovery=DiscoveryConfig(peers=("10.0.0.2:50071",)),
        activator=ActivatorConfig(pool_config_path=pool_file),
    )
    replica = Replica(config)
    # No API server here: the pool gets the in-memory controller instead of a KubernetesController.
    monkeypatch.setattr(
        wiring,
        "member_controller",
        lambda pool, **_: FakeController(replica.member_availability, pool.pool.members),
    )
    with caplog.at_level(logging.WARNING, logger="stargate.runtime"):
        async with trio.open_nursery() as nursery:
            activator = await replica._start_activator(nursery)
            assert activator is not None
            nursery.cancel_scope.cancel()
    await replica.pools.stop_members()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        WARNING.format(peers="static peers 10.0.0.2:50071")
    ]
