"""Whether a registration's tunnel counts as connected: the two Rust state machines, pure.

docs/tunnels.md, "Connection states". Every state change of a direct registration's connection
set and of a reverse registration's slot happens here (h11 style); `backends.py` does the I/O and
asks these machines what it means.

Direct (`quic://` backends, the replica dials): Initial -> Connected on a successful dial; a failed
dial from Connected -> Recovering (still connected), and within `DIRECT_GRACE_SECONDS` of entering
Recovering still connected; after that, or from Initial or Unavailable, -> Unavailable (the
update is applied without an RTT and not acked; the next update dials again).

Reverse (the Pylon dials the replica): a handshake may install a connection only from
Disconnected, or from Connected when that connection is no longer healthy (Replacing); otherwise
it is a `duplicate connection`. Installing blocks a second handshake for the same registration;
Retired (the registration ended) refuses every later one.
"""

from __future__ import annotations

import enum

__all__ = ["DIRECT_GRACE_SECONDS", "DirectGate", "DirectState", "ReverseSlot", "ReverseState"]

DIRECT_GRACE_SECONDS = 2.0
"""How long a direct registration that was connected stays connected while its dials fail (the
Rust `DIRECT_CONNECTION_UNAVAILABLE_GRACE`)."""


class DirectState(enum.Enum):
    INITIAL = "initial"
    CONNECTED = "connected"
    RECOVERING = "recovering"
    UNAVAILABLE = "unavailable"


class DirectGate:
    """One direct registration's verdict over its dials."""

    __slots__ = ("recovering_since", "state")

    def __init__(self) -> None:
        self.state = DirectState.INITIAL
        self.recovering_since: float | None = None

    def dialed(self) -> None:
        """A whole connection set was dialed (or a healthy one exists)."""
        self.state = DirectState.CONNECTED
        self.recovering_since = None

    def dial_failed(self, now: float) -> bool:
        """A dial failed at `now`; whether the registration still counts as connected."""
        if self.state is DirectState.CONNECTED:
            self.state = DirectState.RECOVERING
            self.recovering_since = now
            return True
        if self.state is DirectState.RECOVERING:
            assert self.recovering_since is not None
            if now - self.recovering_since < DIRECT_GRACE_SECONDS:
                return True
        self.state = DirectState.UNAVAILABLE
        self.recovering_since = None
        return False


class ReverseState(enum.Enum):
    DISCONNECTED = "disconnected"
    CONNECTED = "connected"
    INSTALLING = "installing"
    RETIRED = "retired"


class ReverseSlot:
    """One reverse registration's connection slot."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = ReverseState.DISCONNECTED

    def begin_install(self, current_healthy: bool) -> bool:
        """A handshake wants to install a connection; False means `duplicate connection`."""
        if self.state is ReverseState.DISCONNECTED or (
            self.state is ReverseState.CONNECTED and not current_healthy
        ):
            self.state = ReverseState.INSTALLING
            return True
        return False

    def installed(self) -> None:
        assert self.state in (ReverseState.INSTALLING, ReverseState.RETIRED)
        if self.state is ReverseState.INSTALLING:
            self.state = ReverseState.CONNECTED

    def install_failed(self) -> None:
        if self.state is ReverseState.INSTALLING:
            self.state = ReverseState.DISCONNECTED

    def lost(self) -> None:
        """The installed connection closed."""
        if self.state is ReverseState.CONNECTED:
            self.state = ReverseState.DISCONNECTED

    def retire(self) -> None:
        self.state = ReverseState.RETIRED
