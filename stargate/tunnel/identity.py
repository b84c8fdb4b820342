"""The QUIC TLS identity of a tunnel server, and the certificates a tunnel client trusts.

docs/tunnels.md, "TLS". The Rust rules: a server (a direct Pylon, the replica's reverse listener)
presents the `--tls-cert-path`/`--tls-key-path` pair, or a self-signed certificate generated at
start-up (SANs `localhost` and `stargate`); a client trusts exactly the certificates in
`--tls-cert-path`, or nothing is checked (`--quic-insecure`). A mounted pair is re-read every
reload interval: a changed, valid pair applies to new connections, an invalid one is refused
(ERROR, once per content) and the last good one kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import trio
from aioquic.quic.configuration import QuicConfiguration

from stargate.tunnel.quic.tls import generate_self_signed, server_configuration

__all__ = ["QuicIdentity"]

log = logging.getLogger("stargate.tunnel")


class QuicIdentity:
    """The pair served to new connections (`server_configuration`), reloadable."""

    def __init__(
        self,
        cert_path: Path | None,
        key_path: Path | None,
        on_reload: Callable[[str], None] = lambda result: None,
        on_served: Callable[[float], None] = lambda not_after: None,
    ) -> None:
        """`on_reload("success" | "rejected")` after each changed pair; `on_served(not_after)`
        (unix seconds) whenever a mounted pair starts being served."""
        self._cert_path = cert_path
        self._key_path = key_path
        self._on_reload = on_reload
        self._on_served = on_served
        self._pair: tuple[bytes, bytes] | None = None
        self._rejected: tuple[bytes, bytes] | None = None
        if cert_path is not None and key_path is not None:
            pair = (cert_path.read_bytes(), key_path.read_bytes())
            server_configuration(*pair, alpn=None)  # refuse an unusable pair at start-up
            self._pair = pair
            on_served(_not_after(pair[0]))

    def trust_pem(self) -> bytes | None:
        """The certificates a client dialing out trusts: the `--tls-cert-path` file."""
        if self._cert_path is None:
            return None
        return self._pair[0] if self._pair is not None else self._cert_path.read_bytes()

    def server_configuration(self, alpn: list[str] | None) -> QuicConfiguration:
        """A configuration for one new server connection, with the current pair."""
        if self._pair is None:
            self._pair = generate_self_signed()
        return server_configuration(*self._pair, alpn=alpn)

    def poll(self) -> None:
        """Re-read the mounted pair; apply it if it changed and is valid."""
        if self._cert_path is None or self._key_path is None:
            return
        try:
            pair = (self._cert_path.read_bytes(), self._key_path.read_bytes())
        except OSError as error:
            log.error("cannot re-read the QUIC TLS pair: %s", error)
            return
        if pair == self._pair or pair == self._rejected:
            return
        try:
            server_configuration(*pair, alpn=None)
        except Exception as error:
            self._rejected = pair
            log.error("refused the changed QUIC TLS pair (the last good one stays): %s", error)
            self._on_reload("rejected")
            return
        self._pair = pair
        log.info("QUIC TLS identity reloaded; new connections use it")
        self._on_reload("success")
        self._on_served(_not_after(pair[0]))

    async def reload_every(self, interval_ms: int) -> None:
        while True:
            await trio.sleep(interval_ms / 1000)
            self.poll()


def _not_after(cert_pem: bytes) -> float:
    """The first certificate's notAfter, in unix seconds."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc.timestamp()
