# The Rust Stargate's `quic.capnp` (its protocol crate), the wire schema of the QUIC tunnels.
# Kept verbatim (comments aside): `codec.py` encodes and decodes these messages by hand and loads
# this file with pycapnp only for messages its hand decoder leaves alone, and the tests build
# reference messages from it.
@0xcccc1d2d6dc1a2ac;

struct Message {
    union {
        headers  @0 :Map(Text, Text);
        body @1 :Body;
        trailers @2 :Map(Text, Text);
    }
}

struct Body {
    content @0 :Data;
}

struct Map(Key, Value) {
  entries @0 :List(Entry);
  struct Entry {
    key @0 :Key;
    value @1 :Value;
  }
}

struct Handshake {
    inferenceServerId @0 :Text;
    authToken         @1 :Text;
}

struct HandshakeAck {
    accepted @0 :Bool;
    reason   @1 :Text;
}
