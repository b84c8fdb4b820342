"""The two connection-state machines of docs/tunnels.md, "Connection states" (the Rust rules)."""

from __future__ import annotations

from stargate.tunnel.gating import (
    DIRECT_GRACE_SECONDS,
    DirectGate,
    DirectState,
    ReverseSlot,
    ReverseState,
)


def test_a_direct_registration_that_never_dialed_is_unavailable_at_its_first_failure() -> None:
    gate = DirectGate()
    assert gate.dial_failed(now=0.0) is False
    assert gate.state is DirectState.UNAVAILABLE
    assert gate.dial_failed(now=1.0) is False  # and stays so until a dial succeeds
    gate.dialed()
    assert gate.state is DirectState.CONNECTED


def test_a_connected_registration_recovers_for_the_grace_then_is_unavailable() -> None:
    gate = DirectGate()
    gate.dialed()
    assert gate.dial_failed(now=10.0) is True
    assert gate.state is DirectState.RECOVERING
    assert gate.dial_failed(now=10.0 + DIRECT_GRACE_SECONDS - 0.01) is True
    assert gate.dial_failed(now=10.0 + DIRECT_GRACE_SECONDS) is False
    assert gate.state is DirectState.UNAVAILABLE
    assert gate.recovering_since is None


def test_a_dial_during_recovery_reconnects_and_a_later_failure_starts_a_new_grace() -> None:
    gate = DirectGate()
    gate.dialed()
    gate.dial_failed(now=0.0)
    gate.dialed()
    assert gate.state is DirectState.CONNECTED
    assert gate.dial_failed(now=100.0) is True
    assert gate.recovering_since == 100.0


def test_a_reverse_slot_installs_once_and_refuses_a_duplicate() -> None:
    slot = ReverseSlot()
    assert slot.begin_install(current_healthy=False)
    assert slot.state is ReverseState.INSTALLING
    assert not slot.begin_install(current_healthy=False)  # an install is in progress
    slot.installed()
    assert slot.state is ReverseState.CONNECTED
    assert not slot.begin_install(current_healthy=True)  # a healthy connection exists


def test_a_reverse_slot_may_replace_an_unhealthy_connection_or_a_lost_one() -> None:
    slot = ReverseSlot()
    slot.begin_install(current_healthy=False)
    slot.installed()
    assert slot.begin_install(current_healthy=False)  # the old one is no longer healthy
    slot.installed()
    slot.lost()
    assert slot.state is ReverseState.DISCONNECTED
    assert slot.begin_install(current_healthy=False)


def test_a_failed_install_frees_the_slot_and_a_retired_slot_refuses_everything() -> None:
    slot = ReverseSlot()
    slot.begin_install(current_healthy=False)
    slot.install_failed()
    assert slot.state is ReverseState.DISCONNECTED
    slot.retire()
    assert not slot.begin_install(current_healthy=False)
    slot.installed()  # an install that finishes after retirement does not revive it
    assert slot.state is ReverseState.RETIRED
