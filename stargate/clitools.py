"""Building blocks shared by every `stargate` command (serve, mock-backend, pylon, demo).

Each command's flags are a `stargate.settings.Settings` table; these are the click types and
settings they share. Every command logs the same way (`--log-level` and `--log-format`, applied by
`stargate/logs.py`). Parts of the package may use these helpers; nothing here imports a part but
the config's address parser.
"""

from __future__ import annotations

from typing import Any

import click

from stargate.config import ConfigError, ListenAddress, parse_listen_address
from stargate.settings import Setting

__all__ = [
    "LISTEN_ADDRESS",
    "NON_NEGATIVE_INT",
    "PORT",
    "POSITIVE_INT",
    "ListenAddressType",
    "PositiveInt",
    "log_settings",
]


class PositiveInt(click.ParamType[int]):
    """An integer that must be greater than 0 (the Rust parser's "value must be greater than 0")."""

    name = "INTEGER"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number: int = click.INT.convert(value, param, ctx)
        if number <= 0:
            self.fail(f"value must be greater than 0, got {number}", param, ctx)
        return number


POSITIVE_INT = PositiveInt()
NON_NEGATIVE_INT = click.IntRange(min=0)
PORT = click.IntRange(min=0, max=65535)


class ListenAddressType(click.ParamType[ListenAddress]):
    """An `IP:port` listen address (`[v6]:port` for IPv6)."""

    name = "IP:PORT"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> ListenAddress:
        if isinstance(value, ListenAddress):
            return value
        try:
            return parse_listen_address(str(value))
        except ConfigError as error:
            self.fail(str(error), param, ctx)


LISTEN_ADDRESS = ListenAddressType()


def log_settings(level_env: str, format_env: str) -> tuple[Setting, Setting]:
    """`--log-level`, and `--log-format`: `text` lines with ` key=value` fields, or one JSON
    object per line (stargate/logs.py). The command applies them itself."""
    return (
        Setting(
            "--log-level",
            env=level_env,
            to=None,
            type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
            default="info",
            help="Minimum level of log lines written to stderr.",
        ),
        Setting(
            "--log-format",
            env=format_env,
            to=None,
            type=click.Choice(["text", "json"], case_sensitive=False),
            default="text",
            help="Log line format: text (key=value fields after the message) or json (one object "
            "per line).",
        ),
    )
