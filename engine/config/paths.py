"""Key paths and "did you mean" suggestions, shared by every config check.

A path is a tuple of keys (str) and list indices (int); users see it dotted: `zero_optimization.stage`,
`optimizer.params.betas[0]`. Messages always name the path, so a user can find the key in their file.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

KeyPath = tuple[str | int, ...]

_MISSING = object()


def dotted(path: Sequence[str | int]) -> str:
    """`("zero_optimization", "stage")` -> `"zero_optimization.stage"`; the root is `"<config>"`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<config>"


def split(path: str) -> KeyPath:
    """Inverse of `dotted` for paths without list indices (all support-table paths)."""
    return tuple(path.split("."))


def get(tree: Any, path: Sequence[str | int], default: Any = None) -> Any:
    """Value at `path`, or `default` when any step is missing or not a container."""
    node = tree
    for part in path:
        in_list = isinstance(part, int) and isinstance(node, list) and -len(node) <= part < len(node)
        in_dict = isinstance(part, str) and isinstance(node, dict) and part in node
        if not (in_list or in_dict):
            return default
        node = node[part]
    return node


def has(tree: Any, path: Sequence[str | int]) -> bool:
    return get(tree, path, _MISSING) is not _MISSING


def delete(tree: Any, path: Sequence[str | int]) -> None:
    """Remove the key at `path` if it is there (used to drop values that failed validation)."""
    if not path:
        return
    parent = get(tree, path[:-1], _MISSING)
    last = path[-1]
    if isinstance(parent, dict) and isinstance(last, str):
        parent.pop(last, None)
    elif isinstance(parent, list) and isinstance(last, int) and -len(parent) <= last < len(parent):
        parent[last] = None


def closest(name: str, candidates: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known key a typo most likely meant; case-insensitive first, then difflib (ratio >= cutoff)."""
    pool = sorted(set(candidates))
    for cand in pool:
        if cand.lower() == name.lower():
            return cand
    matches = difflib.get_close_matches(name, pool, n=1, cutoff=cutoff)
    return matches[0] if matches else None
