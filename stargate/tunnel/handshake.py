"""The reverse handshake on the Pylon's first stream (docs/tunnels.md, "Reverse handshake").

The Pylon writes one `Handshake` (its inference server id and, when it has one, its token) and
FINs; the replica answers one `HandshakeAck` and FINs. Each side reads exactly one message and
does not wait for the other's FIN. The replica's checks, in their Rust order, are in
`backends.py` (`TunnelBackends._check_handshake`), since they read its registrations.
"""

from __future__ import annotations

from stargate.tunnel.codec import (
    MessageReader,
    TunnelProtocolError,
    decode_handshake_ack,
    encode_handshake,
)
from stargate.tunnel.stream import TunnelStream

__all__ = ["read_one_message", "send_handshake"]


async def read_one_message(stream: TunnelStream) -> bytes:
    """The first whole message on `stream`; TunnelProtocolError if the stream ends first."""
    reader = MessageReader()
    while (raw := reader.next_message()) is None:
        data = await stream.receive()
        if not data:
            reader.end()
            raise TunnelProtocolError("stream ended before a whole message")
        reader.feed(data)
    return raw


async def send_handshake(
    stream: TunnelStream, inference_server_id: str, token: str | None
) -> tuple[bool, str]:
    """The Pylon's half: send the handshake, return the replica's (accepted, reason)."""
    await stream.send(encode_handshake(inference_server_id, token), end=True)
    return decode_handshake_ack(await read_one_message(stream))
