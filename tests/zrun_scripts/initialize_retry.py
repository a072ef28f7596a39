"""Failed engine.initialize calls followed by retries in the same processes, then a training step and
destroy(), three rounds (tests/test_initialize_agreement.py). Prints one JSON line per rank."""

import json
import os
import sys

import torch

import engine
from engine.config import ConfigError
from engine.initialize.rank_agreement import RankMismatchError

RANK = int(os.environ["RANK"])


def config(**extra: object) -> dict:
    return {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1},
        **extra,
    }


def outcome(cfg: dict) -> str:
    try:
        torch.manual_seed(0)  # every round starts from the same model
        eng, *_ = engine.initialize(model=torch.nn.Linear(8, 8), config=cfg)
    except (ValueError, RankMismatchError) as err:
        return type(err).__name__ + ": " + str(err)
    x = torch.ones(2, 8)  # the same batch on every rank: equal losses mean equal parameters
    eng.backward(eng(x).pow(2).mean())
    eng.step()
    loss = float(eng(x).pow(2).mean().detach())
    eng.destroy()
    return f"trained {loss:.6f}"


results = []
for _ in range(3):
    # Refused on every rank: LAMB on flat shards (raised after the parameter broadcast).
    results.append(outcome(config(optimizer={"type": "Lamb", "params": {"lr": 1e-2}})))
    # Refused on rank 1 only, before any collective: rank 0 must hear of it instead of hanging.
    results.append(outcome(config(train_batch_sizee=4) if RANK == 1 else config()))
    results.append(outcome(config()))
print(
    json.dumps(
        {
            "rank": RANK,
            "results": results,
            "group_left": torch.distributed.is_initialized(),
            "config_error_is_value_error": issubclass(ConfigError, ValueError),
        }
    ),
    flush=True,
)
sys.exit(0)
