"""Every flag of every command is documented where an operator looks for it.

Each command's flags are defined once, in its `Settings` table (stargate/settings.py). This test
reads the tables, not a list of its own, so a flag added to a table and forgotten in the README
fails here: the README section of its command names the flag and its environment variable.
(That every `stargate serve` flag is reachable from the chart's values is tests/helm/test_chart.py
`test_every_serve_flag_is_reachable`, which renders the chart.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stargate.cli import DEMO, SERVE
from stargate.mock.cli import MOCK_BACKEND
from stargate.pylon.cli import PYLON
from stargate.settings import Setting, Settings

README = Path(__file__).resolve().parents[2] / "README.md"

# command -> (its Settings table, the README heading of its section, which ends at the next "## ")
COMMANDS: dict[str, tuple[Settings[object], str]] = {
    "serve": (SERVE, "## `stargate serve` flags"),
    "pylon": (PYLON, "## `stargate pylon`"),
    "mock-backend": (MOCK_BACKEND, "## `stargate mock-backend`"),
    "demo": (DEMO, "## `stargate demo`"),
}


def _section(heading: str) -> str:
    text = README.read_text()
    start = text.index(heading + "\n")
    following = re.search(r"^## ", text[start + len(heading) :], flags=re.MULTILINE)
    end = len(text) if following is None else start + len(heading) + following.start()
    return text[start:end]


def _documented(setting: Setting, section: str) -> bool:
    return all(f"`{flag}`" in section for flag in setting.flags if not flag.startswith("--no-"))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_in_its_readme_section(command: str) -> None:
    table, heading = COMMANDS[command]
    section = _section(heading)
    missing = [s.flag for s in table.settings if not s.hidden and not _documented(s, section)]
    assert missing == [], f"README section {heading!r} does not name {missing}"


@pytest.mark.parametrize("command", ["serve", "pylon", "mock-backend"])
def test_every_environment_variable_is_in_its_readme_section(command: str) -> None:
    """The demo's section states its one rule (`STARGATE_DEMO_<FLAG>`) instead of a table."""
    table, heading = COMMANDS[command]
    section = _section(heading)
    missing = [s.env for s in table.settings if not s.hidden and f"`{s.env}`" not in section]
    assert missing == [], f"README section {heading!r} does not name {missing}"


def test_the_demo_variables_follow_the_documented_rule() -> None:
    table, _ = COMMANDS["demo"]
    for setting in table.settings:
        assert setting.env == "STARGATE_DEMO_" + setting.name.upper(), setting.flag


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help(command: str) -> None:
    table, _ = COMMANDS[command]
    assert [s.flag for s in table.settings if len(s.help.strip()) < 10] == []


def test_a_table_refuses_a_flag_defined_twice() -> None:
    setting = Setting("--dns-poll-ms", env="X", help="Poll period.", to=None, default=1)
    with pytest.raises(ValueError, match="defined twice"):
        Settings(object, setting, Setting("--other", env="X", help="Other.", to=None, default=2))
    with pytest.raises(ValueError, match="defined twice"):
        Settings(object, setting, setting)
