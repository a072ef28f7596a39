"""Unknown top-level keys, treated the way DeepSpeed treats them, except likely typos.

DeepSpeed's DeepSpeedConfig reads the top-level keys it knows from a plain dict and ignores the rest, so
configs in the wild carry comments ("_comment"), launcher settings ("cuda_visible_devices"), other tools'
sections ("comms_config", "monitor_config") and dotted keys TRL writes ("zero_optimization.reduce_bucket_size",
which DeepSpeed never reads). The engine loads them too:

- a key starting with "_" is a comment: dropped silently;
- a dotted key whose head is a known section: ignored, with a warning naming the nested form to write;
- a key close to a known key (a likely typo, e.g. "zero_optimisation"): still refused with the suggestion,
  since training on as if it were absent (stage 0 for a misspelled zero_optimization) is worse than DeepSpeed's
  silence;
- any other key: ignored, with a warning naming it.

Inside sections the schema stays closed (schema.json), as DeepSpeed's pydantic section models forbid extra
keys (runtime/config_utils.py, DeepSpeedConfigModel: extra="forbid").
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from engine.config.paths import closest

TYPO_CUTOFF = 0.8
"""difflib ratio from which an unknown top-level key counts as a typo of a known one. Typos score 0.84 and up
("train_micro_batch_size" 0.85, "optimiser" 0.89, "zero_optimisation" 0.94); keys shipped configs carry for
other tools score lower ("comms_config" vs comms_logger 0.67, "monitor_config" vs csv_monitor 0.56,
"tensorboard_config" vs tensorboard 0.76). Nested unknown keys keep the looser suggestion cutoff (0.6): they
are refused whatever the score."""


@dataclass
class Ignored:
    """The top-level keys load_config leaves out, and what to say about them."""

    warnings: list[tuple[str, str]] = field(default_factory=list)
    """(warn-once key, message) for each ignored key that is not a comment."""


def drop_ignored_keys(config: dict[str, Any], known: Collection[str]) -> Ignored:
    """Remove ignored top-level keys from `config` in place; likely typos stay for the schema to refuse."""
    ignored = Ignored()
    for key in [k for k in config if k not in known]:
        if key.startswith("_"):
            del config[key]
            continue
        head, dot, rest = key.partition(".")
        if dot and head in known:
            nested = json.dumps({head: _nest(rest, config[key])}, default=repr)
            ignored.warnings.append(
                (
                    f"top-level:{key}",
                    (
                        f"{key}: a dotted top-level key is ignored, as DeepSpeed ignores it (it reads nested sections only); "
                        f"to set it, write it nested: {_short(nested)}"
                    ),
                )
            )
            del config[key]
        elif closest(key, known, cutoff=TYPO_CUTOFF) is None:
            ignored.warnings.append(
                (
                    f"top-level:{key}",
                    (
                        f"{key}: unknown top-level key, ignored (DeepSpeed ignores unknown top-level keys too); if it was "
                        'meant as a setting, see docs/config-keys.md for the keys read; start its name with "_" to mark '
                        "it as a comment"
                    ),
                )
            )
            del config[key]
    return ignored


def _nest(dotted_rest: str, value: Any) -> Any:
    """ "a.b", v -> {"a": {"b": v}}."""
    for part in reversed(dotted_rest.split(".")):
        value = {part: value}
    return value


def _short(text: str) -> str:
    return text if len(text) <= 120 else text[:117] + "..."
