"""Fixture: ZeRO stage-2 training on a fixed global batch; rank 0 writes the losses as JSON to argv[1].

The same global batch is split over however many ranks the launcher started, so the losses depend
on the world size only through the collectives' arithmetic: a 2-node x 2-rank and a 1-node x 4-rank
run must give the same numbers.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/ for models

from models import global_batches, make_model, rank_micro_batch

import engine

STEPS, GLOBAL_BATCH = 6, 16


def main() -> None:
    out = sys.argv[1]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    micro = GLOBAL_BATCH // world
    eng, *_ = engine.initialize(
        model=make_model(0),
        config={
            "train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 64},
        },
    )
    losses = []
    for batch in global_batches(STEPS, GLOBAL_BATCH):
        x, y = rank_micro_batch(batch, rank, world, micro, 0)
        loss = torch.nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        eng.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # the global batch's mean loss, as one process would see it
        losses.append(total.item() / world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "losses": losses}, f)
    print(f"rank {rank} of {world} on {os.uname().nodename} done", flush=True)
    eng.destroy()


if __name__ == "__main__":
    main()
