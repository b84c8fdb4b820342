"""Where a reverse Pylon dials (docs/tunnels.md, "Reverse handshake"): the endpoint its latest
ack names, the SNI the Rust Pylon derives from it, and the change that makes it redial."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel

from stargate.pylon.tunnel import EndpointWatch, ReverseEndpoint

POD_A = "pod-a.stargate.external:50072"


@pytest.mark.parametrize(
    ("target", "dial", "sni"),
    [
        (
            "pod-a.stargate.external:50072",
            "pod-a.stargate.external:50072",
            "pod-a.stargate.external",
        ),
        ("pod-a.stargate.external:50072", "10.0.0.1:7000", "pod-a.stargate.external"),
        ("10.0.0.1:50072", "10.0.0.1:50072", "stargate"),
        ("localhost:50072", "localhost:50072", "stargate"),
        ("[::1]:50072", "[::1]:50072", "stargate"),
        ("10.0.0.1:50072", "udp-lb.example:7000", "stargate"),  # the target's host, an IP
    ],
)
def test_the_sni_follows_the_rust_rule(target: str, dial: str, sni: str) -> None:
    assert ReverseEndpoint(target, dial).sni == sni


async def test_the_latest_ack_decides_and_a_change_is_seen_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    watch = EndpointWatch()
    assert not watch.update("", "10.0.0.1:1")  # an ack without a target names nothing
    assert watch.current is None
    seen: list[ReverseEndpoint] = []
    async with trio.open_nursery() as nursery:

        async def first() -> None:
            seen.append(await watch.wait())

        nursery.start_soon(first)
        await trio.sleep(1)
        assert seen == []
        assert watch.update(" 10.0.0.1:50072 ", "")  # no dial address: the target
        await trio.lowlevel.checkpoint()
    assert seen == [ReverseEndpoint("10.0.0.1:50072", "10.0.0.1:50072")]
    current = seen[0]
    with trio.move_on_after(5) as idle:
        watch.update("10.0.0.1:50072", "10.0.0.1:50072")  # the same endpoint: no change
        await watch.wait_changed(current)
    assert idle.cancelled_caught
    async with trio.open_nursery() as nursery:
        changed = trio.Event()

        async def wait_change() -> None:
            await watch.wait_changed(current)
            changed.set()

        nursery.start_soon(wait_change)
        await trio.sleep(1)
        watch.update("10.0.0.2:50072", "udp-lb:7000")
    assert changed.is_set()
    assert watch.current == ReverseEndpoint("10.0.0.2:50072", "udp-lb:7000")
