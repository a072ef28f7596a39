"""Turn a config source (path, dict, or base64 JSON) into a plain dict, as DeepSpeed accepts them.

Files are read with hjson like DeepSpeed does, so `//`, `#`, `/* */` comments and trailing commas load;
duplicate keys are an error (DeepSpeed refuses them too, and silently keeping one would hide a mistake).
"""

from __future__ import annotations

import base64
import binascii
import copy
import os
import re
from typing import Any

import hjson

from engine.config.errors import ConfigError

ConfigSource = str | os.PathLike[str] | dict[str, Any]
DICT_SOURCE = "<dict config>"


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
    try:
        data = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as dup:
        line = _duplicate_line(text, dup.key)
        at = f"{where}:{line}" if line else where
        raise ConfigError(
            f"{at}: duplicate key {dup.key!r}; each key may appear once per object, remove one of them"
        ) from None
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"{where}:{err.lineno}:{err.colno}: {err.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the config must be a JSON object {{...}}, got {type(data).__name__}")
    return data


def _decode_base64(text: str) -> str | None:
    """The JSON text inside a base64 string (standard or URL-safe alphabet), or None if it is not one."""
    compact = text.strip()
    if not compact or len(compact) % 4 == 1:
        return None
    padded = compact + "=" * (-len(compact) % 4)
    for altchars in (None, b"-_"):
        try:
            raw = base64.b64decode(padded, altchars=altchars, validate=True)
            decoded = raw.decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            continue
        if decoded.lstrip().startswith("{"):
            return decoded
    return None


def read_source(source: ConfigSource) -> tuple[dict[str, Any], str]:
    """(config dict, where it came from); a dict is deep-copied so the caller's object is never changed."""
    if isinstance(source, dict):
        bad = [k for k in source if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{DICT_SOURCE}: keys must be strings, got {bad!r}")
        return copy.deepcopy(source), DICT_SOURCE
    if isinstance(source, os.PathLike):
        return _read_file(os.fspath(source)), os.fspath(source)
    if isinstance(source, str):
        if os.path.isfile(source):
            return _read_file(source), source
        if os.path.isdir(source):
            raise ConfigError(f"config path {source!r} is a directory; pass the JSON file inside it")
        decoded = _decode_base64(source)
        if decoded is not None:
            return parse_text(decoded, "<base64 config>"), "<base64 config>"
        shown = source if len(source) <= 200 else source[:200] + "..."
        raise ConfigError(
            f"config file not found: {shown!r} (looked for {os.path.abspath(source)!r}; "
            f"current directory {os.getcwd()!r}); it is not base64-encoded JSON either. "
            "Pass an existing path, a dict, or base64 of a JSON object"
        )
    raise ConfigError(f"config must be a path, a dict or a base64 JSON string, got {type(source).__name__}")


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path!r} (current directory {os.getcwd()!r})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config file: {err}") from None
    return parse_text(text, path)
