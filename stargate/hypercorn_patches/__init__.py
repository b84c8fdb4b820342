"""The Hypercorn seam: every replacement stargate makes in Hypercorn's and h11's code, listed in
one table (`table.PATCHES`) and installed by one function, `install()`, which
`stargate/serving.py` calls when it is imported (so whatever serves through it is patched).

Why each patch exists is in docs/http-serving.md ("The fixes, and why", "Limits", "Strict
framing") and docs/performance.md; each row of the table names its section and the test that
fails without it. The replacements live in a module per concern:

* `h2.py`: HTTP/2 (late DATA, back-pressure, the stream lifecycle, refused streams, GOAWAY
  rotation and `leave`, the round-robin send order);
* `h11.py`: HTTP/1.1 (the head written with the body); `framing.py`: strict request framing in
  h11's reader table;
* `tcp.py`: the trio connection (contained failures, writes at once, a send racing the close,
  the first request through the drain, the keep-alive timer);
* `limits.py`: the Hypercorn side of the HTTP listener's client limits (stargate/http_limits.py
  has the policy);
* `accept.py`: the accept loop under Hypercorn's listeners (trio's), which starts every queued
  connection in one pass;
* `app.py`: what the app sees (the disconnect hook, and `complete_response_before_disconnect`,
  an app wrapper `serving.serve_asgi` applies; no patch);
* `state.py`: what they keep per listener (one `Listener` on the listener's Hypercorn config) and
  per connection.

`install()` is idempotent, and refuses (`PatchTableMismatch`, before patching anything) to run on
a Hypercorn, h11 or h2 version outside `table.WRITTEN_FOR`, or on a target whose source is not
the one the table was written for (its fingerprint, a hash of `inspect.getsource` of the
original). `python -m stargate.hypercorn_patches` shows what differs; with `--update` it records
what is installed, once the table has been checked against it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from stargate.hypercorn_patches import table
from stargate.hypercorn_patches.app import complete_response_before_disconnect
from stargate.hypercorn_patches.h2 import leave
from stargate.hypercorn_patches.limits import gate_connections
from stargate.hypercorn_patches.state import REFUSES_STREAMS, Admitted
from stargate.hypercorn_patches.table import Mode, Patch

__all__ = [
    "REFUSES_STREAMS",
    "Admitted",
    "PatchTableMismatch",
    "complete_response_before_disconnect",
    "fingerprints",
    "gate_connections",
    "install",
    "installed_versions",
    "leave",
    "verify",
]


class PatchTableMismatch(RuntimeError):
    """The patch table was not written for the installed HTTP stack; the message says what
    differs and what to do."""


_installed = False
_originals: dict[str, Any] = {}  # target -> what it was before `install()`


def install() -> None:
    """Check the table against what is installed (`verify`), then apply every row of it, once."""
    global _installed
    if _installed:
        return
    patches = table.PATCHES
    verify(patches)
    for patch in patches:
        get, put = _place(patch.target)
        original = get()
        made = _replacement(patch)
        put(made if patch.mode is Mode.REPLACES else made(original))
        _originals[patch.target] = original
    _installed = True


def verify(
    patches: Sequence[Patch] | None = None,
    *,
    written_for: Mapping[str, tuple[str, str]] | None = None,
    version_of: Callable[[str], str | None] | None = None,
) -> None:
    """Raise `PatchTableMismatch` unless every version in `written_for` (`table.WRITTEN_FOR`) is
    installed in its range and every target of `patches` (`table.PATCHES`) still has the
    fingerprint its row records. `version_of` (a distribution's installed version, or None) is
    for tests."""
    patches = table.PATCHES if patches is None else patches
    written_for = table.WRITTEN_FOR if written_for is None else written_for
    versions = installed_versions(written_for, version_of)
    problems = table.mismatches(patches, written_for, versions, fingerprints(patches))
    if problems:
        raise PatchTableMismatch(table.refusal(problems, written_for))


def installed_versions(
    names: Iterable[str] | None = None,
    version_of: Callable[[str], str | None] | None = None,
) -> dict[str, str | None]:
    """The installed version of each distribution (`table.WRITTEN_FOR`'s by default; None: not
    installed)."""
    lookup = _distribution_version if version_of is None else version_of
    return {name: lookup(name) for name in (table.WRITTEN_FOR if names is None else names)}


def fingerprints(patches: Sequence[Patch] | None = None) -> dict[str, str | None]:
    """The fingerprint of each target's original (as it was before `install()`), or None when the
    target is gone or its source cannot be read."""
    found: dict[str, str | None] = {}
    for patch in table.PATCHES if patches is None else patches:
        try:
            original = _originals.get(patch.target)
            if original is None:
                original = _place(patch.target)[0]()
            found[patch.target] = table.fingerprint(inspect.getsource(original))
        except (ImportError, AttributeError, KeyError, OSError, TypeError):
            found[patch.target] = None
    return found


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _place(target: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """How to read and replace a target: `module:Owner.attribute`, `module:name` (the module's
    own), or `module:MAPPING[NAME, ...]` for an entry of a mapping whose key is a tuple of the
    module's names."""
    module_name, _, path = target.partition(":")
    module = importlib.import_module(module_name)
    if path.endswith("]"):
        mapping_name, _, key_names = path[:-1].partition("[")
        mapping = getattr(module, mapping_name)
        key = tuple(getattr(module, name.strip()) for name in key_names.split(","))
        return (lambda: mapping[key]), (lambda value: mapping.__setitem__(key, value))
    owner_path, _, attribute = path.rpartition(".")
    owner: Any = module
    for name in owner_path.split(".") if owner_path else ():  # "module:name": the module's own
        owner = getattr(owner, name)
    return (lambda: getattr(owner, attribute)), (lambda value: setattr(owner, attribute, value))


def _replacement(patch: Patch) -> Any:
    module_name, _, name = patch.replacement.rpartition(".")
    return getattr(importlib.import_module(f"{__name__}.{module_name}"), name)
