"""Writes the golden DeepSpeed checkpoints under this folder, with real DeepSpeed (not the engine).

Run it in DeepSpeed's own venv (see SOURCES.md here for the exact versions and command):

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/deepspeed_checkpoints/make_fixtures.py

For each case in CASES, two gloo ranks train `TinyNet` for SAVE_AT steps, save a checkpoint into
<case>/ckpt, and record DeepSpeed's own view of what it saved into <case>/reference.pt: the fp32
masters and Adam moments of every parameter (deepspeed.utils.safe_get_full_fp32_param /
safe_get_full_optimizer_state, read from the live engine); at stages 1-3 the script checks that
zero_to_fp32's consolidation of the saved files equals those masters bitwise, and stops if not. Then two fresh ranks (built from another seed, so nothing but the
checkpoint carries the state) load it with DeepSpeed's load_checkpoint and train RESUME_STEPS more
steps; their losses (the mean over the global batch) go into <case>/expected.json.

The model and data are defined here without DeepSpeed, so tests/test_deepspeed_checkpoints.py imports
them and trains the engine on exactly the same batches.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
MICRO = 4
GLOBAL_BATCH = WORLD * MICRO
SAVE_AT = 4
RESUME_STEPS = 10
IN, HIDDEN, MID, OUT = 11, 23, 19, 5  # odd sizes: the flat partitions end in padding

# name -> (zero stage, precision). Stage 0 keeps the optimizer in the model file (in fp16 and bf16
# DeepSpeed's FP16_UnfusedOptimizer around the torch optimizer); stages 1-3 write zero_pp_rank_* files,
# bf16_-prefixed under bf16; stage 1 under bf16 is DeepSpeed's BF16_Optimizer.
CASES: dict[str, tuple[int, str]] = {
    "stage0_fp32": (0, "fp32"),
    "stage0_bf16": (0, "bf16"),
    "stage0_fp16": (0, "fp16"),
    "stage1_fp32": (1, "fp32"),
    "stage2_fp32": (2, "fp32"),
    "stage3_fp32": (3, "fp32"),
    "stage1_bf16": (1, "bf16"),
    "stage2_bf16": (2, "bf16"),
    "stage3_bf16": (3, "bf16"),
    "stage1_fp16": (1, "fp16"),
    "stage2_fp16": (2, "fp16"),
    "stage3_fp16": (3, "fp16"),
    "stage2_fp32_fusedadam": (2, "fp32"),
    "stage0_fp16_fusedadam": (0, "fp16"),
}
FUSED_ADAM = {"stage2_fp32_fusedadam", "stage0_fp16_fusedadam"}
"""Cases trained with DeepSpeed's FusedAdam (its default AdamW) instead of torch's: its state keeps Adam's
step as a Python int, and at stage 0 in fp16 DeepSpeed wraps it in its fused FP16_Optimizer (one flat fp32
master per param group)."""


def case_config(name: str) -> dict[str, Any]:
    stage, precision = CASES[name]
    return ds_config(stage, precision, fused_adam=name in FUSED_ADAM)


class TinyNet(torch.nn.Module):
    """About 900 parameters in odd shapes, a LayerNorm, and a buffer (saved in the module state)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, MID)
        self.out = torch.nn.Linear(MID, OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        return self.out(torch.tanh(self.mid(h))) * self.scale.to(x.dtype)


def make_model(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of training step `step` (0-based), the same on every rank and world size."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def rank_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    micro = GLOBAL_BATCH // world
    return x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]


def ds_config(stage: int, precision: str, fused_adam: bool = False) -> dict[str, Any]:
    """DeepSpeed's config for a case. torch_adam: torch.optim.AdamW; without it (`fused_adam`, what
    DeepSpeed's AdamW means by default) DeepSpeed's own FusedAdam, built for the CPU by its JIT."""
    config: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 6},
        },
        "zero_optimization": {"stage": stage},
    }
    if fused_adam:
        del config["optimizer"]["params"]["torch_adam"]
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        # A small window so the scale grows before the save: the saved loss-scaler state is not the initial one.
        config["fp16"] = {
            "enabled": True,
            "initial_scale_power": 8,
            "loss_scale_window": 2,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return config


def model_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _train_step(engine: Any, step: int, precision: str) -> float:
    """One step on this rank's rows; the loss averaged over the global batch (all ranks)."""
    import torch.distributed as dist

    x, y = rank_batch(step, dist.get_rank(), dist.get_world_size())
    out = engine(x.to(model_dtype(precision)))
    loss = torch.nn.functional.mse_loss(out.float(), y)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def _reference(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's fp32 master and Adam moments as DeepSpeed's own API gives them (collective at stage 3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in engine.module.named_parameters():
        found[name] = {"master": safe_get_full_fp32_param(p).detach().clone().float()}
        for key in ("exp_avg", "exp_avg_sq"):
            found[name][key] = safe_get_full_optimizer_state(p, key).detach().clone().float()
    return found


def _stage0_reference(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Stage 0 has no fragment mapping: in fp32 the masters are the module's parameters; in fp16 and
    bf16 they are DeepSpeed's FP16_UnfusedOptimizer's fp32_groups, in the module's parameter order, or
    (with FusedAdam) slices of FP16_Optimizer's flat fp32 group, in the same order."""
    named = [name for name, _ in engine.module.named_parameters()]
    if hasattr(engine.optimizer, "fp32_groups_flat"):  # the fused FP16_Optimizer: one flat master per group
        flats = engine.optimizer.fp32_groups_flat
        state = engine.optimizer.optimizer.state
        found: dict[str, dict[str, torch.Tensor]] = {}
        params = iter(named)
        for flat, group in zip(flats, engine.optimizer.fp16_groups, strict=True):
            offset = 0
            for p in group:
                n = p.numel()
                found[next(params)] = {
                    "master": flat[offset : offset + n].detach().clone().float(),
                    "exp_avg": state[flat]["exp_avg"][offset : offset + n].clone(),
                    "exp_avg_sq": state[flat]["exp_avg_sq"][offset : offset + n].clone(),
                }
                offset += n
        return found
    if hasattr(engine.optimizer, "fp32_groups"):
        masters = [t for group in engine.optimizer.fp32_groups for t in group]
        state = engine.optimizer.optimizer.state
    else:
        masters = [p for _, p in engine.module.named_parameters()]
        state = engine.basic_optimizer.state
    return {
        name: {
            "master": p.detach().clone().float(),
            "exp_avg": state[p]["exp_avg"].clone(),
            "exp_avg_sq": state[p]["exp_avg_sq"].clone(),
        }
        for name, p in zip(named, masters, strict=True)
    }


def _drop_copied_scripts(ckpt: str) -> None:
    """save_checkpoint copies DeepSpeed's zero_to_fp32.py and zero_to_torch.py beside the tags (40 KB
    that are no part of the format)."""
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        path = os.path.join(ckpt, script)
        if os.path.exists(path):
            os.remove(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator calls fp16 supported only where oneDNN has fp16 kernels; torch's CPU
    kernels run these small layers in fp16 anyway, and the fixture only needs DeepSpeed's file layout."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def _run_case(name: str, stage: int, precision: str) -> None:
    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    folder = os.path.join(HERE, name)
    ckpt = os.path.join(folder, "ckpt")
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    dist.barrier()

    model = make_model(seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=case_config(name))
    before = [_train_step(engine, step, precision) for step in range(SAVE_AT)]
    reference = _stage0_reference(engine) if stage == 0 else _reference(engine)
    engine.save_checkpoint(ckpt, client_state={"epoch": 3, "note": name, "best": torch.tensor([0.25])})
    dist.barrier()
    if rank == 0:
        _drop_copied_scripts(ckpt)
    if stage > 0 and rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        consolidated = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        for pname, entry in reference.items():
            if not torch.equal(consolidated[pname].float(), entry["master"]):
                raise RuntimeError(f"{name}: zero_to_fp32 and the live engine disagree on {pname}")
    engine.destroy()

    fresh = make_model(seed=99)
    resumed, _, _, _ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=case_config(name))
    _, client = resumed.load_checkpoint(ckpt)
    after = [_train_step(resumed, SAVE_AT + k, precision) for k in range(RESUME_STEPS)]
    if rank == 0:
        torch.save(reference, os.path.join(folder, "reference.pt"))
        expected = {
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "stage": stage,
            "precision": precision,
            "world_size": WORLD,
            "config": case_config(name),
            "global_steps": resumed.global_steps,
            "losses_before_save": before,
            "resumed_losses": after,
            "client_state_epoch": client.get("epoch"),
        }
        with open(os.path.join(folder, "expected.json"), "w") as f:
            json.dump(expected, f, indent=1)
    resumed.destroy()


def _fix_stage0_fp16_bugs() -> None:
    """Correct, in this process only, the two bugs of DeepSpeed 0.19.8's stage 0 in fp16 (its
    FP16_UnfusedOptimizer around a torch optimizer, and FP16_Optimizer around its FusedAdam), for a
    reference run of what it means to do:

    1. engine.backward() scales the loss only for ZeRO optimizers (runtime/engine.py: `if
       isinstance(self.optimizer, ZeROOptimizer): loss = self.optimizer.scale_if_loss(loss)`), so at
       stage 0 the loss is never scaled, yet step() still divides the gradients by the loss scale:
       every gradient is the true one over the scale, which doubles every loss_scale_window steps.
    2. step() updates the scale (_update_scale) before unscale_and_clip_grads, so at each step where
       the scale grows the gradients are divided by the new scale, not the one they were made with.

    The corrected step multiplies the gradients by the scale (as if the loss had been scaled; their
    fp16 rounding is that of unscaled gradients), unscales and clips with the scale they were made
    with, then updates the scale."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    # FP16_UnfusedOptimizer.unscale_and_clip_grads(total_norm) unscales its fp32_groups' gradients;
    # FP16_Optimizer (the fused one, with FusedAdam) unscale_and_clip_grads(grads, total_norm) the flat
    # gradients it is given.
    _scale_then_unscale(
        FP16_UnfusedOptimizer, lambda self, args: [p.grad for g in self.fp32_groups for p in g if p.grad is not None], 0
    )
    _scale_then_unscale(FP16_Optimizer, lambda self, args: args[0], 1)


def _scale_then_unscale(cls: Any, grads_of: Any, norm_at: int) -> None:
    """cls.step corrected as _fix_stage0_fp16_bugs says (once: a second call changes nothing).
    grads_of(self, args): the gradients unscale_and_clip_grads(*args) unscales; args[norm_at]: the norm."""
    if getattr(cls.step, "bugs_fixed", False):
        return
    shipped_step, shipped_unscale = cls.step, cls.unscale_and_clip_grads

    def step(self: Any, closure: Any = None) -> Any:
        update, deferred = self._update_scale, []

        def unscale_then_update(*args: Any, **kwargs: Any) -> Any:
            scale = self.loss_scale_config.cur_scale
            for grad in grads_of(self, args):
                grad.mul_(scale)
            args = tuple(a * scale if i == norm_at else a for i, a in enumerate(args))
            combined = shipped_unscale(self, *args, **kwargs)
            for skip in deferred:
                update(skip)
            deferred.clear()
            return combined

        self._update_scale = lambda skip: update(skip) if skip else deferred.append(skip)
        self.unscale_and_clip_grads = unscale_then_update
        try:
            return shipped_step(self, closure)
        finally:
            del self._update_scale, self.unscale_and_clip_grads

    step.bugs_fixed = True  # type: ignore[attr-defined]
    cls.step = step


def _fix_zero_fp16_scale_order() -> None:
    """Correct, in this process only, the scale-order bug of DeepSpeed 0.19.8's ZeRO stages 1-3 in fp16
    (DeepSpeedZeroOptimizer.step, DeepSpeedZeroOptimizer_Stage3.step): they call _update_scale before
    unscale_and_clip_grads, which reads the updated scale, so at each step where the scale grows the
    gradients are divided by the new scale, half the one they were made with (stages 1-2 divide their
    _global_grad_norm by prev_scale). The corrected step updates the scale after it: at once on an
    overflow (the skipped step unscales nothing), after the optimizer step otherwise."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        if getattr(cls.step, "scale_order_fixed", False):
            continue
        shipped_step = cls.step

        def step(self: Any, closure: Any = None, _shipped: Any = shipped_step) -> Any:
            update, deferred = self._update_scale, []
            self._update_scale = lambda has_overflow=False: (
                update(has_overflow) if has_overflow else deferred.append(False)
            )
            try:
                return _shipped(self, closure)
            finally:
                del self._update_scale
                for overflow in deferred:
                    update(overflow)

        step.scale_order_fixed = True  # type: ignore[attr-defined]
        cls.step = step


BUG_FIXES = {
    "stage0_fp16": _fix_stage0_fp16_bugs,
    "stage1_fp16": _fix_zero_fp16_scale_order,
    "stage2_fp16": _fix_zero_fp16_scale_order,
    "stage3_fp16": _fix_zero_fp16_scale_order,
    "stage0_fp16_fusedadam": _fix_stage0_fp16_bugs,
}
"""The fp16 fixtures, and the correction of DeepSpeed's loss-scale bugs their reference run applies."""


def _resume_bugs_fixed(name: str) -> None:
    """DeepSpeed's resumed run of the saved fp16 checkpoint with its BUG_FIXES correction applied; the
    losses go into expected.json as resumed_losses_bugs_fixed (the checkpoint is not touched)."""
    import deepspeed
    import torch.distributed as dist

    stage, precision = CASES[name]
    folder = os.path.join(HERE, name)
    BUG_FIXES[name]()
    fresh = make_model(seed=99)
    resumed, _, _, _ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=case_config(name))
    resumed.load_checkpoint(os.path.join(folder, "ckpt"))
    after = [_train_step(resumed, SAVE_AT + k, precision) for k in range(RESUME_STEPS)]
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "expected.json")) as f:
            expected = json.load(f)
        expected["resumed_losses_bugs_fixed"] = after
        with open(os.path.join(folder, "expected.json"), "w") as f:
            json.dump(expected, f, indent=1)
    resumed.destroy()


def init_rank(rank: int, port: int, world: int = WORLD) -> None:
    """This process as rank `rank` of `world` gloo ranks on this host, DeepSpeed's distributed set up
    (make_tp_fixture in ../deepspeed_tp_checkpoint uses it too)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    import deepspeed

    _allow_fp16_on_cpu()
    deepspeed.init_distributed(dist_backend="gloo")


def _rank_main(rank: int, port: int, names: list[str]) -> None:
    init_rank(rank, port)
    for name in names:
        stage, precision = CASES[name]
        _run_case(name, stage, precision)
    for name in BUG_FIXES:  # last: the corrections patch DeepSpeed for the rest of the process
        if name in names:
            _resume_bugs_fixed(name)


def _rank_bugs_fixed(rank: int, port: int) -> None:
    init_rank(rank, port)
    for name in BUG_FIXES:
        _resume_bugs_fixed(name)


def main(argv: list[str]) -> None:
    """make_fixtures.py [CASE ...]: write those cases (all without an argument); make_fixtures.py
    --bugs-fixed: only add the fp16 fixtures' resumed_losses_bugs_fixed, from their saved checkpoints."""
    if argv == ["--bugs-fixed"]:
        torch.multiprocessing.spawn(_rank_bugs_fixed, args=(_free_port(),), nprocs=WORLD)
        return
    names = argv or list(CASES)
    torch.multiprocessing.spawn(_rank_main, args=(_free_port(), names), nprocs=WORLD)


if __name__ == "__main__":
    main(sys.argv[1:])
