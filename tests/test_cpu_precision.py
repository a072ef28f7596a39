"""The warning for bf16/fp16 compute on a CPU without native low-precision matmuls: at initialize
(once per node) and in `python -m engine.report`."""

from __future__ import annotations

import logging

import pytest
import torch

import engine
from engine import report
from engine.precision import cpu_precision

AVX2_ONLY = {"fpu", "sse4_2", "avx", "avx2", "fma"}


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_low_precision_without_native_matmul_is_named_with_the_fix(dtype: torch.dtype, name: str) -> None:
    message = cpu_precision.slow_low_precision(dtype, AVX2_ONLY)
    assert message is not None and message.startswith(f"{name} compute on this CPU")
    assert "slower than fp32" in message and "train in fp32" in message
    for flag in cpu_precision.NATIVE_FLAGS[dtype]:  # either instruction set is native
        assert cpu_precision.slow_low_precision(dtype, AVX2_ONLY | {flag}) is None
    assert cpu_precision.slow_low_precision(torch.float32, AVX2_ONLY) is None
    assert cpu_precision.slow_low_precision(dtype, set()) is None  # flags unreadable: no claim


def _initialize(config: dict) -> None:
    model = torch.nn.Linear(4, 4)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    eng.destroy()


def test_initialize_warns_for_bf16_on_an_avx2_cpu_and_not_for_fp32(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: AVX2_ONLY)
    base = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with caplog.at_level(logging.WARNING, logger="engine"):
        _initialize({**base, "bf16": {"enabled": True}})
        bf16 = [r.message for r in caplog.records if "no native bf16 matmul" in r.message]
        caplog.clear()
        _initialize(base)
    assert len(bf16) == 1, bf16
    assert not [r for r in caplog.records if "native" in r.message]
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: AVX2_ONLY | {"avx512_bf16"})
    with caplog.at_level(logging.WARNING, logger="engine"):
        _initialize({**base, "bf16": {"enabled": True}})
    assert not [r for r in caplog.records if "native" in r.message]


def test_report_says_which_low_precision_matmuls_are_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: AVX2_ONLY | {"amx_bf16"})
    text = "\n".join(report.lines())
    assert "CPU bf16 matmul ......... native (amx_bf16)" in text
    assert "CPU fp16 matmul ......... converted per element" in text
    assert "WARNING: fp16 compute on this CPU" in text and "WARNING: bf16" not in text
