"""`stargate.logs`: the text and JSON line formats and the third-party clamps, asserted on the
formatted output (what an operator reads), not on log records."""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import click
import hpack
import pytest
import trio
import trio.testing

from stargate.activator import PoolSpec, SwapFailed
from stargate.activator.testing import running_activator
from stargate.cli import main
from stargate.logs import CLAMPED_LOGGERS, LoggedError, configure_logging
from tests.fakes.logs import captured_logs

ROOT = Path(__file__).resolve().parents[2]
TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
RFC3339_MS_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
SECRET = "Bearer s3cret-registration-token"

log = logging.getLogger("stargate.test_logs")


def _lines(output: str) -> list[str]:
    return output.splitlines()


def _without_time(line: str) -> str:
    assert TIME.match(line), line
    return TIME.sub("", line)


def _records(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines()]


# ---- text ----------------------------------------------------------------------------------------


def test_text_is_the_classic_line_followed_by_sorted_fields() -> None:
    with captured_logs("info", "text") as out:
        log.info("plain line")
        log.warning(
            "model pool swap failed",
            extra={"pool": "gpu1", "member": "coder", "elapsed": 0.25, "attempt": 2},
        )
    plain, fields = _lines(out.getvalue())
    assert _without_time(plain) == "INFO stargate.test_logs: plain line"
    assert _without_time(fields) == (
        "WARNING stargate.test_logs: model pool swap failed "
        "attempt=2 elapsed=0.25 member=coder pool=gpu1"
    )


def test_text_quotes_values_json_style_when_they_need_it() -> None:
    values = {
        "a_space": "connection reset by peer",
        "b_quote": 'say "hi"',
        "c_equals": "a=b",
        "d_newline": "line one\nline two",
        "e_empty": "",
        "f_backslash": "C:\\path",
        "g_tab": "a\tb",
        "h_plain": "http://10.0.0.1:8000/v1/chat/completions",
        "i_unicode": "modèle",
        "j_none": None,
        "k_bool": True,
        "l_single": "it's",
    }
    with captured_logs("info", "text") as out:
        log.info("quoting", extra=values)
    (line,) = _lines(out.getvalue())
    assert _without_time(line) == (
        "INFO stargate.test_logs: quoting "
        'a_space="connection reset by peer" '
        'b_quote="say \\"hi\\"" '
        'c_equals="a=b" '
        'd_newline="line one\\nline two" '
        'e_empty="" '
        'f_backslash="C:\\\\path" '
        'g_tab="a\\tb" '
        "h_plain=http://10.0.0.1:8000/v1/chat/completions "
        "i_unicode=modèle "
        "j_none=None "
        "k_bool=True "
        'l_single="it\'s"'
    )


def test_text_prints_the_traceback_after_the_line() -> None:
    with captured_logs("info", "text") as out:
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("it failed", extra={"pool": "gpu1"})
    first, *rest = _lines(out.getvalue())
    assert _without_time(first) == "ERROR stargate.test_logs: it failed pool=gpu1"
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ValueError: boom"


def test_text_survives_a_field_that_cannot_be_printed() -> None:
    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no str")

        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    with captured_logs("info", "text") as out:
        log.info("odd field", extra={"thing": Unprintable()})
    (line,) = _lines(out.getvalue())
    assert (
        _without_time(line)
        == 'INFO stargate.test_logs: odd field thing="<unprintable Unprintable>"'
    )


# ---- json ----------------------------------------------------------------------------------------


def test_json_has_the_core_keys_and_every_field() -> None:
    with captured_logs("debug", "json") as out:
        log.debug("hello %s", "world", extra={"pool": "gpu1", "elapsed": 1.5, "count": 3})
    records = [r for r in _records(out.getvalue()) if r["logger"] == "stargate.test_logs"]
    (record,) = records
    assert RFC3339_MS_UTC.match(record.pop("time"))
    assert record == {
        "level": "DEBUG",
        "logger": "stargate.test_logs",
        "message": "hello world",
        "count": 3,
        "elapsed": 1.5,
        "pool": "gpu1",
    }


def test_json_exception_is_one_string() -> None:
    with captured_logs("info", "json") as out:
        try:
            raise KeyError("missing")
        except KeyError:
            log.exception("lookup failed")
    (record,) = _records(out.getvalue())
    assert record["message"] == "lookup failed"
    assert record["exception"].startswith("Traceback (most recent call last):\n")
    assert record["exception"].endswith("KeyError: 'missing'")


def test_json_never_raises_on_a_field_it_cannot_hold() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<Opaque>"

    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    circular: list[object] = []
    circular.append(circular)
    fields = {
        "opaque": Opaque(),
        "unprintable": Unprintable(),
        "nan": math.nan,
        "circular": circular,
        "tuple_keys": {(1, 2): "x"},
        "raw": b"\x00bytes",
        "nested": {"ok": [1, "two", None]},
        "time": "a field named like a core key",
    }
    with captured_logs("info", "json") as out:
        log.info("odd fields", extra=fields)
    (record,) = _records(out.getvalue())
    assert record["opaque"] == "<Opaque>"
    assert record["unprintable"] == "<unprintable Unprintable>"
    assert record["nan"] == "nan"
    assert record["circular"] == "[[...]]"
    assert record["tuple_keys"] == "{(1, 2): 'x'}"
    assert record["raw"] == "b'\\x00bytes'"
    assert record["nested"] == {"ok": [1, "two", None]}
    assert record["time_"] == "a field named like a core key"
    assert RFC3339_MS_UTC.match(record["time"])


# ---- the activator's fields, from the real code path ---------------------------------------------


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_the_activators_abandoned_swap_shows_its_fields(
    autojump_clock: trio.testing.MockClock, log_format: str
) -> None:
    spec = PoolSpec("heavy-slot", ("judge", "coder"), swap_budget=0.1, namespace="lab")
    with captured_logs("info", log_format) as out:
        async with running_activator([spec], ready=["judge"], router_name="r1") as h:
            h.fake().ready_delay["coder"] = None  # Activate succeeds, Ready never comes
            with pytest.raises(SwapFailed):
                await h.activator.acquire("coder", hold_budget=2.0)
    output = out.getvalue()
    if log_format == "text":
        (line,) = [line for line in _lines(output) if "model pool swap abandoned" in line]
        assert _without_time(line) == (
            "ERROR stargate.activator.pool: model pool swap abandoned elapsed=0.1 from=judge "
            "member=coder pool=heavy-slot reason=deadline to=coder"
        )
    else:
        (record,) = [r for r in _records(output) if r["message"] == "model pool swap abandoned"]
        del record["time"]
        assert record == {
            "level": "ERROR",
            "logger": "stargate.activator.pool",
            "message": "model pool swap abandoned",
            "elapsed": 0.1,
            "from": "judge",
            "member": "coder",
            "pool": "heavy-slot",
            "reason": "deadline",
            "to": "coder",
        }


def _extra_keys(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if keyword.arg == "extra":
                assert isinstance(keyword.value, ast.Dict), f"{path}:{node.lineno}: not a literal"
                for key in keyword.value.keys:
                    assert isinstance(key, ast.Constant), f"{path}:{node.lineno}"
                    found.append((node.lineno, str(key.value)))
    return found


def test_no_extra_field_collides_with_a_log_record_attribute() -> None:
    """`logging` refuses `extra=` keys that are LogRecord attributes; the JSON format renames
    its own keys. Every literal `extra=` in stargate/ is checked."""
    reserved = {
        *logging.LogRecord("", logging.INFO, "", 0, "", (), None).__dict__,
        "message",
        "asctime",
        "taskName",
    }
    calls = [
        (path, line, key)
        for path in sorted((ROOT / "stargate").rglob("*.py"))
        for line, key in _extra_keys(path)
    ]
    assert len(calls) > 20  # the activator's fields, the proxy's mid-stream warning...
    collisions = [(p.relative_to(ROOT), line, key) for p, line, key in calls if key in reserved]
    assert collisions == []


# ---- clamps --------------------------------------------------------------------------------------


def test_a_debug_header_from_hpack_never_reaches_the_output_at_debug() -> None:
    with captured_logs("debug", "text") as out:
        logging.getLogger("hpack.hpack").debug("Decoded %s", (b"authorization", SECRET.encode()))
        # And the real decoder, as the replica's HTTP/2 listeners run it:
        block = hpack.Encoder().encode([("authorization", SECRET)])
        assert hpack.Decoder().decode(block) == [("authorization", SECRET)]
        logging.getLogger("stargate.test_logs").debug("ours at debug")
    output = out.getvalue()
    assert "s3cret" not in output
    assert "hpack.hpack" not in output and "Decoded" not in output
    assert "ours at debug" in output  # debug was on for our own loggers


@pytest.mark.parametrize("name", [*CLAMPED_LOGGERS, "httpcore.http11", "hypercorn.access"])
def test_clamped_loggers_say_nothing_below_warning(name: str) -> None:
    with captured_logs("debug", "json") as out:
        logging.getLogger(name).debug("debug %s", SECRET)
        logging.getLogger(name).info("info %s", SECRET)
        logging.getLogger(name).warning("warning without a header")
    records = [r for r in _records(out.getvalue()) if r["logger"] == name]
    assert [r["message"] for r in records] == ["warning without a header"]
    assert SECRET not in out.getvalue()


def test_clamps_follow_a_log_level_above_warning() -> None:
    with captured_logs("error", "text") as out:
        logging.getLogger("httpx").warning("an httpx warning")
        logging.getLogger("stargate.test_logs").warning("our warning")
        logging.getLogger("httpx").error("an httpx error")
    output = out.getvalue()
    assert "warning" not in output
    assert "an httpx error" in output


def test_configuration_is_announced_at_debug_and_idempotent() -> None:
    with captured_logs("debug", "text") as out:
        configure_logging("debug", "text", stream=out)  # a second call replaces the first
        log.info("once")
    lines = _lines(out.getvalue())
    assert [line for line in lines if "once" in line] == [lines[-1]]
    assert _without_time(lines[0]) == (
        "DEBUG stargate.logs: logging configured "
        f"clamped={','.join(CLAMPED_LOGGERS)} log_format=text log_level=debug"
    )


# ---- LoggedError: the server's traceback for an error already logged -----------------------------


def test_an_already_logged_error_leaves_no_server_traceback() -> None:
    server = logging.getLogger("hypercorn.error")
    with captured_logs("info", "text") as out:
        for error in (
            LoggedError("cut"),
            ExceptionGroup("nursery", [LoggedError("cut")]),
            BaseExceptionGroup("nursery", [LoggedError("cut"), KeyboardInterrupt()]),
        ):
            try:
                raise error
            except BaseException:
                server.exception("Error in ASGI Framework")
        try:
            raise ExceptionGroup("nursery", [LoggedError("cut"), ValueError("a real bug")])
        except ExceptionGroup:
            server.exception("Error in ASGI Framework")
    output = out.getvalue()
    assert output.count("Error in ASGI Framework") == 1  # only the group with a real bug
    assert "ValueError: a real bug" in output


# ---- the option on every command -----------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "mock-backend", "pylon"])
def test_every_command_with_log_level_has_log_format(command: str) -> None:
    found = main.get_command(click.Context(main), command)  # pylon and mock-backend load lazily
    assert found is not None
    params = {p.name: p for p in found.params if isinstance(p, click.Option)}
    level, fmt = params["log_level"], params["log_format"]
    assert fmt.default == "text"
    assert isinstance(fmt.type, click.Choice) and list(fmt.type.choices) == ["text", "json"]
    assert isinstance(level.envvar, str) and fmt.envvar == level.envvar.replace("LEVEL", "FORMAT")
    assert fmt.help
