"""Building blocks shared by every `stargate` command (serve, mock-backend, pylon, demo).

Every option shows its environment variable and default in `--help`; every command logs the same
way (`--log-level` and `--log-format`, applied by `stargate/logs.py`). Parts of the package may use
these helpers; nothing here imports a part but the config's address parser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import click

from stargate.config import ConfigError, ListenAddress, parse_listen_address

__all__ = [
    "LISTEN_ADDRESS",
    "POSITIVE_INT",
    "ListenAddressType",
    "PositiveInt",
    "SectionedCommand",
    "comma_list",
    "log_format_option",
    "log_level_option",
    "option",
    "sectioned",
]

F = TypeVar("F", bound=Callable[..., Any])


class PositiveInt(click.ParamType[int]):
    """An integer that must be greater than 0 (the Rust parser's "value must be greater than 0")."""

    name = "INTEGER"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number: int = click.INT.convert(value, param, ctx)
        if number <= 0:
            self.fail(f"value must be greater than 0, got {number}", param, ctx)
        return number


POSITIVE_INT = PositiveInt()


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


class SectionedCommand(click.Command):
    """A command whose `--help` lists some options under their own headings.

    `sections` maps a heading to the parameter names it holds (in the order declared on the
    command); every other option stays under "Options".
    """

    sections: ClassVar[dict[str, tuple[str, ...]]] = {}

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        placed = {name for names in self.sections.values() for name in names}
        rows: dict[str, list[tuple[str, str]]] = {heading: [] for heading in self.sections}
        general: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            row = param.get_help_record(ctx)
            if row is None:
                continue
            if param.name in placed:
                heading = next(h for h, names in self.sections.items() if param.name in names)
                rows[heading].append(row)
            else:
                general.append(row)
        with formatter.section("Options"):
            formatter.write_dl(general)
        for heading, records in rows.items():
            if records:
                with formatter.section(heading):
                    formatter.write_dl(records)


def sectioned(sections: dict[str, tuple[str, ...]]) -> type[SectionedCommand]:
    """A `SectionedCommand` class with these `sections` (for `@group.command(cls=...)`)."""
    return type("Sectioned", (SectionedCommand,), {"sections": sections})


def option(*names: str, envvar: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option with an explicit environment variable, shown with its default in --help."""
    return click.option(*names, envvar=envvar, show_envvar=True, show_default=True, **kwargs)


def log_level_option(envvar: str) -> Callable[[F], F]:
    return option(
        "--log-level",
        envvar=envvar,
        type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
        default="info",
        help="Minimum level of log lines written to stderr.",
    )


def log_format_option(envvar: str) -> Callable[[F], F]:
    """`--log-format`: `text` lines with ` key=value` fields, or one JSON object per line
    (stargate/logs.py)."""
    return option(
        "--log-format",
        envvar=envvar,
        type=click.Choice(["text", "json"], case_sensitive=False),
        default="text",
        help="Log line format: text (key=value fields after the message) or json (one object "
        "per line).",
    )


def comma_list(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    """Repeatable values may also be comma-separated, on the command line and in the env var."""
    return tuple(item.strip() for raw in value for item in raw.split(",") if item.strip())
