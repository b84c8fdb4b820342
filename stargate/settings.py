"""Each command-line setting defined once: one `Setting` per flag, one `Settings` table per command.

A `Setting` holds everything about a flag: its spelling, environment variable (explicit, never
derived from the command's name), help text, default, click type, how it is given (`kind`), the
parsing that follows click's type (trimming, a unit, a check whose `ValueError` becomes a usage
error naming the flag), its `--help` heading, and the config field it fills (`to`, a dotted path
into the command's config dataclass). The default is that field's own default unless the setting
gives one (it must when the flag's default differs, or when `parse` changes the unit).

A `Settings` table generates the command's click options (`SettingsCommand`) and builds the
command's config from the parsed values (`Settings.build`): a path's nested dataclass is built
from the values under it, so the command body is one call. A rule across flags that does not
belong to a config class is a `Derived` field computed from the parsed values.

    SERVE = Settings(ServeConfig, Setting("--dns-poll-ms", env="STARGATE_DNS_POLL_MS",
        to="discovery.dns_poll_ms", type=POSITIVE_INT, help="..."), ...)

    @main.command(cls=SettingsCommand, settings=SERVE)
    def serve(**values: Any) -> None:
        config = SERVE.build(values)

`kind` uses the Helm chart's words (helm/stargate/templates/_helpers.tpl): `value` (`--flag=X`;
a boolean that takes a value is a `value` of type `click.BOOL`), `switch` (a bare `--flag`),
`toggle` (`--flag/--no-flag`) and `list` (repeatable, each value also comma-separated).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import click

__all__ = [
    "FROM_CONFIG",
    "Derived",
    "Kind",
    "Setting",
    "SettingOption",
    "Settings",
    "SettingsCommand",
    "ms_to_seconds",
    "trimmed",
]

C = TypeVar("C")
Kind = Literal["value", "switch", "toggle", "list"]


class _FromConfig:
    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG: Any = _FromConfig()
"""A setting's default when it gives none: the default of the config field it fills."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One flag of one command, and the config field (`to`) it fills; None: the command reads
    it itself (`--log-level`) or it is only checked (`--backend-connectivity`)."""

    flag: str
    env: str
    help: str
    to: str | None
    default: Any = FROM_CONFIG
    type: click.ParamType[Any] | type[Any] | None = None
    kind: Kind = "value"
    parse: Callable[[Any], Any] | None = None
    section: str | None = None
    hidden: bool = False
    required: bool = False
    metavar: str | None = None

    def __post_init__(self) -> None:
        if ("/" in self.flag) != (self.kind == "toggle"):
            raise ValueError(f"{self.flag}: a toggle is spelled --flag/--no-flag, nothing else is")

    @property
    def flags(self) -> tuple[str, ...]:
        """Every spelling: `--flag`, and `--no-flag` for a toggle."""
        return tuple(self.flag.split("/"))

    @property
    def name(self) -> str:
        """The click parameter's name (the key of the parsed values)."""
        return self.flags[0].removeprefix("--").replace("-", "_")


@dataclass(frozen=True, slots=True)
class Derived:
    """A config field computed from several parsed values: a rule across flags, such as two
    spellings of one listener. `compute` may raise `click.UsageError`."""

    to: str
    compute: Callable[[Mapping[str, Any]], Any]


def trimmed(value: str | None) -> str | None:
    """Surrounding blanks removed; empty is None (unset)."""
    return (value or "").strip() or None


def ms_to_seconds(value: int) -> float:
    return value / 1000


class Settings(Generic[C]):
    """One command's settings: its click options, its `--help` headings (in this order, after
    "Options"), and how its config `C` is built from the parsed values."""

    def __init__(
        self,
        config: type[C],
        *items: Setting | Derived,
        sections: tuple[str, ...] = (),
        factories: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.config = config
        self.sections = sections
        self.factories = dict(factories or {})
        """A nested config built by a function of its fields rather than its class (the TLS
        pair: none, both, or an error)."""
        self.settings = tuple(item for item in items if isinstance(item, Setting))
        self.derived = tuple(item for item in items if isinstance(item, Derived))
        self.defaults = {s.name: self._default(s) for s in self.settings}
        self._check()

    def _check(self) -> None:
        seen: set[str] = set()
        for setting in self.settings:
            for key in (*setting.flags, setting.env, setting.name):
                if key in seen:
                    raise ValueError(f"{key} is defined twice")
                seen.add(key)
            if setting.section is not None and setting.section not in self.sections:
                raise ValueError(f"{setting.flag}: section {setting.section!r} is not declared")

    def _default(self, setting: Setting) -> Any:
        if setting.default is not FROM_CONFIG or setting.required:
            return setting.default
        if setting.to is None:
            raise ValueError(f"{setting.flag} fills no config field: give it a default")
        *parents, last = setting.to.split(".")
        owner: type[Any] = self.config
        for parent in parents:
            owner = _field_class(owner, parent)
        field = {f.name: f for f in dataclasses.fields(owner)}[last]
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        raise ValueError(f"{setting.flag}: {owner.__name__}.{last} has no default: give one")

    def options(self) -> list[SettingOption]:
        return [SettingOption(s, self.defaults[s.name]) for s in self.settings]

    def build(self, values: Mapping[str, Any]) -> C:
        """The config from the parsed values (click's keyword arguments to the command)."""
        flat = {s.to: values[s.name] for s in self.settings if s.to is not None}
        flat.update({d.to: d.compute(values) for d in self.derived})
        built: C = _assemble(self.config, flat, self.factories, "")
        return built


def _field_class(owner: type[Any], name: str) -> type[Any]:
    """The dataclass a field of `owner` holds (`X | None` counts as `X`)."""
    hint = typing.get_type_hints(owner)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
        raise ValueError(f"{owner.__name__}.{name} is not a config dataclass")
    return hint


def _assemble(
    owner: type[Any], flat: Mapping[str, Any], factories: Mapping[str, Callable[..., Any]], at: str
) -> Any:
    """`owner(**fields)`, each nested config built from the dotted paths under its field."""
    fields: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in flat.items():
        head, dot, rest = path.partition(".")
        if dot:
            nested.setdefault(head, {})[rest] = value
        else:
            fields[head] = value
    for head, values in nested.items():
        factory = factories.get(at + head)
        if factory is not None:
            fields[head] = factory(**values)
        else:
            fields[head] = _assemble(_field_class(owner, head), values, factories, f"{at}{head}.")
    return owner(**fields)


class SettingOption(click.Option):
    """The click option of a `Setting`, shown with its environment variable and default."""

    def __init__(self, setting: Setting, default: Any) -> None:
        self.setting = setting
        super().__init__(
            [setting.flag],
            envvar=setting.env,
            show_envvar=True,
            show_default=True,
            help=setting.help,
            type=setting.type,
            is_flag=True if setting.kind == "switch" else None,
            multiple=setting.kind == "list",
            callback=_callback(setting),
            hidden=setting.hidden,
            required=setting.required,
            metavar=setting.metavar,
            **({} if setting.required else {"default": default}),
        )


def _callback(setting: Setting) -> Callable[[click.Context, click.Parameter, Any], Any] | None:
    """A list's values split at commas, then `parse`; its `ValueError` is a usage error naming
    the flag."""
    parse, split = setting.parse, setting.kind == "list"
    if parse is None and not split:
        return None

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if split:
            value = tuple(item.strip() for raw in value for item in raw.split(",") if item.strip())
        if parse is None:
            return value
        try:
            return parse(value)
        except ValueError as error:
            raise click.BadParameter(str(error), ctx, param) from None

    return callback


class SettingsCommand(click.Command):
    """A command whose options are a `Settings` table's (`settings=` on `@group.command`); its
    `--help` lists every option without a section under "Options", then each section's."""

    def __init__(self, *args: Any, settings: Settings[Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.params = [*settings.options(), *self.params]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str | None, list[tuple[str, str]]] = {None: []}
        rows.update({heading: [] for heading in self.settings.sections})
        for param in self.get_params(ctx):
            row = param.get_help_record(ctx)
            if row is not None:
                setting = getattr(param, "setting", None)
                rows[setting.section if isinstance(setting, Setting) else None].append(row)
        with formatter.section("Options"):
            formatter.write_dl(rows.pop(None))
        for heading, records in rows.items():
            if records:
                with formatter.section(str(heading)):
                    formatter.write_dl(records)
