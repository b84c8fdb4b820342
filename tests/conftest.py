"""Shared helpers for tests that start real `stargate` processes on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    """A loopback port that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class StargateProcess:
    """A `stargate` subprocess with its log captured to a file."""

    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def start_stargate(tmp_path: Path) -> Iterator[object]:
    """Start `python -m stargate ARGS...`; every process started is killed at teardown."""
    started: list[StargateProcess] = []

    def start(*args: str) -> StargateProcess:
        log_path = tmp_path / f"stargate-{len(started)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "stargate", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        handle = StargateProcess(process, log_path)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        if handle.process.poll() is None:
            handle.process.kill()
            handle.process.wait()
