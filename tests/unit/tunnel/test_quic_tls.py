"""The QUIC tunnels' TLS configurations (stargate/tunnel/quic/tls.py): the generated identity,
the server and client configurations and their errors, SNI derivation, and handshakes over
loopback UDP that pass or fail on ALPN and on certificate trust."""

from __future__ import annotations

import ssl
from collections.abc import Callable

import pytest
import trio
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from stargate.tunnel.quic import (
    ALPN_HTTP3,
    ALPN_RAW_QUIC,
    ConnectFailed,
    QuicConnection,
    client_configuration,
    connect,
    derive_sni,
    generate_self_signed,
    serve,
    server_configuration,
)

IDENTITY = generate_self_signed()
OTHER_IDENTITY = generate_self_signed()


def insecure(
    alpn: list[str] | None = ALPN_RAW_QUIC, server_name: str = "stargate"
) -> QuicConfiguration:
    return client_configuration(insecure=True, trust_pem=None, server_name=server_name, alpn=alpn)


def trusting(pem: bytes, server_name: str = "stargate") -> QuicConfiguration:
    return client_configuration(
        insecure=False, trust_pem=pem, server_name=server_name, alpn=ALPN_RAW_QUIC
    )


async def dial(
    factory: Callable[[], QuicConfiguration], client: QuicConfiguration
) -> tuple[QuicConnection, QuicConnection]:
    """Connect once; return both ends (closed again before returning, state kept). A failed
    dial raises its `ConnectFailed` as itself, not in the nursery's exception group."""
    try:
        with trio.fail_after(5):
            async with serve("127.0.0.1", 0, factory) as listener, trio.open_nursery() as nursery:
                dialed = await connect(nursery, "127.0.0.1", listener.port, client, timeout=3)
                accepted = await listener.connections().receive()
                dialed.close()
                nursery.cancel_scope.cancel()
                return dialed, accepted
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


# SNI.


@pytest.mark.parametrize(
    ("host", "sni"),
    [
        ("pod-a.stargate.external:50072", "pod-a.stargate.external"),
        ("pod-a.stargate.external", "pod-a.stargate.external"),
        ("10.0.0.1:50072", "stargate"),
        ("10.0.0.1", "stargate"),
        ("localhost:50072", "stargate"),
        ("LOCALHOST", "stargate"),
        ("[::1]:50072", "stargate"),
        ("::1", "stargate"),
        ("fe80::1%eth0", "stargate"),
    ],
)
def test_derive_sni(host: str, sni: str) -> None:
    assert derive_sni(host) == sni


# Configurations.


def test_a_server_without_a_pair_presents_a_fresh_self_signed_identity() -> None:
    configuration = server_configuration(None, None, alpn=ALPN_RAW_QUIC)
    certificate = configuration.certificate
    assert isinstance(certificate, x509.Certificate)
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "stargate"]
    with pytest.raises(x509.ExtensionNotFound):
        certificate.extensions.get_extension_for_class(x509.BasicConstraints)
    key = certificate.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    assert key.curve.name == "secp256r1"
    assert configuration.is_client is False
    assert configuration.idle_timeout == 30.0
    assert configuration.alpn_protocols is None
    other = server_configuration(None, None, alpn=ALPN_HTTP3)
    assert other.alpn_protocols == ["h3"]
    assert other.certificate.serial_number != certificate.serial_number


def test_a_server_presents_the_given_pair_with_its_chain() -> None:
    cert_pem, key_pem = IDENTITY
    chain_pem = cert_pem + OTHER_IDENTITY[0]
    configuration = server_configuration(chain_pem, key_pem, alpn=ALPN_RAW_QUIC)
    assert configuration.certificate == x509.load_pem_x509_certificate(cert_pem)
    assert configuration.certificate_chain == [x509.load_pem_x509_certificate(OTHER_IDENTITY[0])]


def test_a_server_pair_must_be_whole_and_match() -> None:
    cert_pem, key_pem = IDENTITY
    with pytest.raises(ValueError, match="both"):
        server_configuration(cert_pem, None, alpn=None)
    with pytest.raises(ValueError, match="both"):
        server_configuration(None, key_pem, alpn=None)
    with pytest.raises(ValueError, match="not the private key") as caught:
        server_configuration(cert_pem, OTHER_IDENTITY[1], alpn=None)
    assert b"PRIVATE" not in str(caught.value).encode()
    with pytest.raises(ValueError, match="not a PEM certificate"):
        server_configuration(b"garbage", key_pem, alpn=None)
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        server_configuration(cert_pem, b"garbage", alpn=None)


def test_a_client_is_insecure_or_trusts_exactly_the_bundle() -> None:
    configuration = insecure(alpn=ALPN_HTTP3)
    assert configuration.verify_mode == ssl.CERT_NONE
    assert (configuration.is_client, configuration.server_name) == (True, "stargate")
    assert configuration.alpn_protocols == ["h3"]
    assert configuration.idle_timeout == 30.0

    bundle = IDENTITY[0] + OTHER_IDENTITY[0]
    trusted = trusting(bundle, server_name="pod-a.example")
    assert trusted.verify_mode == ssl.CERT_REQUIRED
    assert trusted.server_name == "pod-a.example"
    assert trusted.cadata is not None
    assert x509.load_pem_x509_certificates(trusted.cadata) == x509.load_pem_x509_certificates(
        bundle
    )
    assert trusted.cafile is None and trusted.capath is None  # not the system store


def test_a_secure_client_needs_a_bundle_with_a_certificate() -> None:
    with pytest.raises(ValueError, match=r"^TLS cert required when --quic-insecure is not set$"):
        client_configuration(insecure=False, trust_pem=None, server_name="stargate", alpn=None)
    for empty in (b"", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"):
        with pytest.raises(ValueError, match="no PEM certificate"):
            trusting(empty)


def test_the_generated_pem_round_trips() -> None:
    cert_pem, key_pem = IDENTITY
    certificate = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    assert key.public_key().public_bytes(*spki) == certificate.public_key().public_bytes(*spki)
    assert certificate.not_valid_before_utc.year == 1975
    assert certificate.not_valid_after_utc.year == 4096


# Handshakes.


async def test_raw_quic_negotiates_no_alpn_and_http3_negotiates_h3() -> None:
    raw = await dial(lambda: server_configuration(*IDENTITY, alpn=ALPN_RAW_QUIC), insecure())
    assert [c.alpn for c in raw] == [None, None]
    h3 = await dial(
        lambda: server_configuration(*IDENTITY, alpn=ALPN_HTTP3), insecure(alpn=ALPN_HTTP3)
    )
    assert [c.alpn for c in h3] == ["h3", "h3"]


@pytest.mark.parametrize(("server_alpn", "client_alpn"), [(ALPN_HTTP3, None), (None, ALPN_HTTP3)])
async def test_an_alpn_mismatch_fails_the_dial(
    server_alpn: list[str] | None, client_alpn: list[str] | None
) -> None:
    with pytest.raises(ConnectFailed, match=r"TLS handshake failed: No common ALPN protocols"):
        await dial(
            lambda: server_configuration(*IDENTITY, alpn=server_alpn), insecure(alpn=client_alpn)
        )


async def test_a_client_trusting_the_servers_own_pem_connects() -> None:
    client, server = await dial(
        lambda: server_configuration(*IDENTITY, alpn=None), trusting(IDENTITY[0])
    )
    assert client.established and server.established


async def test_a_client_trusting_an_unrelated_certificate_is_refused() -> None:
    with pytest.raises(ConnectFailed, match="TLS handshake failed"):
        await dial(lambda: server_configuration(*IDENTITY, alpn=None), trusting(OTHER_IDENTITY[0]))


async def test_a_trusted_certificate_must_still_name_the_server() -> None:
    with pytest.raises(ConnectFailed, match="doesn't match"):
        await dial(
            lambda: server_configuration(*IDENTITY, alpn=None),
            trusting(IDENTITY[0], server_name="pod-a.example"),
        )


async def test_an_insecure_client_accepts_any_certificate() -> None:
    client, _ = await dial(
        lambda: server_configuration(*OTHER_IDENTITY, alpn=None),
        insecure(server_name="pod-a.example"),
    )
    assert client.established


async def test_a_reloaded_identity_applies_to_new_connections_only() -> None:
    identities = [IDENTITY, OTHER_IDENTITY]
    current = {"pair": identities[0]}

    def factory() -> QuicConfiguration:
        return server_configuration(*current["pair"], alpn=None)

    with trio.fail_after(5):
        async with serve("127.0.0.1", 0, factory) as listener, trio.open_nursery() as nursery:
            first = await connect(
                nursery, "127.0.0.1", listener.port, trusting(IDENTITY[0]), timeout=3
            )
            current["pair"] = identities[1]
            with pytest.raises(ConnectFailed, match="TLS handshake failed"):
                await connect(nursery, "127.0.0.1", listener.port, trusting(IDENTITY[0]), timeout=3)
            second = await connect(
                nursery, "127.0.0.1", listener.port, trusting(OTHER_IDENTITY[0]), timeout=3
            )
            assert first.is_open and second.is_open  # the old connection lives on
            stream = await first.open_stream()
            await stream.send(b"still here", end=True)
            accepted = await (await listener.connections().receive()).accept_stream()
            assert await accepted.receive() == b"still here"
            nursery.cancel_scope.cancel()
