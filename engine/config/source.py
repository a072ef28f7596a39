"""Turn a config source (path, dict, or base64 JSON) into a plain dict, as DeepSpeed accepts them.

Files are read with hjson like DeepSpeed does, so `//`, `#`, `/* */` comments and trailing commas load;
duplicate keys are an error (DeepSpeed refuses them too, and silently keeping one would hide a mistake).
Text from a file or base64 is decoded by hjson_decoder (NaN/Infinity, overflow, nesting limit); a dict
is measured against the same nesting limit before anything recurses into it. Everything a source can
get wrong is a ConfigError naming the file (or "<dict config>" / "<base64 config>") and the fix.
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import os
import re
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import hjson

from engine.config import nesting
from engine.config.errors import ConfigError
from engine.config.hjson_decoder import ConfigDecoder, TooDeep, is_blank

ConfigSource = str | os.PathLike[str] | dict[str, Any]
DICT_SOURCE = "<dict config>"
BASE64_SOURCE = "<base64 config>"

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _duplicate_line(text: str, key: str) -> int | None:
    """Line of the second occurrence of `key` as an object key; hjson's hook has no position."""
    pattern = re.compile(r'(^|[{,\s])"?' + re.escape(key) + r'"?\s*:')
    seen = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        seen += len(pattern.findall(line))
        if seen >= 2:
            return lineno
    return None


def parse_text(text: str, where: str) -> dict[str, Any]:
    """Parse hjson/JSON text; errors name `where` (a file path or "<base64 config>") and line:column."""
    if is_blank(text):
        raise ConfigError(
            f"{where}: the config is empty (only whitespace or comments); "
            'fix: write a JSON object of config keys, e.g. {"train_micro_batch_size_per_gpu": 8}'
        )
    try:
        data = hjson.loads(text, cls=ConfigDecoder, object_pairs_hook=_no_duplicates)
    except TooDeep as deep:
        raise ConfigError(f"{where}:{deep.lineno}:{deep.colno}: {deep}") from None
    except _DuplicateKey as dup:
        line = _duplicate_line(text, dup.key)
        at = f"{where}:{line}" if line else where
        raise ConfigError(
            f"{at}: duplicate key {dup.key!r}; each key may appear once per object, remove one of them"
        ) from None
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"{where}:{err.lineno}:{err.colno}: {err.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: the config must be a JSON object {{...}}, got {_json_kind(data)}; "
            'fix: put the config keys in one object, e.g. {"train_micro_batch_size_per_gpu": 8}'
        )
    return data


def _json_kind(value: Any) -> str:
    kinds = {list: "an array [...]", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def _decode_base64(text: str) -> str | None:
    """The JSON text inside a base64 string (standard or URL-safe alphabet), or None if it is not one."""
    compact = text.strip()
    if not compact or len(compact) % 4 == 1:
        return None
    padded = compact + "=" * (-len(compact) % 4)
    for altchars in (None, b"-_"):
        try:
            raw = base64.b64decode(padded, altchars=altchars, validate=True)
            decoded = raw.decode("utf-8-sig")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            continue
        # An array is not a config, but its decoding shows it was meant as one: parse_text says why.
        if decoded.lstrip().startswith(("{", "[")):
            return decoded
    return None


def source_name(source: object) -> str:
    """How messages name a source: its path, "<dict config>" or "<base64 config>"."""
    if isinstance(source, dict):
        return DICT_SOURCE
    if isinstance(source, os.PathLike):
        return os.fspath(source)
    if isinstance(source, str) and os.path.exists(source):
        return source
    return BASE64_SOURCE if isinstance(source, str) else type(source).__name__


def stack_backstop(read: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn a RecursionError inside `read(source, ...)` into a ConfigError naming the source.

    The nesting limit keeps recursion bounded, but parsing, deepcopy and jsonschema recurse a few
    frames per level, so a caller already deep in its stack can still run out. The config is the only
    deep structure these functions recurse into, so the error is about it; the stack has unwound by
    the time this runs, and the process can load another config.
    """

    @functools.wraps(read)
    def guarded(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return read(*args, **kwargs)
        except RecursionError:
            source = args[0] if args else kwargs.get("source")
            raise ConfigError(f"{source_name(source)}: {nesting.out_of_stack()}") from None

    return guarded


@stack_backstop
def read_source(source: ConfigSource) -> tuple[dict[str, Any], str]:
    """(config dict, where it came from); a dict is deep-copied so the caller's object is never changed."""
    if isinstance(source, dict):
        bad = [k for k in source if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{DICT_SOURCE}: keys must be strings, got {bad!r}")
        deep = nesting.first_too_deep(source)
        if deep is not None:
            raise ConfigError(f"{DICT_SOURCE}: {nesting.too_deep('at ' + nesting.shown_path(deep))}")
        return copy.deepcopy(source), DICT_SOURCE
    if isinstance(source, os.PathLike):
        return _read_file(os.fspath(source)), os.fspath(source)
    if isinstance(source, str):
        if os.path.exists(source):  # also a pipe such as /dev/stdin or bash's <(...)
            return _read_file(source), source
        decoded = _decode_base64(source)
        if decoded is not None:
            return parse_text(decoded, BASE64_SOURCE), BASE64_SOURCE
        shown = source if len(source) <= 200 else source[:200] + "..."
        raise ConfigError(
            f"config file not found: {shown!r} (looked for {os.path.abspath(source)!r}; "
            f"current directory {os.getcwd()!r}); it is not base64-encoded JSON either. "
            "Pass an existing path, a dict, or base64 of a JSON object"
        )
    raise ConfigError(f"config must be a path, a dict or a base64 JSON string, got {type(source).__name__}")


def _read_file(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        raise ConfigError(f"config path {path!r} is a directory; fix: pass the JSON file inside it")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path!r} (current directory {os.getcwd()!r})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file: {err}") from None
    try:
        text = data.decode("utf-8-sig")  # a BOM, as some Windows editors write, is not part of the JSON
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise ConfigError(
            f"{path}:{line}:{column}: not valid UTF-8 (byte 0x{data[err.start]:02x}); "
            "fix: save the file as UTF-8 (JSON files are UTF-8)"
        ) from None
    return parse_text(text, path)
