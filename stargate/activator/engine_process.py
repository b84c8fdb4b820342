"""Starting an engine process that cannot outlive the replica.

A replica killed with SIGKILL (the OOM killer, the kubelet after the grace period, a crash) runs no
cleanup, so engines started by the `process` controller (stargate/activator/process.py) kept
running as orphans, holding their port and, in production, their GPU; the next replica's engine
then failed to start. Linux's parent-death signal closes that gap: each engine asks the kernel,
between fork and exec, to send it SIGTERM when its parent dies (`prctl(PR_SET_PDEATHSIG)`), and
checks that the parent did not die before the request took effect. SIGTERM rather than SIGKILL so
that a multi-process engine still stops its own workers (SIGKILL would orphan them, GPU memory
included).

The kernel ties the parent-death signal to the *thread* that forked, not the process, so the
engine is spawned from the trio thread, which lives as long as the replica; `trio`'s own
`open_process` forks from a worker thread that exits when idle, which would deliver the signal
within seconds of a healthy start. The fork is synchronous (a few milliseconds, once per engine
start) and the exit is awaited through a pidfd, as trio does.

Elsewhere (not Linux) the engine is started the same way without the signal.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

import trio

__all__ = ["EngineProcess", "spawn_engine"]

_PR_SET_PDEATHSIG = 1


def _parent_death_hook() -> Callable[[], None] | None:
    """The `preexec_fn` that asks for SIGTERM on the parent's death, or None off Linux.

    `prctl` is resolved here, in the parent, so the child between fork and exec only calls a
    function pointer (no import, no allocation that could need a lock another thread held)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


class EngineProcess:
    """A started engine: its `pid`, its `returncode` once reaped, and `wait()`."""

    __slots__ = ("_pidfd", "_popen")

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(popen.pid)
            except OSError:  # an old kernel: poll instead
                self._pidfd = None

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        """Wait for the process to exit and reap it; its exit status (negative: killed by that
        signal). Cancellable; the process is left as it is."""
        while (code := self._popen.poll()) is None:
            if self._pidfd is not None:
                await trio.lowlevel.wait_readable(self._pidfd)
            else:
                await trio.sleep(0.05)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return code


def spawn_engine(argv: Sequence[str]) -> EngineProcess:
    """Start `argv` in its own session (so signals reach its whole process group), stdin from
    /dev/null, stdout and stderr inherited, dying with the replica (see the module docstring).
    Call it from the trio thread."""
    popen = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_parent_death_hook(),
    )
    return EngineProcess(popen)
