"""accumulate on a CUDA GPU, bitwise against the CPU torch path (tests/gpu: run on a GPU machine with
`python -m pytest tests/gpu -q`; tests/test_cuda_sources.py compile-checks the kernel everywhere)."""

from __future__ import annotations

import pytest
import torch
from test_ops_accumulate import LARGE, OFFSETS, PAIRS, SCALES, bits, operands

from engine.ops import builder, cuda_builder
from engine.ops.accumulate import accumulate, torch_accumulate


@pytest.mark.parametrize(("dst_dtype", "src_dtype"), PAIRS, ids=[f"{d}+={s}".replace("torch.", "") for d, s in PAIRS])
def test_cuda_op_matches_the_cpu_torch_path_bitwise(
    dst_dtype: torch.dtype, src_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(builder.ENV_MODE, "require")
    cuda_builder.reset_for_tests()
    try:
        assert cuda_builder.load() is not None, cuda_builder.status().reason
        for n in (1, 17, 1000, LARGE):
            for offsets in OFFSETS:
                for scale in SCALES:
                    dst_buf, _, src = operands(n, dst_dtype, src_dtype, offsets, seed=n)
                    want_buf = dst_buf.clone()
                    torch_accumulate(want_buf[offsets[0] : offsets[0] + n], src, scale)
                    got_buf = dst_buf.cuda()
                    accumulate(got_buf[offsets[0] : offsets[0] + n], src.cuda(), scale)
                    assert torch.equal(bits(got_buf.cpu()), bits(want_buf)), (n, offsets, scale)
    finally:
        cuda_builder.reset_for_tests()
