"""`stargate pylon --kv-events-endpoint` wired in: the flags, what each registration stream
sends (a reset first, its chunks back to back, then the changes each heartbeat), and that no
process loads pyzmq or msgpack unless the flag is on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner
from trio.testing import MockClock

from stargate.protocol import stargate_pb2 as pb
from stargate.pylon import cli
from stargate.pylon.config import DialTarget, PylonConfig, PylonConfigError, SideChannelConfig
from stargate.pylon.kv_blocks import DEFAULT_MAX_BLOCKS, KvBlockTracker
from stargate.pylon.sidecar import Pylon
from stargate.pylon.snapshot import ReplicaInfo

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[PylonConfig]:
    """The configs the command would run; nothing starts."""
    configs: list[PylonConfig] = []

    async def main(config: PylonConfig) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(cli, "_main", main)
    monkeypatch.setattr(cli, "configure_logging", lambda *args: None)
    return configs


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(
        cli.pylon_command, ["--upstream", "http://127.0.0.1:9", *args], env=env or {}
    )


def test_the_flags(built: list[PylonConfig]) -> None:
    assert invoke().exit_code == 0
    assert invoke("--kv-events-endpoint", "tcp://[::1]:5557").exit_code == 0
    env = {
        "STARGATE_PYLON_KV_EVENTS_ENDPOINT": "tcp://engine-0:5557",
        "STARGATE_PYLON_KV_EVENTS_MAX_BLOCKS": "10",
    }
    assert invoke(env=env).exit_code == 0
    off, flag, environment = (config.side_channels for config in built)
    assert (off.kv_events_endpoint, off.kv_events_max_blocks) == (None, DEFAULT_MAX_BLOCKS)
    assert flag.kv_events_endpoint == "tcp://[::1]:5557"
    assert (environment.kv_events_endpoint, environment.kv_events_max_blocks) == (
        "tcp://engine-0:5557",
        10,
    )


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--kv-events-endpoint", "127.0.0.1:5557"),
        ("--kv-events-endpoint", "tcp://127.0.0.1"),
        ("--kv-events-endpoint", "tcp://*:5557"),  # a subscriber connects to a host
        ("--kv-events-max-blocks", "0"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    built: list[PylonConfig], flag: str, value: str
) -> None:
    result = invoke(flag, value)
    assert result.exit_code == 2, result.output
    assert flag in result.output
    assert built == []


def test_the_config_checks_too() -> None:
    with pytest.raises(PylonConfigError, match="--kv-events-endpoint"):
        SideChannelConfig(kv_events_endpoint="udp://x:1")
    with pytest.raises(PylonConfigError, match="--kv-events-max-blocks"):
        SideChannelConfig(kv_events_max_blocks=0)
    assert SideChannelConfig(kv_events_endpoint=" tcp://127.0.0.1:1").kv_events_endpoint == (
        "tcp://127.0.0.1:1"
    )


class Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[float, pb.InferenceServerRegistration]] = []

    def put(self, message: pb.InferenceServerRegistration) -> None:
        self.sent.append((trio.current_time(), message))


def pylon(**channels: Any) -> Pylon:
    config = PylonConfig(
        "http://127.0.0.1:9",
        model_names=("m",),
        side_channels=SideChannelConfig(**channels),
    )
    subject = Pylon(config)
    subject.stats.set_models(["m"])
    subject.admitted.add("m")
    subject.healthy = True
    return subject


REPLICA = ReplicaInfo("127.0.0.1:50071", DialTarget("127.0.0.1:50071"))


async def test_each_stream_sends_a_reset_in_chunks_then_the_changes(
    autojump_clock: MockClock,
) -> None:
    subject = pylon(kv_events_endpoint="tcp://127.0.0.1:5557")
    assert subject.kv_blocks is not None
    tracker = subject.kv_blocks = KvBlockTracker(max_per_message=2)
    tracker.store([1, 2, 3, 4, 5])
    outbox = Outbox()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(subject._send_snapshots, outbox, REPLICA)  # type: ignore[arg-type]
        await trio.sleep(0.5)
        # The reset and its chunks at once, without waiting for a heartbeat.
        assert [at for at, _ in outbox.sent] == [0.0, 0.0, 0.0]
        first, second, third = (message for _, message in outbox.sent)
        assert first.kv_blocks_reset and list(first.kv_blocks_added) == [1, 2]
        assert not second.kv_blocks_reset and list(second.kv_blocks_added) == [3, 4]
        assert list(third.kv_blocks_added) == [5]
        assert all(len(message.models) == 1 for message in (first, second, third))
        tracker.store([6])
        tracker.remove([1])
        await trio.sleep(1.0)  # the next heartbeat carries the changes
        _, fourth = outbox.sent[-1]
        assert list(fourth.kv_blocks_added) == [6] and list(fourth.kv_blocks_removed) == [1]
        await trio.sleep(1.0)
        _, fifth = outbox.sent[-1]
        assert not (fifth.kv_blocks_reset or fifth.kv_blocks_added or fifth.kv_blocks_removed)
        # A new stream (a reconnection) starts over with a reset.
        again = Outbox()
        nursery.start_soon(subject._send_snapshots, again, REPLICA)  # type: ignore[arg-type]
        await trio.sleep(0.1)
        assert again.sent[0][1].kv_blocks_reset
        nursery.cancel_scope.cancel()


async def test_without_the_flag_messages_carry_no_kv_fields(autojump_clock: MockClock) -> None:
    subject = pylon()
    assert subject.kv_blocks is None
    outbox = Outbox()
    with trio.move_on_after(1.5):
        await subject._send_snapshots(outbox, REPLICA)  # type: ignore[arg-type]
    assert len(outbox.sent) == 2
    for _, message in outbox.sent:
        assert message == subject.registration(REPLICA)


def test_only_the_flag_loads_pyzmq_and_msgpack() -> None:
    program = (
        "import sys\n"
        "import stargate.cli, stargate.runtime, stargate.control_plane.registration\n"
        "from stargate.mock.app import MockBackend, MockBackendConfig\n"
        "from stargate.mock.kv_events import KvEventsConfig\n"
        "from stargate.pylon.config import PylonConfig, SideChannelConfig\n"
        "from stargate.pylon.sidecar import Pylon\n"
        "MockBackend(MockBackendConfig(prefix_cache_blocks=4))\n"
        "MockBackend(MockBackendConfig(kv_events=KvEventsConfig('tcp://127.0.0.1:1')))\n"
        "Pylon(PylonConfig('http://127.0.0.1:9'))\n"
        "channels = SideChannelConfig(kv_events_endpoint='tcp://127.0.0.1:1')\n"
        "Pylon(PylonConfig('http://127.0.0.1:9', side_channels=channels))\n"
        "print(sorted(m for m in ('zmq', 'msgpack') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, check=True, cwd=ROOT)
    assert out.stdout == b"[]\n"
