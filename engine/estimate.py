"""Model-state memory per rank for each ZeRO stage, in this engine's dtypes (the ZeRO paper's Table 1).

The paper assumes fp16 params and grads plus K = 12 bytes of fp32 Adam state (master copy, momentum,
variance): (2 + 2 + K) Psi for the baseline down to (2 + 2 + K) Psi / N for P_os+g+p. This engine
differs in two ways, so the terms are spelled out separately:

* fp32 training keeps no master copy: the optimizer updates the fp32 parameter shard in place
  (see [Note: the flat layout] in engine/zero/layout.py), so m = 0 there and 4 otherwise.
* gradients are reduced into an fp32 shard, whatever the accumulation dtype. At stages 0-1 the
  full-size accumulation buffer holds them first; when it is fp32 the shard is a view into it (no
  extra bytes), otherwise the fp32 shard (all of it at stage 0, Psi/N at stage 1) comes on top.
  fp32 training at stage 0 accumulates in fp32.

Per rank, with Psi trainable elements, N ranks, b / g bytes per param / gradient-accumulation element,
m master bytes, f = 0 if g = 4 else 4 (the separate fp32 gradient shard), and s optimizer-state bytes
per element:

    stage  params    gradients  master    optimizer
    0      b Psi     g Psi + f Psi    m Psi     s Psi
    1      b Psi     g Psi + f Psi/N  m Psi/N   s Psi/N
    2      b Psi     4 Psi/N    m Psi/N   s Psi/N
    3      b Psi/N   4 Psi/N    m Psi/N   s Psi/N

Psi/N is rounded up (the largest rank's shard). Only model states are counted: constant-size bucket
buffers, gathered stage-3 units, activations and allocator overhead are not.

    python -m engine.estimate --params 7.5e9 --world-size 64 --dtype bf16
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

STAGES = (0, 1, 2, 3)

_DTYPE_NAMES: dict[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
}
_TORCH_DTYPES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

_OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8,  # exp_avg + exp_avg_sq in fp32
    "adamw": 8,
    "lamb": 8,
    "sgd": 4,  # momentum buffer (assumed; plain SGD would be 0)
    "adagrad": 4,  # sum of squares
    "lion": 4,  # exp_avg only
}

_EXCLUDED = (
    "Model states only: constant-size bucket buffers, gathered stage-3 units, activations and "
    "allocator overhead are excluded."
)
_STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes held by one rank at one ZeRO stage."""

    stage: int
    world_size: int
    numel: int
    """Psi: trainable elements (shared parameters counted once)."""
    params: int
    """Bytes of the model's parameters (a 1/N shard at stage 3)."""
    gradients: int
    """Bytes of gradients: full accumulation buffer at stages 0-1, an fp32 shard at 2-3."""
    master: int
    """Bytes of the fp32 master shard; 0 in fp32 training (the shard is updated in place)."""
    optimizer_state: int
    """Bytes of optimizer state (e.g. Adam's two moments), sharded from stage 1 on."""
    dtype: str = "fp32"
    """Canonical name of the parameter dtype the estimate assumed."""
    grad_accum_dtype: str = "fp32"
    """Canonical name of the gradient-accumulation dtype the estimate assumed."""
    optimizer: str = "adam"
    """Canonical (lower-case) optimizer name the estimate assumed."""

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.master + self.optimizer_state


def _dtype_name(dtype: str | torch.dtype, what: str) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype in _TORCH_DTYPES:
            return _TORCH_DTYPES[dtype]
    elif isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    accepted = ", ".join(repr(name) for name in _DTYPE_NAMES)
    raise ValueError(f"{what}={dtype!r} is not supported; use one of {accepted} or torch.float32/bfloat16/float16")


def _optimizer_name(optimizer: str) -> str:
    name = optimizer.lower() if isinstance(optimizer, str) else None
    if name not in _OPTIMIZER_STATE_BYTES:
        accepted = ", ".join(repr(n) for n in _OPTIMIZER_STATE_BYTES)
        raise ValueError(f"optimizer={optimizer!r} is not supported; use one of {accepted} (case-insensitive)")
    return name


def _count_trainable(model_or_numel: torch.nn.Module | int) -> int:
    if isinstance(model_or_numel, torch.nn.Module):
        # Module.parameters() yields a tied (shared) parameter once.
        return sum(p.numel() for p in model_or_numel.parameters() if p.requires_grad)
    if isinstance(model_or_numel, bool) or not isinstance(model_or_numel, int):
        raise TypeError(f"model_or_numel must be an nn.Module or an int, got {type(model_or_numel).__name__}")
    if model_or_numel < 0:
        raise ValueError(f"model_or_numel={model_or_numel} must be >= 0 (a count of trainable elements)")
    return model_or_numel


def _stage_estimate(
    stage: int, numel: int, world_size: int, dtype: str, grad_dtype: str, optimizer: str
) -> MemoryEstimate:
    b, g = _DTYPE_BYTES[dtype], _DTYPE_BYTES[grad_dtype]
    if stage == 0 and dtype == "fp32":
        g = 4  # the replicated fp32 stage keeps gradients in the parameters' dtype
    f = 0 if g == 4 else 4
    m = 0 if dtype == "fp32" else 4
    s = _OPTIMIZER_STATE_BYTES[optimizer]
    shard = -(-numel // world_size)  # ceil without float rounding
    return MemoryEstimate(
        stage=stage,
        world_size=world_size,
        numel=numel,
        params=b * (shard if stage >= 3 else numel),
        gradients=4 * shard if stage >= 2 else g * numel + f * (shard if stage == 1 else numel),
        master=m * (shard if stage >= 1 else numel),
        optimizer_state=s * (shard if stage >= 1 else numel),
        dtype=dtype,
        grad_accum_dtype=grad_dtype,
        optimizer=optimizer,
    )


def estimate_memory(
    model_or_numel: torch.nn.Module | int,
    stage: int | None = None,
    world_size: int = 1,
    dtype: str | torch.dtype = "fp32",
    grad_accum_dtype: str | torch.dtype | None = None,
    optimizer: str = "adam",
) -> MemoryEstimate | list[MemoryEstimate]:
    """Per-rank model-state bytes at `stage` (0-3), or a list for stages 0..3 when `stage` is None.

    `model_or_numel` is a module (parameters with requires_grad, each shared parameter once) or an
    element count. `grad_accum_dtype` defaults to `dtype`. See the module docstring for the formulas.
    """
    numel = _count_trainable(model_or_numel)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1 (the number of data-parallel ranks)")
    if stage is not None and (isinstance(stage, bool) or stage not in STAGES):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3 (or None for all four)")
    param_dtype = _dtype_name(dtype, "dtype")
    grad_dtype = param_dtype if grad_accum_dtype is None else _dtype_name(grad_accum_dtype, "grad_accum_dtype")
    opt = _optimizer_name(optimizer)
    if stage is not None:
        return _stage_estimate(stage, numel, world_size, param_dtype, grad_dtype, opt)
    return [_stage_estimate(s, numel, world_size, param_dtype, grad_dtype, opt) for s in STAGES]


def format_bytes(n: int) -> str:
    """Binary units: B, KiB, MiB, GiB, TiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_table(estimates: MemoryEstimate | Iterable[MemoryEstimate]) -> str:
    """A Markdown table in the shape of the paper's Table 1: one row per stage, a header with Psi, N, dtypes."""
    rows = [estimates] if isinstance(estimates, MemoryEstimate) else list(estimates)
    if not rows:
        raise ValueError("format_table() needs at least one MemoryEstimate")
    first = rows[0]
    master = "fp32" if first.dtype != "fp32" else "none (fp32 shard updated in place)"
    header = (
        f"Model-state memory per rank: Psi = {first.numel:,} trainable elements, N = {first.world_size}, "
        f"params {first.dtype} ({_DTYPE_BYTES[first.dtype]} B), grad accumulation {first.grad_accum_dtype} "
        f"({_DTYPE_BYTES[first.grad_accum_dtype]} B; fp32 shard from stage 2), master {master}, "
        f"optimizer {first.optimizer} ({_OPTIMIZER_STATE_BYTES[first.optimizer]} B/element)"
    )
    lines = [
        header,
        "",
        "| stage | params | gradients | master | optimizer | total |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in rows:
        cells = [e.params, e.gradients, e.master, e.optimizer_state, e.total]
        label = f"{e.stage} ({_STAGE_NAMES[e.stage]})"
        lines.append("| " + " | ".join([label, *(format_bytes(c) for c in cells)]) + " |")
    lines += ["", _EXCLUDED]
    return "\n".join(lines)


_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _parse_count(text: str) -> int:
    """'7.5e9', '7500000000', '7.5B', '350M', '1.3b' -> an int element count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (e.g. 7.5e9, 7500000000, 7.5B, 350M)")
    value = float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of elements")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.estimate",
        description="Per-rank model-state memory for ZeRO stages 0-3 (the ZeRO paper's Table 1, this engine's dtypes).",
    )
    parser.add_argument(
        "--params",
        required=True,
        type=_parse_count,
        help="trainable parameter count Psi (7.5e9, 7500000000, 7.5B, 350M)",
    )
    parser.add_argument("--world-size", type=_positive_int, default=1, help="data-parallel ranks N (default 1)")
    dtypes = sorted(_DTYPE_NAMES)
    parser.add_argument(
        "--dtype", default="fp32", type=str.lower, choices=dtypes, help="model parameter dtype (default fp32)"
    )
    parser.add_argument(
        "--grad-accum-dtype",
        default=None,
        type=str.lower,
        choices=dtypes,
        help="gradient accumulation dtype (default: --dtype)",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        type=str.lower,
        choices=list(_OPTIMIZER_STATE_BYTES),
        help="optimizer whose state is counted (default adam)",
    )
    parser.add_argument("--stage", type=int, choices=STAGES, default=None, help="one stage only (default: all four)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = estimate_memory(
        args.params,
        stage=args.stage,
        world_size=args.world_size,
        dtype=args.dtype,
        grad_accum_dtype=args.grad_accum_dtype,
        optimizer=args.optimizer,
    )
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
