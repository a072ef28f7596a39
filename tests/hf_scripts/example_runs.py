"""examples/hf_trainer.py's main(), once per argument list, in turn in one process: the Trainer tests' runs
at one world size share one start-up (importing transformers, accelerate and the engine costs each rank
seconds of every launch). Each run is what `examples/hf_trainer.py ARGS` would run: main() reads its flags
from sys.argv and seeds everything itself.

    zrun --nproc_per_node 2 tests/hf_scripts/example_runs.py RUNS.json

RUNS.json: a JSON list of argument lists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    sys.path.insert(0, str(EXAMPLE.parent))
    import hf_trainer

    for args in runs:
        sys.argv = [str(EXAMPLE), *args]
        hf_trainer.main()


if __name__ == "__main__":
    main()
