"""One rank of benchmarks/bench_hpz.py: stage 3 with or without hpZ on an MLP, step times and bytes sent.

    RANK=.. WORLD_SIZE=4 LOCAL_RANK=.. LOCAL_WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. \\
        python benchmarks/hpz_worker.py HPZ OUT.json

Rank 0 writes OUT.json: the hpZ size, the timed steps' seconds (each ends with a barrier) and the bytes this
rank sent per collective and group during them (engine.comm.comm_stats).
"""

from __future__ import annotations

import json
import sys
import time

import torch

import engine

WIDTH, LAYERS, MICRO, WARMUP, TIMED = 1024, 8, 4, 2, 6


def main() -> None:
    hpz, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "zero_hpz_partition_size": hpz,
            "stage3_param_persistence_threshold": 0,
            # a large model's regime: a unit does not stay gathered from its forward to its backward
            "stage3_max_live_parameters": 2_000_000,
            "stage3_max_reuse_distance": 2_000_000,
        },
    }
    eng, *_ = engine.initialize(model=model, config=config)
    rank = torch.distributed.get_rank()
    x = torch.randn(MICRO, WIDTH, generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(WARMUP + TIMED):
        if step == WARMUP:
            before = engine.comm.comm_stats()["bytes_sent"]
        torch.distributed.barrier()
        start = time.perf_counter()
        eng.backward(eng(x).square().mean())
        eng.step()
        torch.distributed.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    sent = {k: v - before.get(k, 0) for k, v in engine.comm.comm_stats()["bytes_sent"].items()}
    if rank == 0:
        params = sum(p.ds_numel for p in model.parameters()) * 4
        with open(out, "w") as f:
            json.dump(
                {"hpz": hpz, "step_s": times, "sent": {k: v for k, v in sent.items() if v}, "param_bytes": params}, f
            )
    eng.destroy()


if __name__ == "__main__":
    main()
