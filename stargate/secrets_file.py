"""The replica's own secrets file (`--secrets-path`): a JSON document of credentials, read where
they are needed and re-read when the file changes (docs/worker-auth.md, "The secrets file").

Kubernetes mounts a Secret as a symlink into a timestamped directory and rotates it by swapping the
symlink, so the file is never edited in place: each use compares the resolved file's
`(st_mtime_ns, st_ino, st_size)` with the one last read, which costs one `stat` and notices a swap
at once without a polling task. A rotation caught half-written (bad JSON, a key missing for a
moment) must not break a replica that was working, so once a value has been read successfully the
last good value is kept, with a WARNING, until the file is valid again; before that, the error is
raised (a start-up check turns it into a clear exit).

Nothing read from the file ever reaches a log line or an error message: errors name the file,
the key path and what was wrong (bad JSON at line N, a missing key, the wrong JSON type), never a
value. `SecretsFile` is shared by the worker-auth credentials (stargate/control_plane/
gateway_credentials.py) and the tracing exporter (`tracing_access_token`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "TRACING_ACCESS_TOKEN_KEY",
    "SecretsFile",
    "SecretsFileError",
    "tracing_access_token",
]

log = logging.getLogger(__name__)

TRACING_ACCESS_TOKEN_KEY = "tracingAccessToken"

_Signature = tuple[int, int, int]
_MISSING = object()


class SecretsFileError(Exception):
    """The secrets file cannot be read, is not a JSON object, or lacks a usable value. The
    message names the file and the key path, never a value from the file."""


def _describe_type(value: object) -> str:
    """The JSON type of `value`, for an error message that must not show the value itself."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


class SecretsFile:
    """One JSON secrets file, re-read whenever the file behind `path` changes.

    Thread-safe: the worker-auth client reads it from worker threads (`trio.to_thread`), since a
    file read must not block the event loop.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._signature: _Signature | None = None
        self._document: dict[str, object] | None = None
        self._error: SecretsFileError | None = None  # of the document with `_signature`
        self._last_good: dict[tuple[str, ...], str | None] = {}
        # Per key path, the file version last warned about: one WARNING per bad version.
        self._warned: dict[tuple[str, ...], _Signature | None] = {}

    def __repr__(self) -> str:
        return f"SecretsFile({str(self.path)!r})"

    def string(self, keys: Sequence[str]) -> str:
        """The non-empty string (trimmed) at the dot-separated key path `keys`.

        Raises SecretsFileError if the file or the value is not usable and no good value was read
        before; otherwise a bad read logs a WARNING and returns the last good value.
        """
        value = self._lookup(tuple(keys), required=True)
        assert value is not None
        return value

    def optional_string(self, keys: Sequence[str]) -> str | None:
        """The string (trimmed) at `keys`, or None when the key is absent or the string is blank.
        A value of another type, or a file that is not a JSON object, is an error, as in
        `string`."""
        return self._lookup(tuple(keys), required=False)

    def _lookup(self, keys: tuple[str, ...], *, required: bool) -> str | None:
        with self._lock:
            signature = self._refresh()
            try:
                if self._error is not None:
                    raise self._error
                assert self._document is not None
                value = self._value(self._document, keys, required=required)
            except SecretsFileError as error:
                if keys not in self._last_good:
                    raise
                if keys not in self._warned or self._warned[keys] != signature:
                    self._warned[keys] = signature
                    log.warning(
                        "secrets file changed but is not usable, keeping the last good value: %s",
                        error,
                    )
                return self._last_good[keys]
            self._last_good[keys] = value
            self._warned.pop(keys, None)
            return value

    def _refresh(self) -> _Signature | None:
        """Re-read the file if it is not the one read last (a signature of None: unreadable)."""
        try:
            stat = os.stat(self.path)  # follows the symlinks: the file Kubernetes swapped in
        except OSError as error:
            self._signature = None
            self._document = None
            self._error = SecretsFileError(
                f"cannot read secrets file {self.path}: {error.strerror or error}"
            )
            return None
        signature = (stat.st_mtime_ns, stat.st_ino, stat.st_size)
        if signature == self._signature:
            return signature
        self._signature = signature
        self._document, self._error = None, None
        try:
            self._document = self._parse(self.path.read_bytes())
        except OSError as error:
            self._error = SecretsFileError(
                f"cannot read secrets file {self.path}: {error.strerror or error}"
            )
        except SecretsFileError as error:
            self._error = error
        return signature

    def _parse(self, raw: bytes) -> dict[str, object]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SecretsFileError(f"secrets file {self.path} is not UTF-8 text") from None
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            # The decoder's message says what and where (line, column), never the text.
            raise SecretsFileError(
                f"secrets file {self.path} is not valid JSON: {error.msg} at line "
                f"{error.lineno} column {error.colno}"
            ) from None
        if not isinstance(document, dict):
            raise SecretsFileError(
                f"secrets file {self.path} must hold a JSON object, not {_describe_type(document)}"
            )
        return document

    def _value(
        self, document: dict[str, object], keys: tuple[str, ...], *, required: bool
    ) -> str | None:
        key_path = ".".join(keys)
        node: object = document
        for depth, key in enumerate(keys):
            if not isinstance(node, dict):
                parent = ".".join(keys[:depth])
                raise SecretsFileError(
                    f"secrets file {self.path}: {parent} must be a JSON object to hold "
                    f"{key_path}, not {_describe_type(node)}"
                )
            node = node.get(key, _MISSING)
            if node is _MISSING:
                if not required:
                    return None
                raise SecretsFileError(f"secrets file {self.path} has no key {key_path}")
        if not isinstance(node, str):
            raise SecretsFileError(
                f"secrets file {self.path}: {key_path} must be a string, not {_describe_type(node)}"
            )
        value = node.strip()
        if not value and required:
            raise SecretsFileError(f"secrets file {self.path}: {key_path} is empty")
        return value or None


def tracing_access_token(secrets: SecretsFile | Path) -> str | None:
    """The OTLP exporter's `tracingAccessToken` (trimmed; absent or blank = None).

    Raises SecretsFileError when the file is unreadable, not a JSON object, or the key holds
    something other than a string (the trace exporter refuses to start then, as in Rust)."""
    file = secrets if isinstance(secrets, SecretsFile) else SecretsFile(secrets)
    return file.optional_string((TRACING_ACCESS_TOKEN_KEY,))
