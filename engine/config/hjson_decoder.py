"""hjson's decoder (what DeepSpeed reads config files with) plus what it lacks for hostile input.

- `NaN`, `Infinity`, `-Infinity` read as floats, as Python's json reads them (json.dumps writes a dict's
  inf/nan that way, so a dict and the file written from it must mean the same). hjson would take them
  for quoteless strings running to the end of the line, and fail far away with "Bad key name (eof)".
- A number too large for a float (1e400) reads as +-Infinity, as in Python's json; hjson crashes with
  OverflowError on its int(value) == value check. The finiteness check then names the key.
- Objects and arrays nested past nesting.MAX_DEPTH raise TooDeep at that line and column instead of
  recursing until Python's RecursionError.

It plugs into hjson's own hooks (the decoder's parse_object/parse_array/parse_tfnns, read by
hjson.decoder.make_scanner), so everything else parses exactly as hjson does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import hjson
from hjson import decoder as hjson_decoder

from engine.config.nesting import MAX_DEPTH, too_deep

# A value hjson would not read as a float: the JSON constants, or a number with a fraction or exponent
# (integers stay exact ints, as in Python's json). It must end where hjson ends a value: before a comma,
# a closing bracket, a comment or the end of the line.
_FLOAT_TOKEN = re.compile(
    r"[\t ]*(-?Infinity|NaN|-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?)[\t ]*(?=$|[,}\]\r\n#]|/[/*])"
)


def _scan_value(context: Any, text: str, end: int) -> tuple[Any, int]:
    """hjson's scanner for unbracketed values (numbers, true/false/null, quoteless strings)."""
    match = _FLOAT_TOKEN.match(text, end)
    if match:
        value = float(match.group(1))
        if not math.isfinite(value):
            return value, match.end()
    return hjson_decoder.scantfnns(context, text, end)


class TooDeep(ValueError):
    """Not an HjsonDecodeError: hjson retries a failed braceless root as a single value on those, which
    would replace this message with an unrelated "Extra data"."""

    def __init__(self, text: str, index: int) -> None:
        self.lineno = text.count("\n", 0, index) + 1
        self.colno = index - text.rfind("\n", 0, index)
        super().__init__(too_deep(f"level {MAX_DEPTH + 1} opens here"))


class ConfigDecoder(hjson.HjsonDecoder):
    """One decode per instance (hjson.loads builds a new one per call), so the depth counter is private."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._depth = 0
        self.parse_object = self._limited(hjson_decoder.JSONObject)
        self.parse_array = self._limited(hjson_decoder.JSONArray)
        self.parse_tfnns = _scan_value
        self.scan_once, self.scan_object_once = hjson_decoder.make_scanner(self)

    def _limited(self, parse: Callable[..., tuple[Any, int]]) -> Callable[..., tuple[Any, int]]:
        def parse_nested(state: tuple[str, int], *args: Any) -> tuple[Any, int]:
            if self._depth >= MAX_DEPTH:
                text, index = state
                raise TooDeep(text, max(index - 1, 0))  # index is just past the bracket
            self._depth += 1
            try:
                return parse(state, *args)
            finally:
                self._depth -= 1

        return parse_nested


def is_blank(text: str) -> bool:
    """Nothing but whitespace and comments (hjson would return {} for it, as for "{}")."""
    return hjson_decoder.getNext(text.lstrip("\ufeff"), 0)[0] == ""
