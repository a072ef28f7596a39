"""Refuse NaN and +-Infinity anywhere in a config, by key path, keeping the meanings the schema documents.

No config number is meaningful as NaN, and an infinite lr or gradient_clipping passes every range check
(NaN passes them all: every comparison with it is false) and then destroys the weights on the first
step. So every non-finite number is refused, inside open sections such as optimizer.params too, which
the schema cannot see into. The one exception is declared in schema.json: a key whose schema has
`"x-infinity": <value>` reads +Infinity as <value> (steps_per_print: Infinity = null = never print,
because Accelerate and the Hugging Face Trainer put float("inf") there and DeepSpeed accepts it).

A dict holding float("inf") and a file holding `Infinity` (what json.dumps writes for it) or `1e400`
(too large for a float) reach this check as the same float, so every source behaves the same; an int
beyond a float's range (10**400, which a file's reader also turns into Infinity) counts as +-Infinity.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from engine.config.paths import KeyPath, dotted
from engine.config.validate import schema

INFINITY_KEYWORD = "x-infinity"
_NO_MEANING = object()
_DROPPED = object()


def check_finite(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(a copy of `config` with +Infinity replaced where the schema gives it a meaning and every other
    non-finite number removed, one problem per removed number). `config` must be nested no deeper
    than nesting.MAX_DEPTH (read_source checks), so the recursion here is bounded."""
    problems: list[str] = []
    cleaned = _walk(config, schema(), (), problems)
    return cleaned, problems


def _walk(value: Any, node: dict[str, Any], path: KeyPath, problems: list[str]) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            kept = _walk(item, _child(node, key), (*path, key), problems)
            if kept is not _DROPPED:
                out[key] = kept
        return out
    if isinstance(value, list):
        items = [_walk(item, _items(node), (*path, i), problems) for i, item in enumerate(value)]
        return [None if item is _DROPPED else item for item in items]
    number = _as_float(value)
    if number is None or math.isfinite(number):
        return value
    meaning = _infinity_meaning(node)
    if number > 0 and meaning is not _NO_MEANING:
        return meaning
    problems.append(_message(path, number, meaning))
    return _DROPPED


def _as_float(value: Any) -> float | None:
    """The float a config number means (None for other values and booleans); an int too large for a
    float means +-Infinity, as the same digits in a file do, instead of an OverflowError at float()."""
    # numbers.Real also covers numpy's float32, which is not a float subclass
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def _message(path: KeyPath, value: float, meaning: Any) -> str:
    spelled = json.dumps(value)  # NaN / Infinity / -Infinity: the spelling a JSON file has
    why = ""
    if math.isinf(value):
        why = "; a number beyond +-1.8e308 such as 1e400 also reads as Infinity"
    if meaning is not _NO_MEANING:
        why += f"; Infinity is accepted here and reads as {json.dumps(meaning)}"
    return f"{dotted(path)}: {spelled} is not a finite number{why}; fix: write a finite number"


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    """Follow local $refs ("#/$defs/x", "#/properties/bf16") to the schema they name."""
    while "$ref" in node:
        target: Any = schema()
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _branches(node: dict[str, Any]) -> list[dict[str, Any]]:
    node = _resolve(node)
    return [node, *(_resolve(b) for b in node.get("anyOf", []) + node.get("oneOf", []))]


def _child(node: dict[str, Any], key: str) -> dict[str, Any]:
    """Schema of `key` inside an object schema; {} (anything) for open sections."""
    for branch in _branches(node):
        if key in branch.get("properties", {}):
            return branch["properties"][key]
    return {}


def _items(node: dict[str, Any]) -> dict[str, Any]:
    for branch in _branches(node):
        if isinstance(branch.get("items"), dict):
            return branch["items"]
    return {}


def _infinity_meaning(node: dict[str, Any]) -> Any:
    for branch in _branches(node):
        if INFINITY_KEYWORD in branch:
            return branch[INFINITY_KEYWORD]
    return _NO_MEANING
