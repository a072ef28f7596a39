"""What a support-table row is (engine/config/support.py): a key path, a status, the condition on the
key's value under which the status applies, why, and what to do; and the conditions rows use."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class Status(str, enum.Enum):
    IMPLEMENTED = "implemented"
    ACCEPTED = "accepted"
    ALIAS = "alias"
    WARNED = "warned"
    REFUSED = "refused"


@dataclass(frozen=True)
class When:
    """A condition on a key's value, with the words the docs table shows for it."""

    text: str
    test: Callable[[Any], bool]


def number(v: Any) -> bool:
    """A JSON number (bool is an int in Python, not in JSON)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


PRESENT = When("present", lambda v: True)
TRUE = When("true", lambda v: v is True)
NON_EMPTY = When("a non-empty object", lambda v: bool(v))
_UNSET = object()


def _changed(section: Mapping[str, Any], defaults: Mapping[str, Any]) -> bool:
    """True when `section` sets any key to something other than DeepSpeed's default."""
    for key, value in section.items():
        default = defaults.get(key, _UNSET)
        if isinstance(value, dict) and isinstance(default, dict):
            if _changed(value, default):
                return True
        elif isinstance(value, str) and isinstance(default, str):
            if value.lower() != default.lower():
                return True
        elif value != default:
            return True
    return False


def changed_from(defaults: Mapping[str, Any]) -> When:
    """A section with a non-default key; a section that only restates defaults is not worth a warning."""
    return When("a key differs from its default", lambda v: isinstance(v, dict) and _changed(v, defaults))


def above(limit: int) -> When:
    return When(f"> {limit}", lambda v: number(v) and v > limit)


def not_in(*allowed: str) -> When:
    """Strings other than `allowed` (case-insensitive, as DeepSpeed lower-cases dtype names)."""
    low = {a.lower() for a in allowed}
    return When("not " + " / ".join(allowed), lambda v: isinstance(v, str) and v.lower() not in low)


def one_of(*names: str) -> When:
    low = {n.lower() for n in names}
    return When(" / ".join(names), lambda v: isinstance(v, str) and v.lower() in low)


@dataclass(frozen=True)
class Entry:
    path: str
    status: Status
    when: When
    reason: str
    fix: str = ""
