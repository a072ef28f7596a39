"""The extension's loader on a machine that cannot build it: one warning naming what is missing and the
fallbacks (auto), or a clear error (require); checked in fresh processes with no C++ compiler."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "from engine.ops import builder; print('module:', builder.load()); print('state:', builder.status().state)"


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CXX": "/nonexistent/c++", "ZERO_ENGINE_OPS": mode}
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", PROBE], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def test_without_a_compiler_the_fallbacks_run_after_one_named_warning() -> None:
    out = _run("auto")
    assert out.returncode == 0, out.stderr
    assert "module: None" in out.stdout and "state: fallback" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1 and "no C++ compiler (/nonexistent/c++ not on PATH)" in warnings[0], out.stderr


def test_without_a_compiler_require_is_an_error_naming_the_cause() -> None:
    out = _run("require")
    assert out.returncode != 0
    assert "ZERO_ENGINE_OPS=require but the C++ extension is unavailable: no C++ compiler" in out.stderr


def test_cuda_loader_on_a_cuda_machine_without_nvcc_warns_or_fails_by_name(monkeypatch) -> None:
    import pytest
    import torch
    from torch.utils import cpp_extension

    from engine.ops import cuda_builder

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # reach the build checks on this CPU box
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setenv("ZERO_ENGINE_OPS", "auto")
    cuda_builder.reset_for_tests()
    with pytest.warns(RuntimeWarning, match=r"CUDA extension unavailable \(the CUDA toolkit was not found"):
        assert cuda_builder.load() is None
    monkeypatch.setenv("ZERO_ENGINE_OPS", "require")
    cuda_builder.reset_for_tests()
    with pytest.raises(RuntimeError, match="require but the CUDA extension is unavailable: the CUDA toolkit"):
        cuda_builder.load()
    cuda_builder.reset_for_tests()


def _pip_wheel(tmp_path, extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "ZERO_ENGINE_BUILD_OPS": "1", **extra_env}
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v", "-w", str(tmp_path), root],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def test_install_option_builds_the_extension_ahead_of_time(tmp_path) -> None:
    """ZERO_ENGINE_BUILD_OPS=1 at install (setup.py's build_py) fills the same cache a training run
    uses (here already built by the test session, so it reports the cached build), and a build that
    cannot happen fails the install by name instead of installing a package that warns later."""
    ok = _pip_wheel(tmp_path / "ok", {})
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "engine.ops.build: extension cached" in ok.stdout + ok.stderr
    failed = _pip_wheel(tmp_path / "failed", {"CXX": "/nonexistent/c++", "ZERO_ENGINE_CACHE": str(tmp_path / "cache")})
    assert failed.returncode != 0
    assert "ZERO_ENGINE_BUILD_OPS=1: the C++ extension did not build" in failed.stdout + failed.stderr
