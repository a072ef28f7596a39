"""Check a config dict against schema.json; every problem is reported with its key path.

jsonschema's own messages are fine for leaves ("5 is not one of [0, 1, 2, 3]") but poor for two cases
we rewrite: unknown keys (we name the key and suggest the closest known one) and `anyOf` values such
as `number | "auto"` (we report the branch the value was meant for, not "not valid under any").
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from engine.config.paths import KeyPath, closest, dotted

SCHEMA_FILE = "schema.json"


@functools.lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The parsed schema.json shipped with the package."""
    return json.loads(resources.files("engine.config").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=1)
def _validator() -> Draft202012Validator:
    return Draft202012Validator(schema())


def top_level_keys() -> list[str]:
    return sorted(schema()["properties"])


def check_schema(config: dict[str, Any]) -> tuple[list[str], list[KeyPath]]:
    """(messages, paths to drop): dropping the bad values lets later checks run on the rest."""
    messages: list[str] = []
    bad_paths: list[KeyPath] = []
    for error in sorted(_validator().iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path]):
        for path, message in _explain(error):
            messages.append(f"{dotted(path)}: {message}")
            bad_paths.append(path)
    return messages, bad_paths


def _explain(error: ValidationError) -> list[tuple[KeyPath, str]]:
    path: KeyPath = tuple(error.absolute_path)
    if error.validator == "additionalProperties":
        return _unknown_keys(error, path)
    if error.validator == "required":
        return [(path, f"missing required key; {error.message}")]
    if error.validator in ("anyOf", "oneOf") and error.context:
        return _explain_alternatives(error, path)
    return [(path, error.message)]


def _unknown_keys(error: ValidationError, path: KeyPath) -> list[tuple[KeyPath, str]]:
    known = list(error.schema.get("properties", {}))
    out = []
    for key in error.instance:
        if key in known:
            continue
        guess = closest(key, known)
        if guess:
            hint = f"did you mean {guess}?"
        elif len(known) <= 12:
            hint = "known keys here: " + ", ".join(sorted(known))
        else:
            hint = "see docs/config-keys.md for the keys this engine reads"
        out.append(((*path, key), f"unknown key; {hint}"))
    return out


def _explain_alternatives(error: ValidationError, path: KeyPath) -> list[tuple[KeyPath, str]]:
    """Pick the alternative whose kind (type/const) the value has and report its errors."""
    by_branch: dict[int, list[ValidationError]] = defaultdict(list)
    for sub in error.context or []:
        by_branch[int(sub.schema_path[0])].append(sub)

    def wrong_kind(errs: list[ValidationError]) -> bool:
        return any(e.validator in ("type", "const") and tuple(e.absolute_path) == path for e in errs)

    fitting = [errs for errs in by_branch.values() if not wrong_kind(errs)]
    if len(fitting) == 1:
        out: list[tuple[KeyPath, str]] = []
        for sub in fitting[0]:
            out.extend(_explain(sub))
        return out
    expected: list[str] = []
    for errs in by_branch.values():
        for sub in errs:
            if sub.validator == "type":
                kinds = sub.validator_value if isinstance(sub.validator_value, list) else [sub.validator_value]
                expected.extend(str(k) for k in kinds)
            elif sub.validator == "const":
                expected.append(json.dumps(sub.validator_value))
    wanted = " or ".join(dict.fromkeys(expected)) or "a value allowed by the schema"
    return [(path, f"{_show(error.instance)} is not valid; expected {wanted}")]


def _show(value: Any) -> str:
    """JSON spelling where possible (users wrote JSON), repr for objects a dict source may hold."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
