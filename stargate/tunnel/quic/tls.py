"""QUIC TLS configurations for the tunnels (docs/tunnels.md, "QUIC and TLS").

Transport parameters follow quinn 0.11's defaults, which is what the Rust peers use: a 30 s idle
timeout, 100 concurrent bidirectional and unidirectional streams, a 1 250 000-byte per-stream
receive window. ALPN is either none at all (raw-QUIC: `ALPN_RAW_QUIC`) or `["h3"]` (HTTP/3 and
WebTransport: `ALPN_HTTP3`); aioquic then fails a handshake whose two sides disagree, which is the
only way a protocol mismatch shows up.

Servers present the operator's PEM pair, or a freshly generated self-signed certificate (EC
P-256, DNS SANs `localhost` and `stargate`, no CA constraint: what rcgen makes on the Rust side).
Clients either skip verification (`--quic-insecure`) or trust exactly the certificates of one PEM
bundle, each of which becomes a root (a self-signed leaf may be its own root). Every function is
pure apart from key generation; nothing here logs or puts key material into an error.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass

from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = [
    "ALPN_HTTP3",
    "ALPN_RAW_QUIC",
    "IDLE_TIMEOUT",
    "MAX_STREAMS",
    "STREAM_RECEIVE_WINDOW",
    "TunnelConfiguration",
    "client_configuration",
    "derive_sni",
    "generate_self_signed",
    "server_configuration",
]

ALPN_RAW_QUIC: list[str] | None = None
"""raw-QUIC negotiates no ALPN at all (an empty list on the Rust side)."""
ALPN_HTTP3: list[str] = ["h3"]
"""HTTP/3 and WebTransport tunnels."""

IDLE_TIMEOUT = 30.0
"""quinn's default max_idle_timeout, seconds; the effective one is the smaller of both peers'."""
MAX_STREAMS = 100
"""quinn's default initial_max_streams_bidi and _uni (concurrent streams the peer may open)."""
STREAM_RECEIVE_WINDOW = 1_250_000
"""quinn's default per-stream receive window, bytes: at most this much received-but-unread data
per stream (the driver grants credit only for what the application consumed)."""
CONNECTION_RECEIVE_WINDOW = 16 * 1024 * 1024
"""aioquic's initial connection window (it doubles it as data arrives; quinn's is unlimited)."""

SERVER_NAME = "stargate"
"""The name a Rust Stargate always dials with, and what IP literals and `localhost` become."""
SELF_SIGNED_NAMES = ("localhost", "stargate")


@dataclass
class TunnelConfiguration(QuicConfiguration):
    """aioquic's configuration plus the stream limits aioquic does not make configurable (it
    hard-codes 128); the driver applies them before the transport parameters are sent."""

    max_streams_bidi: int = MAX_STREAMS
    max_streams_uni: int = MAX_STREAMS


def _base(*, is_client: bool, alpn: list[str] | None) -> TunnelConfiguration:
    return TunnelConfiguration(
        is_client=is_client,
        alpn_protocols=list(alpn) if alpn is not None else None,
        idle_timeout=IDLE_TIMEOUT,
        max_stream_data=STREAM_RECEIVE_WINDOW,
        max_data=CONNECTION_RECEIVE_WINDOW,
    )


def server_configuration(
    cert_pem: bytes | None, key_pem: bytes | None, *, alpn: list[str] | None
) -> TunnelConfiguration:
    """A server configuration presenting the PEM pair (the first certificate is served, the
    others are its chain), or a freshly generated self-signed identity when both are None.

    Raises ValueError when only one of the pair is given, when either does not parse, or when the
    key is not the certificate's (the message never contains key material).
    """
    if (cert_pem is None) != (key_pem is None):
        raise ValueError("a QUIC server identity needs both a certificate and a key, or neither")
    if cert_pem is None or key_pem is None:
        cert_pem, key_pem = generate_self_signed()
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise ValueError("the QUIC server certificate is not a PEM certificate (chain)") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (TypeError, ValueError):
        raise ValueError("the QUIC server key is not an unencrypted PEM private key") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != chain[0].public_key().public_bytes(*spki):
        raise ValueError("the QUIC server key is not the private key of its certificate")
    configuration = _base(is_client=False, alpn=alpn)
    configuration.certificate = chain[0]
    configuration.certificate_chain = chain[1:]
    configuration.private_key = key
    return configuration


def client_configuration(
    *, insecure: bool, trust_pem: bytes | None, server_name: str, alpn: list[str] | None
) -> TunnelConfiguration:
    """A client configuration dialing `server_name` (sent as SNI unless it is an IP literal).

    `insecure` skips certificate verification altogether (`--quic-insecure`); otherwise every
    certificate in `trust_pem` is a root and nothing else is trusted (not the system store).
    Raises ValueError without a bundle when not insecure ("TLS cert required when --quic-insecure
    is not set") and for a bundle holding no certificate.
    """
    configuration = _base(is_client=True, alpn=alpn)
    configuration.server_name = server_name
    if insecure:
        configuration.verify_mode = ssl.CERT_NONE
        return configuration
    if trust_pem is None:
        raise ValueError("TLS cert required when --quic-insecure is not set")
    try:
        roots = x509.load_pem_x509_certificates(trust_pem)
    except ValueError:
        raise ValueError("the QUIC trust bundle holds no PEM certificate") from None
    configuration.verify_mode = ssl.CERT_REQUIRED
    # Re-encoded: aioquic splits the bundle on "-----END CERTIFICATE-----\n" exactly.
    configuration.cadata = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in roots)
    return configuration


def derive_sni(host: str) -> str:
    """The server name a dialer uses for `host` (a host, or `host:port`, or `[v6]:port`): IP
    literals and `localhost` become `"stargate"`, any other DNS name is itself.

    `pod-a.stargate.external:50072` -> `pod-a.stargate.external`; `10.0.0.1:50072`,
    `localhost:50072`, `[::1]:50072` -> `stargate`.
    """
    name = host.strip()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    name = name.rstrip(".")
    if name.lower() == "localhost":
        return SERVER_NAME
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return name
    return SERVER_NAME


def generate_self_signed() -> tuple[bytes, bytes]:
    """A fresh self-signed certificate and its key as PEM (certificate, PKCS#8 key): EC P-256,
    DNS SANs `localhost` and `stargate`, no basic-constraints extension, valid 1975-4096 (rcgen's
    defaults, so Rust clients trusting it as a root accept it as the leaf too)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(1975, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(4096, 1, 1, tzinfo=datetime.UTC))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in SELF_SIGNED_NAMES]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return (
        certificate.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
