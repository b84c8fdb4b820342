"""How every `stargate` command logs: one line per event, with its fields, and no secret in it.

`configure_logging(level, log_format)` is called once by each command with `--log-level` and
`--log-format` (`stargate serve`, `mock-backend`, `pylon`); everything goes to stderr.

Formats (docs/logging.md):

* `text`: `TIME LEVEL LOGGER: MESSAGE` followed by every structured field as ` key=value`. Fields
  are what a call passes as `extra=` (`log.warning("...", extra={"pool": p})`): the record's
  attributes that are not standard `LogRecord` attributes, in sorted key order. A value that is
  empty or holds white space, a quote, `=`, a backslash or a control character is quoted JSON-style
  (`error="connection reset by peer"`). An exception's traceback follows the line.
* `json`: one JSON object per line: `time` (RFC 3339, UTC, milliseconds), `level`, `logger`,
  `message`, every field, and `exception` (the formatted traceback, one string) when there is one.
  A field that JSON cannot hold is written as its `repr`; formatting never raises. A field named
  like one of those keys is written with a trailing `_` (`time_`).

Field names must not be `LogRecord` attributes (`msg`, `args`, `name`, `message`, `module`,
`filename`...): `logging` refuses those in `extra=`.

Third-party loggers are clamped to WARNING (or the chosen level, if higher) whatever `--log-level`
says, by their level and again by a filter on our handler, because at DEBUG or INFO they print
request or response headers, which carry bearer tokens (a Pylon's registration token, a client's
`authorization`) or cookies. What each logs (read from the installed packages):

* `hpack`: at DEBUG, every header it encodes or decodes, name and value (`Decoded (b'authorization',
  b'Bearer ...')`), and header-table evictions with their values. The replica's HTTP/2 listeners
  (gRPC registrations included) decode every request header with it.
* `h2`: at DEBUG, `Send headers [...]` with every header of a stream, when a logger is passed in
  its `H2Configuration` (Hypercorn and httpcore pass none today; clamped so that cannot change it).
* `h11`: logs nothing today; it holds every HTTP/1.1 header, so a future version must not.
* `hypercorn.access`: the access log, INFO per request; its atoms include every request header
  (`%({authorization}i)s`), and the default format prints the `referer` and `user-agent`. Our
  servers set no access log; clamped so none appears through logging configuration either.
* `httpx`: one INFO line per request (method, full URL with its query string, status) for every
  health probe, Pylon call and demo request; a query string may carry a key.
* `httpcore`: DEBUG traces of every connection and exchange, including
  `receive_response_headers.complete return_value=(..., [(b'set-cookie', ...), ...])`.
* `grpc`: grpcio's Python side: DEBUG/INFO detail of client calls (a failed request iterator's
  traceback, channel set-up); the Pylon's and the worker-auth client's calls carry a bearer token
  in their metadata. Its errors (WARNING and up) still show.
* `quic`: aioquic's connections (the tunnels, docs/tunnels.md): INFO per handshake (version, ALPN)
  and DEBUG per packet; with a `secrets_log_file` it would write TLS keys (we set none). Its
  warnings (a failed handshake: ALPN, certificate) still show.

Our own loggers (`stargate.*`) and Hypercorn's error log (`hypercorn.error`: start-up lines and
failures, no headers) follow `--log-level`. Our own code never logs a header value or a token.

`LoggedError`: an exception raised only to make the server end a response, after its cause was
logged as one line; the server's own traceback for it ("Error in ASGI Framework") is dropped.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, TextIO

__all__ = [
    "CLAMPED_LOGGERS",
    "LOG_FORMATS",
    "JsonFormatter",
    "LoggedError",
    "TextFormatter",
    "configure_logging",
    "record_fields",
    "text_value",
]

LOG_FORMATS: Final = ("text", "json")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CLAMP_LEVEL: Final = logging.WARNING
CLAMPED_LOGGERS: Final = (
    "hpack",
    "h2",
    "h11",
    "hypercorn.access",
    "httpx",
    "httpcore",
    "grpc",
    "quic",
)

# Attributes every LogRecord has (and the two `Formatter.format` adds, and 3.12's taskName):
# anything else on a record was passed as `extra=` and is a field.
_STANDARD_ATTRIBUTES: Final = frozenset(
    {
        *logging.LogRecord("", logging.INFO, "", 0, "", (), None).__dict__,
        "message",
        "asctime",
        "taskName",
    }
)
_JSON_KEYS: Final = frozenset({"time", "level", "logger", "message", "exception", "stack"})
_NEEDS_QUOTES: Final = re.compile(r"[\s\"'=\\\x00-\x1f\x7f]")


class LoggedError(Exception):
    """Raised only to make the server end a response abruptly, after the cause was logged."""


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's structured fields (its `extra=`), sorted by name."""
    return {
        key: value
        for key, value in sorted(record.__dict__.items())
        if key not in _STANDARD_ATTRIBUTES and not key.startswith("_")
    }


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def _safe_str(value: object) -> str:
    try:
        return value if isinstance(value, str) else str(value)
    except Exception:
        return _safe_repr(value)


def text_value(value: object) -> str:
    """One field value as written by the text format: bare, or quoted JSON-style when needed."""
    text = _safe_str(value)
    if not text or _NEEDS_QUOTES.search(text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER: MESSAGE key=value...`, then the traceback if there is one."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = record_fields(record)
        if not fields:
            return line
        return line + "".join(f" {key}={text_value(value)}" for key, value in fields.items())


def _jsonable(value: object) -> object:
    """`value` if JSON can hold it (unknown objects as their repr), else its repr."""
    try:
        json.dumps(value, allow_nan=False, default=_safe_repr)
    except (TypeError, ValueError, RecursionError):
        return _safe_repr(value)
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per record; never raises on a field JSON cannot hold."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        payload: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.message,
        }
        for key, value in record_fields(record).items():
            payload[f"{key}_" if key in _JSON_KEYS else key] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            payload["exception"] = record.exc_text
        if record.stack_info:
            payload["stack"] = self.formatStack(record.stack_info)
        try:
            return json.dumps(payload, allow_nan=False, default=_safe_repr)
        except (TypeError, ValueError, RecursionError):
            safe = {key: _jsonable(value) for key, value in payload.items()}
            return json.dumps(safe, allow_nan=False, default=_safe_repr)


def _clamped(name: str) -> bool:
    return any(name == root or name.startswith(f"{root}.") for root in CLAMPED_LOGGERS)


def _already_logged(error: BaseException | None) -> bool:
    """`error` is a `LoggedError`, or a group of them (beside cancellations, which are not
    `Exception`s): the cause is in the log already."""
    if isinstance(error, LoggedError):
        return True
    if not isinstance(error, BaseExceptionGroup):
        return False
    leaves: list[BaseException] = []
    pending: list[BaseException] = [error]
    while pending:
        item = pending.pop()
        if isinstance(item, BaseExceptionGroup):
            pending.extend(item.exceptions)
        else:
            leaves.append(item)
    logged = [leaf for leaf in leaves if isinstance(leaf, LoggedError)]
    others = [
        leaf for leaf in leaves if isinstance(leaf, Exception) and not isinstance(leaf, LoggedError)
    ]
    return bool(logged) and not others


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to `stream`, or to whatever `sys.stderr` is at the time of each record."""

    def __init__(self, stream: TextIO | None) -> None:
        logging.Handler.__init__(self)
        self._fixed = stream

    @property
    def stream(self) -> TextIO:
        return self._fixed if self._fixed is not None else sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        self._fixed = value

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < CLAMP_LEVEL and _clamped(record.name):
            return False
        if record.exc_info and _already_logged(record.exc_info[1]):
            return False
        return bool(super().filter(record))


_FORMATTERS: Final[Mapping[str, type[logging.Formatter]]] = {
    "text": TextFormatter,
    "json": JsonFormatter,
}


def configure_logging(
    level: str, log_format: str = "text", *, stream: TextIO | None = None
) -> None:
    """Send every log line to stderr (or `stream`) at `level` in `log_format` (`text`, `json`).

    Idempotent: a second call replaces the handler of the first. Clamps the third-party loggers
    of `CLAMPED_LOGGERS` (see the module docstring).
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    if log_format not in _FORMATTERS:
        raise ValueError(f"unknown log format {log_format!r}; expected one of {LOG_FORMATS}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    handler = _StderrHandler(stream)
    handler.setFormatter(_FORMATTERS[log_format]())
    root.addHandler(handler)
    root.setLevel(numeric)
    clamp = max(CLAMP_LEVEL, numeric)
    for name in CLAMPED_LOGGERS:
        logging.getLogger(name).setLevel(clamp)
    logging.getLogger(__name__).debug(
        "logging configured",
        extra={
            "log_level": level.lower(),
            "log_format": log_format,
            "clamped": ",".join(CLAMPED_LOGGERS),
        },
    )
