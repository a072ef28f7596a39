"""`python -m engine.report` as a user runs it: what is compiled, what falls back, and why."""

from __future__ import annotations

import os
import subprocess
import sys


def _report(mode: str) -> str:
    env = {**os.environ, "ZERO_ENGINE_OPS": mode}
    out = subprocess.run(
        [sys.executable, "-m", "engine.report"], capture_output=True, text=True, env=env, check=True, timeout=300
    )
    return out.stdout


def test_report_names_each_op_and_its_path() -> None:
    forced = _report("fallback")
    assert "extension ............. fallback (forced by ZERO_ENGINE_OPS=fallback)" in forced
    for op in ("copy_into / copy_out", "sum_squares_and_overflow", "adam_step", "Arena"):
        assert any(line.startswith(op) and " fallback " in line for line in forced.splitlines()), (op, forced)
    built = _report("require")  # the session already built it (tests/conftest.py): loaded from the cache
    assert "extension ............. cached" in built, built
    assert any(f"SIMD level ............ {level}" in built for level in ("avx512", "avx2", "scalar")), built
    assert "CUDA extension ........ fallback" in built  # this torch has no CUDA: said, not failed
