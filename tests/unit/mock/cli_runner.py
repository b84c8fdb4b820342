"""`stargate mock-backend` invoked in-process (with the `served` fixture of conftest.py)."""

from __future__ import annotations

from typing import Any

from click.testing import CliRunner

from stargate.mock import cli


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(cli.mock_backend_command, list(args), env=env)
