"""The CUDA side of the extension without a GPU: its sources compile with nvcc (for sm_80 and sm_90),
the compile check reports what it cannot do, and the CUDA loader declines cleanly where CUDA is
unavailable. The CUDA ops' results are tested on a GPU by tests/gpu (python -m pytest tests/gpu -q)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
import torch

from engine.ops import cuda_builder


def test_cuda_sources_compile_with_nvcc() -> None:
    # The CI's guard against CUDA syntax and type errors on machines without a GPU. The first run
    # compiles; later runs with unchanged sources, nvcc and torch hit the cache.
    ok, log = cuda_builder.compile_check()
    if cuda_builder.find_nvcc() is None:
        assert not ok and "nvcc not found" in log, log
        return
    assert ok, f"the CUDA sources do not compile:\n{log}"
    started = time.perf_counter()
    ok_again, log_again = cuda_builder.compile_check()
    assert ok_again and log_again.startswith("cached:"), log_again
    assert time.perf_counter() - started < 10, "an unchanged source tree must not be compiled again"


def test_compile_check_names_a_missing_nvcc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvcc, no compiler
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    ok, log = cuda_builder.compile_check()
    assert not ok
    assert "nvcc not found" in log and "CUDA_HOME" in log, log


def test_compile_check_fails_on_a_compile_error(tmp_path: Path) -> None:
    (tmp_path / "broken.cu").write_text("__global__ void scale(float* x) { x[threadIdx.x] *= 2.0f }\n")  # no ';'
    ok, log = cuda_builder.compile_check(tmp_path)
    assert not ok
    if cuda_builder.find_nvcc() is None:
        assert "nvcc not found" in log, log
        return
    assert "broken.cu" in log and "error" in log, log
    assert not cuda_builder.compile_check(tmp_path)[0], "a failed check must not be remembered as a success"


def test_compile_check_needs_cuda_sources(tmp_path: Path) -> None:
    ok, log = cuda_builder.compile_check(tmp_path)
    assert not ok
    expected = "nvcc not found" if cuda_builder.find_nvcc() is None else "no .cu sources"
    assert expected in log, log


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_cuda_loader_declines_without_cuda(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # No CUDA is not a build failure, even under require: there is nothing for CUDA ops to run on.
    monkeypatch.setenv("ZERO_ENGINE_OPS", mode)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda_builder.reset_for_tests()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cuda_builder.load() is None
        status = cuda_builder.status()
        assert status.state == "fallback"
        assert "CUDA is not available" in status.reason, status.reason
        if torch.version.cuda is None:
            assert "CPU build" in status.reason, status.reason
    finally:
        cuda_builder.reset_for_tests()


def test_cuda_loader_honours_forced_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERO_ENGINE_OPS", "fallback")
    cuda_builder.reset_for_tests()
    try:
        assert cuda_builder.load() is None
        assert cuda_builder.status().reason == "forced by ZERO_ENGINE_OPS=fallback"
    finally:
        cuda_builder.reset_for_tests()


def test_cuda_loader_rejects_an_unknown_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERO_ENGINE_OPS", "sometimes")
    cuda_builder.reset_for_tests()
    try:
        with pytest.raises(ValueError, match="auto .*fallback or require"):
            cuda_builder.load()
    finally:
        cuda_builder.reset_for_tests()
