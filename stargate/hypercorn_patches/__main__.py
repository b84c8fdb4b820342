"""`python -m stargate.hypercorn_patches [--update]`: the patch table against what is installed.

Without arguments: every version the table was written for and every target's fingerprint, with
what differs marked; exit status 1 if anything differs. With `--update`, once each target that
differs has been re-read and its replacement checked (the table names the doc section and the
test of every behaviour): rewrite `WRITTEN_FOR` (to the installed minor versions) and the
fingerprints in table.py, and say which pins of pyproject.toml to change to match.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from stargate.hypercorn_patches import fingerprints, installed_versions, table


def _minor_range(version: str) -> tuple[str, str]:
    major, minor, *_ = (*table.version_tuple(version), 0, 0)
    return f"{major}.{minor}", f"{major}.{minor + 1}"


def main(argv: list[str]) -> int:
    update = argv == ["--update"]
    if argv and not update:
        print(__doc__, file=sys.stderr)
        return 2
    versions = installed_versions()
    found = fingerprints()
    differs = False
    print("versions (installed, written for):")
    for name, (low, high) in table.WRITTEN_FOR.items():
        version = versions[name]
        ok = version is not None and (
            table.version_tuple(low) <= table.version_tuple(version) < table.version_tuple(high)
        )
        differs |= not ok
        print(f"  {'ok     ' if ok else 'DIFFERS'} {name} {version} (>={low},<{high})")
    print("targets (fingerprint now, in the table):")
    for patch in table.PATCHES:
        now = found[patch.target]
        ok = now == patch.fingerprint
        differs |= not ok
        print(f"  {'ok     ' if ok else 'DIFFERS'} {patch.target} {now} {patch.fingerprint}")
        if not ok:
            for behaviour in patch.behaviours:
                print(f"            {behaviour.what}: {behaviour.doc}, {behaviour.test}")
    if not update:
        return 1 if differs else 0
    path = Path(table.__file__)
    text = path.read_text()
    # The rows' fingerprints, in the order of the rows: the only 16-hex-digit strings in PATCHES.
    rows = text.index("PATCHES: tuple[Patch, ...] = (")
    recorded = list(re.finditer(r'"([0-9a-f]{16})"', text[rows:]))
    assert [m.group(1) for m in recorded] == [p.fingerprint for p in table.PATCHES], "table.py"
    for patch, match in reversed(list(zip(table.PATCHES, recorded, strict=True))):
        now = found[patch.target]
        if now is not None and now != patch.fingerprint:
            start, end = rows + match.start(), rows + match.end()
            text = f'{text[:start]}"{now}"{text[end:]}'
    for name in table.WRITTEN_FOR:
        version = versions[name]
        if version is None:
            continue
        low, high = _minor_range(version)
        text = re.sub(
            rf'"{re.escape(name)}": \("[^"]*", "[^"]*"\)', f'"{name}": ("{low}", "{high}")', text
        )
        print(f"pyproject.toml: {name}>={low},<{high}")
    path.write_text(text)
    print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
