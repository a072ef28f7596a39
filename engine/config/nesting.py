"""The nesting limit every config source is held to, checked before anything recurses into the config.

Parsers, deepcopy and jsonschema all recurse once per level, so a hostile or machine-generated config
nested 100k deep would end in a RecursionError with a 3000-line traceback. No DeepSpeed config nests
more than about five levels, so a limit far above that refuses only broken input, the same for a dict,
a file and a base64 string (levels count containers; the root object is level 1).
"""

from __future__ import annotations

import sys
from typing import Any

from engine.config.paths import KeyPath, dotted

MAX_DEPTH = 100

FIX = "fix: check the program that wrote this config; no DeepSpeed config needs more than a few levels"


def too_deep(where: str) -> str:
    """The message for a config whose containers nest past MAX_DEPTH; `where` says at which key or line."""
    return f"the config nests deeper than {MAX_DEPTH} levels ({where}); {FIX}"


def out_of_stack() -> str:
    """The message for a config within MAX_DEPTH whose reading still hit Python's recursion limit:
    parsing and copying take a few frames a level, which a caller already deep in its stack may lack."""
    return (
        f"reading the config ran out of Python's stack (recursion limit {sys.getrecursionlimit()}): "
        f"parsing and copying take a few frames per nesting level (up to {MAX_DEPTH} levels are allowed) "
        "and the call came from an already deep stack; fix: nest the config less deeply, or load it "
        "from a shallower call or after raising sys.setrecursionlimit"
    )


def first_too_deep(value: Any) -> KeyPath | None:
    """Path of a container nested past MAX_DEPTH in a dict/list tree, or None; iterative, so a tree
    of any depth (or one that contains itself) is measured without recursion."""
    stack: list[tuple[Any, KeyPath]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, (dict, list, tuple)):
            continue
        if len(path) + 1 > MAX_DEPTH:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((v, (*path, k)) for k, v in items)
    return None


def shown_path(path: KeyPath) -> str:
    """A dotted path short enough for a message: the first keys of a 100-level path say where it is."""
    text = dotted(path)
    return text if len(text) <= 120 else text[:120] + "..."
