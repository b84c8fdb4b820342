"""`stargate.documents`: strict loading and the checks both config-file parsers share.

The parsers' own messages are asserted in tests/unit/activator/test_config.py and
tests/unit/load_balancing/test_config.py; these tests pin what the shared pieces find.
"""

from __future__ import annotations

import json
import math
from types import MappingProxyType

import pytest
import yaml

from stargate.documents import (
    StrictJsonError,
    TypeWords,
    is_integer,
    is_number,
    join_path,
    load_json,
    load_yaml,
    unknown_keys,
)

# ---- YAML ---------------------------------------------------------------------------------------


def test_load_yaml_decodes_like_safe_load() -> None:
    text = "pools:\n  - name: gpu0\n    members: [a, b]\n    swapBudget: 90s\n    maxHeld: 3\n"
    assert load_yaml(text) == yaml.safe_load(text)
    assert load_yaml("a: 1\nb:\n  a: 2\n") == {"a": 1, "b": {"a": 2}}  # same key, other mapping
    assert load_yaml("x: &s {b: 1}\ny: *s\n") == {"x": {"b": 1}, "y": {"b": 1}}
    assert load_yaml("") is None
    assert load_yaml("# nothing yet\n") is None


def test_load_yaml_rejects_a_duplicate_key_at_the_second_one() -> None:
    with pytest.raises(yaml.MarkedYAMLError) as info:
        load_yaml("a: 1\nb: 2\na: 3\n")
    assert info.value.problem == "duplicate key 'a'"
    assert info.value.problem_mark is not None
    assert (info.value.problem_mark.line, info.value.problem_mark.column) == (2, 0)


def test_load_yaml_rejects_duplicates_in_nested_and_flow_mappings() -> None:
    with pytest.raises(yaml.MarkedYAMLError, match="duplicate key 'model-a'"):
        load_yaml("members:\n  model-a: {x: 1}\n  model-a: {x: 2}\n")
    with pytest.raises(yaml.MarkedYAMLError, match="duplicate key 'k'"):
        load_yaml("- {k: 1, k: 1}\n")
    with pytest.raises(yaml.MarkedYAMLError, match=r"duplicate key 1\.0"):
        load_yaml("1: a\n1.0: b\n")  # equal keys, as Python compares them


def test_load_yaml_leaves_unhashable_keys_to_pyyaml() -> None:
    with pytest.raises(yaml.MarkedYAMLError, match="found unhashable key"):
        load_yaml("? [a, b]\n: 1\n")


def test_load_yaml_is_safe() -> None:
    with pytest.raises(yaml.YAMLError):
        load_yaml("x: !!python/object/apply:os.system [echo hi]\n")


def test_load_yaml_syntax_errors_keep_their_position() -> None:
    with pytest.raises(yaml.MarkedYAMLError) as info:
        load_yaml("pools:\n  - name: gpu0\n    members: [a\n    swapBudget: 9s\n")
    assert info.value.problem_mark is not None
    assert info.value.problem_mark.line >= 3


# ---- JSON ---------------------------------------------------------------------------------------


def test_load_json_decodes_like_json_loads() -> None:
    text = '{"default": "random", "models": {"m": {"sample_count": 4, "x": 0.5, "y": null}}}'
    assert load_json(text) == json.loads(text)
    assert load_json('{"a": {"k": 1}, "b": {"k": 2}}') == {"a": {"k": 1}, "b": {"k": 2}}
    assert load_json('"NaN"') == "NaN"  # a string, not the constant


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_load_json_rejects_non_json_constants(constant: str) -> None:
    with pytest.raises(StrictJsonError) as info:
        load_json(f'{{"max_input_work_seconds": {constant}}}')
    assert str(info.value) == f"{constant} is not a JSON value"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"default": "random", "default": "round-robin"}', "default"),
        ('{"models": {"m": "random", "m": "round-robin"}}', "m"),
        ('[{"a": 1, "a": 1}]', "a"),
    ],
)
def test_load_json_rejects_duplicate_keys(text: str, key: str) -> None:
    with pytest.raises(StrictJsonError) as info:
        load_json(text)
    assert str(info.value) == f"duplicate key {key!r} in an object"


def test_load_json_syntax_errors_are_decode_errors_with_a_position() -> None:
    # A missing comma: Python 3.11 and 3.13 place it alike (a trailing comma, they do not).
    with pytest.raises(json.JSONDecodeError) as info:
        load_json('{"default": "random" "x": 1}')
    assert not isinstance(info.value, StrictJsonError)
    assert (info.value.lineno, info.value.colno) == (1, 22)


# ---- checks and messages ------------------------------------------------------------------------


def test_unknown_keys_in_document_order() -> None:
    allowed = ("name", "members", "swapBudget")
    raw = {"swapBudjet": 1, "name": "g", "extra": 2, "members": []}
    assert unknown_keys(raw, allowed) == ["swapBudjet", "extra"]
    assert unknown_keys({"name": "g"}, allowed) == []
    assert unknown_keys({}, ()) == []
    assert unknown_keys({"anything": 1}, ()) == ["anything"]


def test_unknown_keys_compare_exactly() -> None:
    assert unknown_keys({"Name": 1, 3: 2, "name": 3}, {"name"}) == ["Name", 3]


def _words_for_tests(value: object) -> str:
    return f"<{value!r}>"


WORDS = TypeWords(null="nothing", mapping="a map", sequence="a list", scalar=_words_for_tests)


def test_type_words_name_the_three_shapes_and_render_the_rest() -> None:
    assert WORDS.describe(None) == "nothing"
    assert WORDS.describe({"a": 1}) == "a map"
    assert WORDS.describe(MappingProxyType({})) == "a map"
    assert WORDS.describe([1, 2]) == "a list"
    assert WORDS.describe("x") == "<'x'>"
    assert WORDS.describe(False) == "<False>"
    assert WORDS.describe(7) == "<7>"
    assert WORDS.describe((1,)) == "<(1,)>"  # a tuple is no document list


def test_type_words_with_json_and_yaml_words() -> None:
    json_words = TypeWords("null", "an object", "an array", json.dumps)
    values: tuple[object, ...] = (None, {}, [], "4", True, 4.0, math.inf)
    assert [json_words.describe(v) for v in values] == [
        "null",
        "an object",
        "an array",
        '"4"',
        "true",
        "4.0",
        "Infinity",
    ]
    yaml_words = TypeWords("nothing (null or empty)", "a mapping", "a list", repr)
    assert [yaml_words.describe(v) for v in values[:3]] == [
        "nothing (null or empty)",
        "a mapping",
        "a list",
    ]


def test_join_path() -> None:
    assert join_path("", "default") == "default"
    assert join_path("models", "my-model") == "models.my-model"
    assert join_path("models.m", "sample_count") == "models.m.sample_count"
    assert join_path(join_path("", "request_algorithms"), "powerOf2") == (
        "request_algorithms.powerOf2"
    )


@pytest.mark.parametrize(
    ("value", "integer", "number"),
    [
        (0, True, True),
        (-3, True, True),
        (2**70, True, True),
        (1.5, False, True),
        (4.0, False, True),
        (math.nan, False, True),
        (math.inf, False, True),
        (True, False, False),
        (False, False, False),
        ("4", False, False),
        (None, False, False),
        ([1], False, False),
    ],
)
def test_integers_and_numbers_exclude_booleans(value: object, integer: bool, number: bool) -> None:
    assert is_integer(value) is integer
    assert is_number(value) is number
