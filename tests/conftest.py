"""Test collection settings shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from engine.ops import builder

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
    first build takes seconds (minutes on an overloaded machine), which inside a rank of a distributed
    test would count against that test's timeout. Spawned ranks then load the cached library."""
    builder.load()


@pytest.fixture(scope="module")
def ext() -> Iterator[ModuleType]:
    """The compiled CPU extension, with ZERO_ENGINE_OPS=require: a broken build fails the test instead
    of silently testing the fallback against itself."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(builder.ENV_MODE, "require")
        builder.reset_for_tests()
        try:
            module = builder.load()
            assert module is not None
            yield module
        finally:
            builder.reset_for_tests()


@pytest.fixture(scope="session")
def deepspeed_compat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """compat/deepspeed installed with pip into a folder of its own (put it on PYTHONPATH): the
    `deepspeed` distribution Hugging Face's clients look for, without touching this environment."""
    from hf_clients import install_compat

    return install_compat(tmp_path_factory.mktemp("deepspeed_compat"))
