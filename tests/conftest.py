"""Test collection settings shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest

# tests/gpu needs a CUDA GPU: the default run (`pytest -q`, the CPU CI) leaves it out; naming it runs it,
# e.g. `python -m pytest tests/gpu -q` on a GPU machine.
GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.resolve() != GPU_TESTS:
        return None
    named = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    if any(path == GPU_TESTS or GPU_TESTS in path.parents for path in named):
        return None
    return True
