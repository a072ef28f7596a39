"""Fixture: a healthy 2+ rank gloo job that checks an all-reduce sum and prints per rank."""

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    # Everything comes from the environment torchrun sets; no --local_rank needed.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    if t.item() != expected:
        print(f"rank {rank}: bad sum {t.item()} != {expected}", flush=True)
        return 3
    print(
        f"ALLREDUCE_OK rank={rank} world={world} local_rank={os.environ['LOCAL_RANK']} "
        f"omp={os.environ.get('OMP_NUM_THREADS')} threads={torch.get_num_threads()} argv={sys.argv[1:]}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
