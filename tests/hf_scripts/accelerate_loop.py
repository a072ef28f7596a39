"""A plain Accelerate training loop on the engine, written as Accelerate's users write it for DeepSpeed:
`Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict))`, `accelerator.prepare(model, optimizer,
loader)`, `accelerator.backward`, `optimizer.step()`, `save_state`/`load_state`, `get_state_dict`,
`free_memory`. The engine is found through the `deepspeed` compatibility distribution on PYTHONPATH.
Run by tests/test_hf_accelerate.py, one rank plainly or more under zrun.

One run (rank 0 writes REPORT_DIR/report.json and the .pt files):
1. train STEPS steps from the model seeded with SEED, `save_state` after SAVE_AT of them, then
   `get_state_dict` (final.pt) and `free_memory` (the engine must be destroyed);
2. in the same process, a second `Accelerator()` (it shares the first one's state, so the same plugin)
   builds a second engine from a model seeded differently, `load_state` of the saved folder,
   skips the batches already seen and trains the remaining steps (resumed_final.pt);
3. on rank 0, the reference: plain torch in one process, the same initial model, the whole global
   batch each step, torch's AdamW, the same clipping and lr schedule (reference.pt).
With --resume_only only step 2 runs, in a fresh process, from a folder saved by an earlier run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType, DummyOptim, DummyScheduler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED = 11
DIM_IN, HIDDEN, DIM_OUT = 7, 31, 5  # odd sizes: shards and buckets do not fall on parameter boundaries
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8
CLIP = 2.0  # between the gradient norms of different steps (the test checks): clipping both bites and does not
WARMUP_STEPS = 3
BUCKET = 97  # elements: several reduce (and, at stage 3, gather) buckets in a 470-parameter model


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM_IN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, DIM_OUT))


def dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randn(samples, DIM_IN, generator=g), torch.randn(samples, DIM_OUT, generator=g))


def ds_config(stage: int, config_optimizer: bool) -> dict[str, Any]:
    """As Accelerate users write it: batch sizes "auto" (Accelerate fills them from the DataLoader),
    clipping explicit (absent, Accelerate would write 1.0 itself)."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": BUCKET}
    if stage == 3:
        # Threshold 0: every parameter is partitioned (the default would keep this tiny model whole);
        # gathering at save is what accelerator.get_state_dict needs at stage 3.
        zero.update(
            {
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": BUCKET,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
    }
    if config_optimizer:  # built by the engine; DummyOptim/DummyScheduler stand for them in the loop
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "betas": list(BETAS), "eps": EPS},
        }
        config["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "warmup_type": "linear",
            },
        }
    return config


def warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR (linear, min 0) for optimizer step `step` (0-based): construction sets the lr
    of iteration -1 (the min) and each step advances one iteration afterwards, so step k runs at
    iteration k - 1."""
    iteration = step - 1
    return 0.0 if iteration < 0 else LR * min(1.0, iteration / WARMUP_STEPS)


class Loop:
    """One engine's training through Accelerate, recording the global mean loss and the engine's grad norm."""

    def __init__(self, accelerator: Accelerator, args: argparse.Namespace, seed: int) -> None:
        self.accelerator, self.args = accelerator, args
        model = build_model(seed)
        loader = DataLoader(dataset(args.steps * args.batch * accelerator.num_processes), batch_size=args.batch)
        if args.config_optimizer:
            optimizer: Any = DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            scheduler: Any = DummyScheduler(optimizer, warmup_num_steps=WARMUP_STEPS)
            self.model, self.optimizer, self.loader, self.scheduler = accelerator.prepare(
                model, optimizer, loader, scheduler
            )
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
            self.model, self.optimizer, self.loader = accelerator.prepare(model, optimizer, loader)
            self.scheduler = None
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def describe(self) -> dict[str, Any]:
        from engine.runtime.engine import Engine  # deepspeed.DeepSpeedEngine is this class

        params = list(self.model.module.parameters())
        return {
            "engine_type": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "is_engine": isinstance(self.model, Engine),  # not DDP: prepare went through deepspeed.initialize
            "stage": self.model.zero_optimization_stage(),
            "params": len(params),
            # Stage 3 outside forward: a partitioned parameter is empty, its full shape kept in ds_shape.
            "partitioned": sum(hasattr(p, "ds_shape") and p.numel() == 0 for p in params),
            "config": self.accelerator.deepspeed_config,
        }

    def train(self, first: int, last: int, save_dir: Path | None = None) -> None:
        """Steps first..last-1 (0-based); `save_state(save_dir)` after step args.save_at - 1."""
        loader = self.accelerator.skip_first_batches(self.loader, first) if first else self.loader
        for step, (x, y) in enumerate(loader, start=first):
            if step == last:
                break
            loss = F.mse_loss(self.model(x), y)
            self.accelerator.backward(loss)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad()
            self.losses.append(self.accelerator.gather(loss.detach().reshape(1)).mean().item())
            self.grad_norms.append(float(self.model.get_global_grad_norm()))
            if save_dir is not None and step + 1 == self.args.save_at:
                self.accelerator.save_state(str(save_dir))

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """accelerator.get_state_dict on every rank (at stage 3 a collective); rank 0's copy."""
        state = self.accelerator.get_state_dict(self.model)
        return state if self.accelerator.is_main_process else None


def reference(args: argparse.Namespace, world: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Plain torch, one process, each step on the whole global batch: Accelerate hands rank r batch r of
    every `world` consecutive batches, so global batch k is samples [k*B*world, (k+1)*B*world), and the mean
    of the ranks' mean losses is its mean loss (equal batch sizes)."""
    model = build_model(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    loader = DataLoader(dataset(args.steps * args.batch * world), batch_size=args.batch * world)
    for step, (x, y) in enumerate(loader):
        if args.config_optimizer:
            for group in optimizer.param_groups:
                group["lr"] = warmup_lr(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_destroyed(model: Any) -> bool:
    try:
        model.memory_report()  # any call that needs the engine's ZeRO stage
    except RuntimeError as err:
        return "destroyed" in str(err)
    return False


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument(
        "--config_optimizer",
        action="store_true",
        help="optimizer and WarmupLR in the config, DummyOptim/DummyScheduler in the loop",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_at", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--state_dir", type=Path, required=True, help="accelerator.save_state folder")
    parser.add_argument("--report_dir", type=Path, required=True)
    parser.add_argument("--resume_only", action="store_true", help="only load_state from --state_dir and continue")
    return parser.parse_args()


def main() -> None:
    args = parse()
    # Accelerate 1.15 takes the DeepSpeed path only when its AcceleratorState is built with cpu=False
    # (`elif ACCELERATE_USE_DEEPSPEED and not cpu` in AcceleratorState.__init__): with
    # Accelerator(cpu=True) it silently trains with plain DDP (MULTI_CPU) and never calls
    # deepspeed.initialize. Without cpu=True, PartialState looks for an accelerator device, finds none
    # and counts one process at any world size. So, as TrainingArguments(use_cpu=True) does for Trainer:
    # PartialState(cpu=True) first (gloo, the real world size), then an Accelerator without cpu=True,
    # which passing a deepspeed_plugin turns into DeepSpeed (it sets ACCELERATE_USE_DEEPSPEED=true).
    PartialState(cpu=True)
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(args.stage, args.config_optimizer))
    )
    world = accelerator.num_processes
    report: dict[str, Any] = {
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": world,
        "deepspeed": accelerator.distributed_type == DistributedType.DEEPSPEED,
    }
    files: dict[str, dict[str, torch.Tensor] | None] = {}
    if not args.resume_only:
        first = Loop(accelerator, args, SEED)
        report["first"] = first.describe()
        first.train(0, args.steps, args.state_dir)
        report.update(losses=first.losses, grad_norms=first.grad_norms)
        files["final"] = first.state_dict()
        accelerator.free_memory()
        report["destroyed_by_free_memory"] = engine_destroyed(first.model)
        del first
        accelerator = Accelerator()  # a second Accelerator shares the state, hence the DeepSpeed plugin
    second = Loop(accelerator, args, SEED + 1)  # another initial model: only load_state can make it match
    report["second"] = second.describe()
    accelerator.load_state(str(args.state_dir))
    second.train(args.save_at, args.steps)
    report.update(resumed_losses=second.losses, resumed_grad_norms=second.grad_norms)
    files["resumed_final"] = second.state_dict()
    if accelerator.is_main_process:
        if not args.resume_only:
            report["reference_losses"], report["reference_grad_norms"], files["reference"] = reference(args, world)
        args.report_dir.mkdir(parents=True, exist_ok=True)
        for name, state in files.items():
            torch.save(state, args.report_dir / f"{name}.pt")
        (args.report_dir / "report.json").write_text(json.dumps(report, default=str))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
