"""The benchmarks' shared workload: two GPT-style decoders, S and M (vocab 8192, sequences of 128, micro
batch 8), the sizes at which DeepSpeed's, DDP's and FSDP2's step times were measured on a 2-core CPU
machine, so the engine's numbers compare with theirs; and the random batches every variant trains on
(same on every run, per rank)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from gpt import GPTConfig

from engine import comm

MODELS = {
    "S": GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_layers=4, n_heads=4),
    "M": GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8),
}
MICRO = 8
"""Sequences per rank per step."""


def batches(cfg: GPTConfig, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + comm.get_rank())
    return [
        (
            torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=g),
        )
        for _ in range(n)
    ]
