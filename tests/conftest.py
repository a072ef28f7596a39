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


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build (or load from the cache) the C++ extension once, in this process, before any test: the
    first build takes a minute or two, which inside a rank of a distributed test would run into that
    test's timeout. Spawned ranks then load the cached library."""
    from engine.ops import builder

    builder.load()
