"""Strict reading of operator-written documents: the mechanics both config-file parsers share.

Two files are written by hand and read once at startup: the activator's pool file (YAML,
`stargate.activator.config`) and the load-balancer config (JSON, `stargate.load_balancing.config`).
In both, a typo must fail startup rather than quietly change behaviour, and the stock loaders and
Python itself are lenient in the same places:

* PyYAML and `json` keep the last of two duplicate keys without a word (`load_yaml`, `load_json`);
* `json` accepts `NaN`, `Infinity` and `-Infinity`, which are not JSON (`load_json`);
* `True` is an `int` to Python, but `true` is not a number in a document (`is_integer`,
  `is_number`);
* a key the parser does not know is a typo until proven otherwise (`unknown_keys`);
* a message names the key path that is wrong (`join_path`) and what the operator wrote there
  (`TypeWords`).

This module finds the problem; each parser words it. The parsers keep their own error classes
(`PoolConfigError`, `LbConfigError`), their domain rules and their exact messages, which the docs
list and the tests assert: where they phrase the same thing differently (a YAML file has mappings
and lists, a JSON file objects and arrays) the phrasing is a parameter (`TypeWords`) or stays with
the caller (what to say about an unknown key). It imports nothing of ours (docs/architecture.md,
Modules).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import yaml

__all__ = [
    "StrictJsonError",
    "TypeWords",
    "is_integer",
    "is_number",
    "join_path",
    "load_json",
    "load_yaml",
    "unknown_keys",
]


# ---- messages -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TypeWords:
    """How one parser names, in a message, the value an operator wrote: `got a list`,
    `got an array`, `got the string 'x'`, `got "x"`.

    `null`, `mapping` and `sequence` are the words for those three shapes; `scalar` renders any
    other value (a string, number or boolean) the way the parser's messages show it.
    """

    null: str
    mapping: str
    sequence: str
    scalar: Callable[[object], str]

    def describe(self, value: object) -> str:
        if value is None:
            return self.null
        if isinstance(value, Mapping):
            return self.mapping
        if isinstance(value, list):
            return self.sequence
        return self.scalar(value)


def join_path(path: str, key: str) -> str:
    """The dotted key path of `key` inside `path` (`models` + `m` -> `models.m`); a key at the
    root (empty `path`) is its own path."""
    return f"{path}.{key}" if path else key


# ---- checks -------------------------------------------------------------------------------------


def unknown_keys(keys: Iterable[object], allowed: Container[object]) -> list[object]:
    """The keys (iterate a mapping to pass its keys) that are not in `allowed`, in document order.

    Keys compare exactly: `swapBudjet`, `Default` and a non-string key are all unknown. Which one
    to report and how (the first with a suggestion, or all of them sorted) is the caller's choice.
    """
    return [key for key in keys if key not in allowed]


def is_integer(value: object) -> TypeGuard[int]:
    """An integer as the document wrote it: an `int` that is not a `bool`."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """A number as the document wrote it: an `int` or `float` that is not a `bool`. It may be
    infinite or NaN (YAML's `.inf`, `.nan`); callers that need a finite value check it."""
    return isinstance(value, int | float) and not isinstance(value, bool)


# ---- loading ------------------------------------------------------------------------------------


class StrictJsonError(ValueError):
    """Text Python's `json` module accepts but a strict JSON parser (such as upstream's
    serde_json) rejects: a `NaN`/`Infinity` constant, or a key given twice in one object."""


def load_json(text: str) -> object:
    """Decode a JSON document strictly. Raises `json.JSONDecodeError` (which has the line and
    column) for a syntax error and `StrictJsonError` for `NaN`, `Infinity`, `-Infinity` or a
    duplicate key."""
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicate_keys)


def _reject_constant(name: str) -> object:
    raise StrictJsonError(f"{name} is not a JSON value")


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise StrictJsonError(f"duplicate key {key!r} in an object")
        result[key] = value
    return result


def load_yaml(text: str) -> object:
    """Decode a YAML document with `yaml.SafeLoader`, except that a key given twice in one mapping
    is an error: a `yaml.MarkedYAMLError` whose problem is `duplicate key 'model-a'`, marked at
    the second key. Every failure is a `yaml.YAMLError`, as with `yaml.safe_load`. An empty
    document is None."""
    return yaml.load(text, Loader=_StrictYamlLoader)  # a SafeLoader subclass


class _StrictYamlLoader(yaml.SafeLoader):
    """`SafeLoader` that rejects duplicate mapping keys: PyYAML keeps the last one silently, which
    would drop, say, one of two `model-a:` controller entries without a trace."""


def _construct_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key; let the base constructor report it
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictYamlLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)
