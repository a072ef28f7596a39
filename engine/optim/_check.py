"""Small `_check_*`-style helpers shared by the optimizer and scheduler builders.

Every user-triggerable problem becomes one `ConfigError` whose message names the config key
(`optimizer.params.<name>`, `scheduler.type`, ...), what we expected, what we got, and the fix.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from engine.config.errors import ConfigError


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' Did you mean "X"?' for the closest known name (case-insensitive), or '' when none is close."""
    by_lower = {k.lower(): k for k in known}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f' Did you mean "{by_lower[match[0]]}"?' if match else ""


def check_param_names(section: str, owner: str, given: Mapping[str, Any], accepted: Iterable[str]) -> None:
    """Raise one ConfigError listing every key of `given` that is not in `accepted`.

    `section` is the config path of the params mapping, e.g. "optimizer.params".
    """
    accepted_sorted = sorted(accepted)
    problems = []
    for key in given:
        if key not in accepted_sorted:
            problems.append(
                f"{section}.{key} is not a parameter of {owner}.{did_you_mean(key, accepted_sorted)} "
                f"Accepted: {', '.join(accepted_sorted)}."
            )
    if problems:
        raise ConfigError(problems)


def check_required(section: str, owner: str, given: Mapping[str, Any], required: Iterable[str]) -> None:
    """Raise one ConfigError naming every required key missing from `given`."""
    missing = [f"{section}.{key} is required by {owner} but missing." for key in required if key not in given]
    if missing:
        raise ConfigError(missing)


def keyword_params(fn: Callable[..., Any], skip: int) -> tuple[set[str], set[str], bool]:
    """(accepted, required, takes_var_kwargs) for `fn`'s parameters after the first `skip` ones.

    Used to validate pass-through params for torch classes against their real signature, so a
    typo fails at config time instead of as a TypeError deep inside torch.
    """
    params = list(inspect.signature(fn).parameters.values())[skip:]
    accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is inspect.Parameter.empty
    }
    var_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    return accepted, required, var_kwargs


def check_positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
    return value


def check_number(key: str, value: Any, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value!r}.")
    return float(value)


def check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}.")
    return value
