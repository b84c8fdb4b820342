"""A replica's TLS identity: a certificate chain and its private key, validated as a pair.

`parse_identity` is the whole validation, on bytes already read (docs/tls.md): the certificate
file holds at least one PEM certificate (the first is the one served, any others its chain), the
key file holds one unencrypted PEM private key, the key is the certificate's, and OpenSSL itself
accepts the pair (`ssl.SSLContext.load_cert_chain` on a scratch context, so what is installed in
the live context later has already loaded once). It returns the certificate's notAfter as a unix
timestamp, which readiness and the expiry gauge need.

The decisions the reload loop makes (`is_expired`, `should_attempt`) are pure functions of values
passed in, so they are tested without files, clocks or sockets. Nothing here ever puts key
material into an error message or a log line: errors name the file and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

__all__ = [
    "ALPN_PROTOCOLS",
    "Identity",
    "IdentityError",
    "PairDigest",
    "digest_pair",
    "is_expired",
    "load_identity",
    "load_into",
    "new_server_context",
    "parse_identity",
    "read_pair",
    "should_attempt",
]

ALPN_PROTOCOLS = ("h2", "http/1.1")
"""HTTP/2 first: gRPC clients need it, and HTTP clients that offer both get it."""

# Hypercorn's own TLS ciphers for TLS 1.2 (RFC 7540 §9.2.2 forbids the rest for HTTP/2); TLS 1.3
# suites are not affected by `set_ciphers`.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"

PairDigest = str
"""A SHA-256 over the certificate file's bytes and the key file's bytes: "did they change?"."""


class IdentityError(ValueError):
    """The pair cannot be served; `path` is the file at fault (the message says what is wrong)."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Identity:
    """A validated certificate chain and key, with what the replica reports about them.

    `repr` leaves the PEM bytes out, so an identity in a log line or a traceback never shows the
    key.
    """

    cert_pem: bytes
    key_pem: bytes
    not_after: float
    """The served certificate's notAfter, seconds since the epoch (UTC)."""
    serial_number: int
    subject: str
    digest: PairDigest

    def __repr__(self) -> str:
        return (
            f"Identity(subject={self.subject!r}, serial_number={self.serial_number:#x}, "
            f"not_after={self.not_after})"
        )


def new_server_context() -> ssl.SSLContext:
    """A server-side context without an identity: TLS >= 1.2 (RFC 7540 §9.2), no compression
    (RFC 7540 §9.2.1), ALPN h2 then http/1.1, no client certificates."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION
    context.set_ciphers(TLS12_CIPHERS)
    context.set_alpn_protocols(list(ALPN_PROTOCOLS))
    context.verify_mode = ssl.CERT_NONE
    return context


def digest_pair(cert_pem: bytes, key_pem: bytes) -> PairDigest:
    """The pair's content fingerprint (both files, length-prefixed so no two splits collide)."""
    sha = hashlib.sha256()
    for part in (cert_pem, key_pem):
        sha.update(len(part).to_bytes(8, "big"))
        sha.update(part)
    return sha.hexdigest()


def read_pair(cert_path: Path, key_path: Path) -> tuple[bytes, bytes]:
    """Both files' bytes; an unreadable file raises `IdentityError` naming it."""
    return _read(cert_path), _read(key_path)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise IdentityError(path, f"cannot be read: {error.strerror or error}") from None


def parse_identity(cert_pem: bytes, key_pem: bytes, cert_path: Path, key_path: Path) -> Identity:
    """Validate the pair fully (module docstring) or raise `IdentityError` naming the file at
    fault. The paths only name the files in errors; nothing is read from them."""
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise IdentityError(cert_path, "is not a PEM certificate (chain)") from None
    leaf = chain[0]
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise IdentityError(
            key_path, "holds an encrypted private key; it must be unencrypted"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise IdentityError(key_path, "is not a PEM private key") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    try:
        matches = key.public_key().public_bytes(*spki) == leaf.public_key().public_bytes(*spki)
    except (ValueError, UnsupportedAlgorithm):
        matches = False
    if not matches:
        raise IdentityError(key_path, f"is not the private key of the certificate in {cert_path}")
    try:
        load_into(new_server_context(), cert_pem, key_pem)
    except ssl.SSLError as error:
        raise IdentityError(
            cert_path, f"is refused by OpenSSL with its key: {error.reason}"
        ) from None
    return Identity(
        cert_pem=cert_pem,
        key_pem=key_pem,
        not_after=leaf.not_valid_after_utc.timestamp(),
        serial_number=leaf.serial_number,
        subject=leaf.subject.rfc4514_string(),
        digest=digest_pair(cert_pem, key_pem),
    )


def load_identity(cert_path: Path, key_path: Path) -> Identity:
    """Read and validate the pair (blocking file I/O of two small files)."""
    cert_pem, key_pem = read_pair(cert_path, key_path)
    return parse_identity(cert_pem, key_pem, cert_path, key_path)


def load_into(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """`context.load_cert_chain` from bytes: exactly the bytes validated, never a re-read of the
    operator's files (they may have changed again in between).

    OpenSSL loads a chain only from a file, so the bytes are handed over through an anonymous
    in-memory file where the platform has one (Linux `memfd_create`), else through a private
    temporary directory removed at once.
    """
    with _as_file(cert_pem) as cert_file, _as_file(key_pem) as key_file:
        context.load_cert_chain(cert_file, key_file)


@contextlib.contextmanager
def _as_file(data: bytes) -> Iterator[str]:
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        fd = memfd_create("stargate-tls", 0)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="stargate-tls-") as directory:  # mode 0700
        path = Path(directory) / "pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        yield str(path)


def is_expired(not_after: float, now: float) -> bool:
    """Whether a certificate with this notAfter is expired at `now` (unix seconds): strictly
    after notAfter, as X.509 validity includes its last second (RFC 5280 §4.1.2.5)."""
    return now > not_after


def should_attempt(current: PairDigest, served: PairDigest, attempted: PairDigest | None) -> bool:
    """Whether the files' content `current` is worth a reload: it is not what is served, and not
    what the last attempt already rejected (a bad pair is reported once, not every poll)."""
    return current != served and current != attempted
