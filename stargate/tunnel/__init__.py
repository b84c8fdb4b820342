"""QUIC tunnels between a replica and its Pylons: the Rust Stargate's parity transport.

docs/tunnels.md. A request travels on one fresh bidirectional QUIC stream; the replica is the
one who opens it in both directions of connectivity (direct: the replica dialed the Pylon;
reverse: the Pylon dialed the replica's UDP listener and the replica opens server-initiated
streams). Laid out like httpcore, protocol machines first, I/O last:

* `codec.py`: the Cap'n Proto messages of `quic.capnp` (headers, body, trailers, handshake, its
  ack), a streaming reader, and the per-direction grammar (one head, bodies, optional trailers,
  FIN). Pure.
* `stream.py`: `TunnelStream`, the byte-stream contract every exchange is written against (the
  QUIC driver implements it; tests use an in-memory pair).
* `quic/`: a trio driver over aioquic's sans-IO `QuicConnection`: endpoints, datagram
  demultiplexing, timers, streams with bounded buffers, resets; and the TLS configurations.
* `raw_quic.py`, `http3.py`: the two request exchanges, replica (client) and Pylon (server) side.
* `handshake.py`: the reverse handshake (Pylon's `Handshake`, replica's ack or NACK).
"""
