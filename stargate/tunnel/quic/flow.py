"""aioquic's `QuicConnection` with receive credit tied to what the application consumed.

aioquic doubles a stream's receive window whenever the peer has sent half of it, whether or not
anything was read, so a peer can fill memory without bound. `FlowQuic` replaces that rule
(`_write_stream_limits`, called for every stream each time packets are built) with quinn's: a
stream's limit is `consumed + window`, where `window` is the configuration's `max_stream_data`,
and it is raised (MAX_STREAM_DATA) only once half a window has been consumed since the last raise.
So at most one window of received-but-unread data exists per stream.

What "consumed" means per stream:

* a stream listed in `consumed` (the driver's own streams, and peer streams not yet accepted):
  the bytes the application has taken out of the driver (`QuicStream.receive`); the driver adds
  to it and calls `credit_due` to know whether to transmit at once;
* any other stream (those handed to an `event_handler`): everything aioquic delivered in order,
  i.e. credit follows delivery, one window ahead (the handler consumes synchronously).

It also applies `TunnelConfiguration`'s stream limits, which aioquic hard-codes to 128. The
overridden method and the attributes read are aioquic 1.7 internals (pinned by its version).
"""

from __future__ import annotations

from typing import Any

from aioquic.quic.connection import MAX_STREAM_DATA_FRAME_CAPACITY
from aioquic.quic.connection import QuicConnection as AioQuicConnection
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream as AioQuicStream

from .tls import TunnelConfiguration

__all__ = ["FlowQuic"]


class FlowQuic(AioQuicConnection):
    """An aioquic connection whose per-stream receive credit follows consumption (module doc)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        configuration = self.configuration
        self.stream_window: int = configuration.max_stream_data
        self.consumed: dict[int, int] = {}
        """Stream id -> bytes the application consumed, for streams whose credit it drives."""
        if isinstance(configuration, TunnelConfiguration):
            # Before any transport parameter is serialized; `sent` too, or aioquic would think an
            # update of the peer's limit is pending forever (its batching compares the two).
            for limit, value in (
                (self._local_max_streams_bidi, configuration.max_streams_bidi),
                (self._local_max_streams_uni, configuration.max_streams_uni),
            ):
                limit.value = limit.sent = value

    def credit_due(self, stream_id: int) -> bool:
        """Whether the stream's limit would be raised by the next packet (so transmit now)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.receiver.is_finished or not stream.max_stream_data_local:
            return False
        return self._credit_target(stream) - stream.max_stream_data_local >= self._threshold()

    def stream_receive_limit(self, stream_id: int) -> int | None:
        """The receive limit currently granted on a stream (None once aioquic forgot it)."""
        stream = self._streams.get(stream_id)
        return None if stream is None else stream.max_stream_data_local

    def _threshold(self) -> int:
        return max(1, self.stream_window // 2)

    def _credit_target(self, stream: AioQuicStream) -> int:
        assert stream.stream_id is not None
        consumed = self.consumed.get(stream.stream_id)
        if consumed is None:
            consumed = stream.receiver.starting_offset()
        return consumed + self.stream_window

    def _write_stream_limits(
        self, builder: QuicPacketBuilder, space: QuicPacketSpace, stream: AioQuicStream
    ) -> None:
        stream_id = stream.stream_id
        # Zero only for our own unidirectional streams, which receive nothing.
        if stream_id is None or not stream.max_stream_data_local:
            return
        if not stream.receiver.is_finished:
            target = self._credit_target(stream)
            if target - stream.max_stream_data_local >= self._threshold():
                stream.max_stream_data_local = target
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=self._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            buf.push_uint_var(stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local
            frames = builder.quic_logger_frames
            if self._quic_logger is not None and frames is not None:
                frames.append(
                    self._quic_logger.encode_max_stream_data_frame(
                        maximum=stream.max_stream_data_local, stream_id=stream_id
                    )
                )
