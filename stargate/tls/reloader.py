"""The identity a replica serves, and the task that reloads it (docs/tls.md).

One `ssl.SSLContext` is shared by every TLS listener. `ServedIdentity.load` builds it from the
configured pair at start-up, where a pair that cannot be served is a `StartupError` naming the
flag and the file. `run` then polls the two files every `--tls-reload-interval-ms`: when their
content changed and the new pair passes `parse_identity` (and is not already expired), it is
loaded into the live context, which OpenSSL uses for every handshake from then on; connections
already established keep the identity they were set up with. A pair that fails is logged at
ERROR, once per distinct content, and the last good identity stays served.

The expiry readiness and the metrics follow the served identity through `on_served` and
`TlsMetrics`; this module knows neither readiness nor HTTP.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from datetime import UTC, datetime

import trio

from stargate.config import TlsConfig
from stargate.metrics import TlsMetrics
from stargate.serving import StartupError
from stargate.tls.identity import (
    Identity,
    IdentityError,
    PairDigest,
    digest_pair,
    is_expired,
    load_identity,
    load_into,
    new_server_context,
    parse_identity,
    read_pair,
    should_attempt,
)

__all__ = ["MATERIAL_TYPE", "ServedIdentity", "format_unix_time"]

log = logging.getLogger(__name__)

MATERIAL_TYPE = "server_identity"
"""The `material_type` label of the TLS series: the replica's own certificate and key."""

_FLAGS = {"cert": "--tls-cert-path", "key": "--tls-key-path"}


def format_unix_time(seconds: float) -> str:
    """A notAfter for people: ISO 8601 in UTC."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ServedIdentity:
    """The live server context and the identity it holds.

    `wall_clock` gives unix time (tests pass a fake); the poll interval runs on trio's clock.
    `on_served` is called with each identity served, the start-up one included.
    """

    def __init__(
        self,
        config: TlsConfig,
        identity: Identity,
        *,
        metrics: TlsMetrics | None = None,
        on_served: Callable[[Identity], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.context: ssl.SSLContext = new_server_context()
        load_into(self.context, identity.cert_pem, identity.key_pem)
        self.identity = identity
        self._metrics = metrics
        self._on_served = on_served
        self._wall_clock = wall_clock
        self._attempted: PairDigest | None = None
        if metrics is not None:
            for result in ("success", "rejected"):
                metrics.reloads.labels(material_type=MATERIAL_TYPE, result=result)
        self._publish()

    @classmethod
    def load(
        cls,
        config: TlsConfig,
        *,
        metrics: TlsMetrics | None = None,
        on_served: Callable[[Identity], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> ServedIdentity:
        """Load the configured pair for start-up, or raise `StartupError` naming the flag and
        the file at fault. An expired certificate is served (readiness reports it, docs/tls.md)."""
        try:
            identity = load_identity(config.cert_path, config.key_path)
        except IdentityError as error:
            raise StartupError(f"invalid TLS identity: {_flag(config, error)} {error}") from None
        served = cls(config, identity, metrics=metrics, on_served=on_served, wall_clock=wall_clock)
        expired = is_expired(identity.not_after, wall_clock())
        log.log(
            logging.WARNING if expired else logging.INFO,
            "serving TLS identity %s (serial %#x, notAfter %s%s) from %s",
            identity.subject,
            identity.serial_number,
            format_unix_time(identity.not_after),
            ", already expired: /readyz answers 503" if expired else "",
            config.cert_path,
        )
        return served

    async def run(self) -> None:
        """Poll the files every reload interval, forever (cancel to stop)."""
        while True:
            await trio.sleep(self.config.reload_interval_seconds)
            self.poll()

    def poll(self) -> bool:
        """One look at the files: reload them if they changed; whether a new identity is served.

        Synchronous, on the trio thread, on purpose: reading two small files (a mounted Secret)
        takes microseconds, and the parse a changed pair needs about a millisecond, once per
        change; the live context must be changed on this thread anyway, between handshakes.
        It also keeps the loop deterministic on trio's clock (tests use `MockClock`).
        """
        config = self.config
        try:
            cert_pem, key_pem = read_pair(config.cert_path, config.key_path)
        except IdentityError as error:
            self._reject(f"unreadable:{error}", error)
            return False
        current = digest_pair(cert_pem, key_pem)
        if not should_attempt(current, self.identity.digest, self._attempted):
            if current == self.identity.digest:
                self._attempted = None  # back to what is served: a new bad pair is news again
            return False
        try:
            identity = parse_identity(cert_pem, key_pem, config.cert_path, config.key_path)
        except IdentityError as error:
            self._reject(current, error)
            return False
        if is_expired(identity.not_after, self._wall_clock()):
            problem = f"holds a certificate that expired at {format_unix_time(identity.not_after)}"
            self._reject(current, IdentityError(config.cert_path, problem))
            return False
        try:
            load_into(self.context, identity.cert_pem, identity.key_pem)
        except ssl.SSLError as error:  # validated on a scratch context; not expected
            self._reject(current, IdentityError(config.cert_path, f"refused: {error.reason}"))
            return False
        previous, self.identity = self.identity, identity
        self._attempted = None
        if self._metrics is not None:
            self._metrics.reloads.labels(material_type=MATERIAL_TYPE, result="success").inc()
        self._publish()
        log.info(
            "reloaded TLS identity from %s: %s serial %#x notAfter %s (was serial %#x notAfter "
            "%s); new handshakes use it",
            config.cert_path,
            identity.subject,
            identity.serial_number,
            format_unix_time(identity.not_after),
            previous.serial_number,
            format_unix_time(previous.not_after),
        )
        return True

    def _reject(self, attempted: PairDigest, error: IdentityError) -> None:
        if attempted == self._attempted:
            return  # already reported
        self._attempted = attempted
        if self._metrics is not None:
            self._metrics.reloads.labels(material_type=MATERIAL_TYPE, result="rejected").inc()
        log.error(
            "rejected the TLS identity on reload: %s %s; still serving serial %#x (notAfter %s)",
            _flag(self.config, error),
            error,
            self.identity.serial_number,
            format_unix_time(self.identity.not_after),
        )

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.certificate_expiry.labels(material_type=MATERIAL_TYPE).set(
                self.identity.not_after
            )
        if self._on_served is not None:
            self._on_served(self.identity)


def _flag(config: TlsConfig, error: IdentityError) -> str:
    return _FLAGS["key"] if error.path == config.key_path else _FLAGS["cert"]
