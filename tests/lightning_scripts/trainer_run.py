"""PyTorch Lightning's Trainer with its DeepSpeedStrategy on the engine, written as Lightning's users
write it; the engine is found through the `deepspeed` compatibility distribution on PYTHONPATH. Run by
tests/test_lightning.py at 2 ranks:

    python -m launcher.zrun --nproc_per_node 2 tests/lightning_scripts/trainer_run.py OUT_DIR

One launch, every run a fresh model (built in `configure_model`, seeded: under deepspeed.zero.Init at
stage 3) and a fresh Trainer over the same data (Lightning's DistributedSampler, shuffled per epoch),
AdamW with a per-step warmup schedule from `configure_optimizers`, 2 epochs of 4 steps:
- `ddp`: Lightning's DDPStrategy (gloo), fp32: the reference; its final weights in ddp_final.pt;
  `ddp_gas2`: the same with accumulate_grad_batches=2;
- `stage1`: DeepSpeedStrategy(stage=1) with Lightning's default DeepSpeed config; `stage2_gas2`:
  stage=2, small buckets, accumulate_grad_batches=2 (Lightning writes it into the config and calls
  optimizer.zero_grad() at each window start);
- `stage3`: a DeepSpeed config dict (every parameter partitioned); the first epoch, save_checkpoint,
  then a new Trainer resumes with fit(ckpt_path=...) for the second (exclude_frozen_parameters=True)
  and saves again; rank 0 converts that checkpoint with convert_zero_checkpoint_to_fp32_state_dict
  (final.pt) and loads it with load_from_checkpoint. A callback reads Lightning's DeepSpeedSummary
  (the stage-3 model summary) at fit start on every rank;
- `bf16_stage1..3`: precision="bf16-mixed" at each stage;
- `compiled_stage1`, `compiled_stage3`: the network compiled in place in configure_model (`net.compile()`,
  inductor) at stages 1 and 3.
Rank 0 writes report.json: every run's per-rank losses, the summary, the converted file's keys.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from cpu_deepspeed import CPUDeepSpeedStrategy
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
from lightning.pytorch.utilities.model_summary import DeepSpeedSummary
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED, DATA_SEED = 3, 5
DIM_IN, HIDDEN, DIM_OUT = 7, 31, 5  # odd sizes: shards and buckets do not fall on parameter boundaries
SAMPLES, BATCH = 32, 4  # per rank: 4 steps an epoch at 2 ranks
EPOCHS = 2
BUCKET = 97  # elements: several reduce (and, at stage 3, gather) buckets in this model
CLIP = 1.0  # gradient_clip_val (Lightning writes it into the DeepSpeed config); it bites at some steps


class Regressor(pl.LightningModule):
    """An MLP and a frozen output projection (requires_grad=False: exclude_frozen_parameters has
    something to leave out), built in configure_model as Lightning recommends for sharded models."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: nn.Module | None = None
        self.proj: nn.Module | None = None
        self.losses: list[float] = []
        self.compile_net = False

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(SEED)
        self.net = nn.Sequential(nn.Linear(DIM_IN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, DIM_OUT))
        if self.compile_net:
            # Lightning's Trainer refuses a torch.compile'd LightningModule under DeepSpeedStrategy (its own
            # check, as for DeepSpeed): its users compile the network inside, in place (same parameter names).
            self.net.compile()
        self.proj = nn.Linear(DIM_OUT, DIM_OUT)
        self.proj.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None and self.proj is not None
        return self.proj(self.net(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y.float()), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr, weight_decay=0.01
        )
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class SummaryProbe(pl.Callback):
    """What Lightning's ModelSummary callback shows under DeepSpeed stage 3, read on every rank."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = DeepSpeedSummary(pl_module, max_depth=-1)
        columns = dict(summary._get_summary_data())  # the table Lightning prints
        self.seen = {
            "total": summary.total_parameters,
            "trainable": summary.trainable_parameters,
            "layers": columns["Name"],
            "per_device": columns["Params per Device"],
            "params": columns["Params"],
            "text": str(summary),
        }


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(DATA_SEED)
    data = TensorDataset(torch.randn(SAMPLES, DIM_IN, generator=g), torch.randn(SAMPLES, DIM_OUT, generator=g))
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def fit(
    strategy: Any,
    *,
    precision: str = "32-true",
    epochs: int = EPOCHS,
    accumulate: int = 1,
    ckpt_path: str | None = None,
    callbacks: list[pl.Callback] | None = None,
    compiled: bool = False,
) -> tuple[pl.Trainer, Regressor]:
    """Clipping only without accumulation: with accumulate_grad_batches=k Lightning divides the loss by k
    and DeepSpeed's backward divides it again (real DeepSpeed too), so the norm the engine clips is
    1/k of DDP's; AdamW itself does not see the scale."""
    model = Regressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP if accumulate == 1 else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    model.compile_net = compiled
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, model


def per_rank(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def deepspeed(stage: int, **kwargs: Any) -> CPUDeepSpeedStrategy:
    if stage < 3:
        return CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo", **kwargs)
    # As users write a stage-3 config: threshold 0 partitions every parameter (the default would keep this
    # tiny model whole on every rank).
    config = {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": BUCKET,
            "stage3_prefetch_bucket_size": BUCKET,
        }
    }
    return CPUDeepSpeedStrategy(config=config, process_group_backend="gloo", **kwargs)


def main(out: Path) -> None:
    report: dict[str, Any] = {"losses": {}}
    losses = report["losses"]

    trainer, ddp = fit(DDPStrategy(process_group_backend="gloo"))
    losses["ddp"] = per_rank(ddp.losses)
    report["val_loss"] = {"ddp": trainer.validate(ddp, loader(), verbose=False)[0]["val_loss"]}
    if dist.get_rank() == 0:
        torch.save(ddp.state_dict(), out / "ddp_final.pt")
    losses["ddp_gas2"] = per_rank(fit(DDPStrategy(process_group_backend="gloo"), accumulate=2)[1].losses)

    trainer, stage1 = fit(deepspeed(1))
    losses["stage1"] = per_rank(stage1.losses)
    # validate() alone: Lightning builds a second, inference-only engine (no optimizer) on the trained model
    report["val_loss"]["stage1"] = trainer.validate(stage1, loader(), verbose=False)[0]["val_loss"]
    small = {"reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    losses["stage2_gas2"] = per_rank(fit(deepspeed(2, **small), accumulate=2)[1].losses)

    probe = SummaryProbe()
    first, half = fit(deepspeed(3), epochs=1, callbacks=[probe])
    first.save_checkpoint(out / "mid.ckpt")
    report["summary"] = per_rank(probe.seen)
    resumed, rest = fit(deepspeed(3, exclude_frozen_parameters=True), ckpt_path=str(out / "mid.ckpt"))
    losses["stage3"] = per_rank(half.losses + rest.losses)
    report["resumed_global_step"] = resumed.global_step
    resumed.save_checkpoint(out / "final.ckpt")
    if dist.get_rank() == 0:
        converted = convert_zero_checkpoint_to_fp32_state_dict(out / "final.ckpt", out / "final.pt")
        report["converted_keys"] = sorted(converted)
        restored = Regressor.load_from_checkpoint(out / "final.pt", strict=False)
        report["restored_equals_converted"] = all(
            torch.equal(value, converted["state_dict"][name])
            for name, value in restored.state_dict().items()
            if name in converted["state_dict"]
        )
    dist.barrier()

    for stage in (1, 2, 3):
        losses[f"bf16_stage{stage}"] = per_rank(fit(deepspeed(stage), precision="bf16-mixed")[1].losses)

    report["net_compiled"] = {}
    for stage in (1, 3):
        _, model = fit(deepspeed(stage), compiled=True)
        losses[f"compiled_stage{stage}"] = per_rank(model.losses)
        report["net_compiled"][stage] = getattr(model.net, "_compiled_call_impl", None) is not None

    if dist.get_rank() == 0:
        (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
