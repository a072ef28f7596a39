"""Checked state moves, shared by every state machine of the engine: stage 3's units and gradients
(engine/zero/stage3/units.py), the flat stages' reduction (engine/zero/flat/stage.py) and the Engine's
accumulation window (engine/runtime/window.py). Each machine is an enum with a table of legal moves;
a move outside the table is a bug in the engine, refused by name before anything changes."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

S = TypeVar("S", bound=enum.Enum)


class IllegalStateMove(RuntimeError):
    """An internal error: a state transition its machine's table does not allow."""


def check_move(what: str, old: S, new: S, legal: Mapping[S, frozenset[S]]) -> None:
    """Raise IllegalStateMove, naming `what`, both states and the allowed ones, unless old -> new is in `legal`."""
    allowed = legal.get(old, frozenset())
    if new not in allowed:
        raise IllegalStateMove(
            f"{what} cannot move from {old.name} to {new.name} (allowed: "
            f"{', '.join(sorted(s.name for s in allowed)) or 'none'}); this is a bug in the engine, please report it"
        )
