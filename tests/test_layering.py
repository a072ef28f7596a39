"""Structure rules that keep the code base honest (STYLE.md item 18)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_only_comm_calls_torch_distributed() -> None:
    # Collectives everywhere else go through engine/comm/, so bytes are counted and a faster
    # gloo implementation replaces them in one place.
    pattern = re.compile(r"torch\.distributed|import torch\.distributed|from torch import distributed")
    offenders = []
    comm = ROOT / "engine" / "comm"
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if path.is_relative_to(comm):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "torch.distributed used outside engine/comm/:\n" + "\n".join(offenders)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.*?)```", readme, re.S)
    assert block, "README.md must show the test command after a <!-- test-command --> marker"
    command = block.group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci, f".ci/run must run the README's test command verbatim:\n{command}"
