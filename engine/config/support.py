"""What this engine does with each DeepSpeed config key: the one support table.

Every top-level key of the schema has at least one entry. An entry is data: a key path, a status, the
value condition under which the status applies, why, and what to do (engine/config/support_entry.py).
The rows live in support_read.py (keys the engine reads) and support_refused.py (what it refuses or warns
about); this module checks a config against them and writes the docs table. Implementing a feature later
means flipping its row from REFUSED to IMPLEMENTED, nothing else.

- REFUSED: ignoring the key would silently change results or the memory/parallel plan, so loading fails
  with a ConfigError that names the key and the fix.
- WARNED: ignoring it cannot change the trained numbers (logging, profiling, I/O tuning); a
  ConfigWarning is emitted once per key per process.
- IMPLEMENTED: read into EngineConfig and acted on. ACCEPTED: read, harmless, no effect, no warning.
  ALIAS: another spelling, renamed by engine/config/aliases.py before this table is consulted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.config import paths
from engine.config.support_entry import PRESENT, Entry, Status
from engine.config.support_read import READ_ENTRIES
from engine.config.support_refused import REFUSED_ENTRIES

# Rows are kept in this order in docs/config-keys.md: what the engine reads, then what it refuses or warns about.
TABLE: tuple[Entry, ...] = READ_ENTRIES + REFUSED_ENTRIES


def _value_text(value: Any) -> str:
    """The value as the user wrote it (JSON), shortened for whole sections."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def check_support(
    config: Mapping[str, Any], origins: Mapping[str, str] | None = None
) -> tuple[list[str], list[tuple[str, str]]]:
    """(refusal messages, (key, warning) pairs) for the canonical config."""
    origins = origins or {}
    problems: list[str] = []
    warned: list[tuple[str, str]] = []
    for entry in TABLE:
        if entry.status not in (Status.REFUSED, Status.WARNED):
            continue
        value = paths.get(config, paths.split(entry.path))
        if value is None or not entry.when.test(value):
            continue
        origin = _origin(entry.path, origins)
        written = f" (from {origin})" if origin else ""
        head = f"{entry.path}: {_value_text(value)}{written}"
        if entry.status is Status.REFUSED:
            problems.append(f"{head} is not supported: {entry.reason}; fix: {entry.fix}")
        else:
            message = f"{head} is accepted but has no effect here: {entry.reason}; {entry.fix}"
            warned.append((entry.path, message))
    return problems, warned


def _origin(path: str, origins: Mapping[str, str]) -> str | None:
    """What the user wrote for `path`, when it (or a section above it) was renamed from another key."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in origins:
            rest = parts[cut:]
            return ".".join([origins[head], *rest])
    return None


def support_table_markdown() -> str:
    """The table docs/config-keys.md embeds (a test checks the file matches)."""
    rows = ["| key | status | when | why | what to do |", "| --- | --- | --- | --- | --- |"]
    for entry in TABLE:
        when = "" if entry.when is PRESENT else f"`{entry.when.text}`"
        cells = [f"`{entry.path}`", entry.status.value, when, entry.reason, entry.fix]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- config-keys:begin -->", "<!-- config-keys:end -->"
DOC_FILE = Path(__file__).resolve().parents[2] / "docs" / "config-keys.md"


def render_doc(text: str) -> str:
    """`text` with the generated table between the markers."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"markers {BEGIN} / {END} not found")
    return pattern.sub(lambda _: f"{BEGIN}\n{support_table_markdown()}{END}", text)


def write_docs(doc_file: Path = DOC_FILE) -> None:
    """Regenerate the table in docs/config-keys.md:
    python -c "from engine.config.support import write_docs; write_docs()"
    """
    doc_file.write_text(render_doc(doc_file.read_text(encoding="utf-8")), encoding="utf-8")
