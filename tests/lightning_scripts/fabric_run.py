"""Lightning Fabric with its DeepSpeedStrategy on the engine, a loop as Fabric's users write it
(`fabric.setup`, `fabric.backward`, `optimizer.step()`, `optimizer.zero_grad()`, `fabric.save`,
`fabric.load`); the engine is found through the `deepspeed` compatibility distribution on PYTHONPATH.
Run by tests/test_lightning.py at 2 ranks:

    python -m launcher.zrun --nproc_per_node 2 tests/lightning_scripts/fabric_run.py OUT_DIR

One launch, every run a fresh Fabric and model (built under fabric.init_module(): deepspeed.zero.Init at
stage 3), seeded, over the same data (Fabric's DistributedSampler, not shuffled), AdamW, 8 steps:
- `ddp`: Fabric's DDPStrategy (gloo), fp32, clipping the gradient norm at 1.0 with
  fabric.clip_gradients: the reference. (Fabric's DeepSpeed config leaves gradient_clipping to
  DeepSpeed, whose default is 1.0; Fabric refuses clip_gradients under DeepSpeed.)
- `stage1..3`: DeepSpeedStrategy(stage=s), fp32; each saves with fabric.save after step 4 (model,
  optimizer and a step counter) and trains on to step 8;
- `loaded1..3`: a new Fabric and a model seeded differently, fabric.load of that checkpoint, steps 5-8;
- `bf16_stage1..3`: precision="bf16-mixed".
Rank 0 writes report.json: every run's per-rank losses and the step counters fabric.load gave back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cpu_deepspeed import CPUFabricDeepSpeedStrategy
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED, OTHER_SEED, DATA_SEED = 3, 4, 5
DIM_IN, HIDDEN, DIM_OUT = 7, 31, 5
SAMPLES, BATCH = 32, 4  # per rank: 4 steps an epoch at 2 ranks
STEPS, SAVE_AT = 8, 4
CLIP = 1.0  # DeepSpeed's default gradient_clipping; it bites at some of these steps


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM_IN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, DIM_OUT))


def batches(fabric: Fabric) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS batches of this rank: the epochs of Fabric's distributed loader, one after another."""
    g = torch.Generator().manual_seed(DATA_SEED)
    data = TensorDataset(torch.randn(SAMPLES, DIM_IN, generator=g), torch.randn(SAMPLES, DIM_OUT, generator=g))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH))
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    while len(out) < STEPS:
        out.extend(loader)
    return out[:STEPS]


def run(
    strategy: Any, precision: str = "32-true", *, seed: int = SEED, save: Path | None = None, load: Path | None = None
) -> dict[str, Any]:
    """Train from step 0 (saving after SAVE_AT steps when `save`), or from the checkpoint `load`; the
    losses of the steps taken and, after a load, the step counter it restored."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
    fabric.launch()
    fabric.seed_everything(seed)
    with fabric.init_module():
        model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if load is not None:
        fabric.load(load, state)
    result: dict[str, Any] = {"losses": [], "start": state["step"]}
    for x, y in batches(fabric)[state["step"] :]:
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        fabric.backward(loss)
        if not isinstance(strategy, CPUFabricDeepSpeedStrategy):
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(loss.item())
        state["step"] += 1
        if save is not None and state["step"] == SAVE_AT:
            fabric.save(save, state)
    return result


def per_rank(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def main(out: Path) -> None:
    losses: dict[str, Any] = {}
    starts: dict[str, Any] = {}
    losses["ddp"] = per_rank(run(DDPStrategy(process_group_backend="gloo"))["losses"])
    for stage in (1, 2, 3):
        saved = out / f"stage{stage}.ckpt"
        losses[f"stage{stage}"] = per_rank(run(deepspeed(stage), save=saved)["losses"])
        loaded = run(deepspeed(stage), seed=OTHER_SEED, load=saved)
        losses[f"loaded{stage}"], starts[f"loaded{stage}"] = per_rank(loaded["losses"]), loaded["start"]
    for stage in (1, 2, 3):
        losses[f"bf16_stage{stage}"] = per_rank(run(deepspeed(stage), "bf16-mixed")["losses"])
    if dist.get_rank() == 0:
        (out / "report.json").write_text(json.dumps({"losses": losses, "starts": starts}, indent=1))


def deepspeed(stage: int) -> CPUFabricDeepSpeedStrategy:
    return CPUFabricDeepSpeedStrategy(stage=stage, process_group_backend="gloo")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
