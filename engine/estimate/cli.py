"""The estimator's text: `format_table` (a Markdown table of MemoryEstimates) and the command line,
`python -m engine.estimate` (engine/estimate/__main__.py)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Sequence

from engine.estimate.model import (
    DTYPE_NAMES,
    OPTIMIZER_STATE_BYTES,
    STAGE_NAMES,
    STAGES,
    MemoryEstimate,
    estimate_memory,
)
from engine.estimate.paper import format_paper_table, paper_cells

_EXCLUDED = (
    "Model states only: constant-size bucket buffers, gathered stage-3 units, activations and "
    "allocator overhead are excluded. P: padded elements of the full flat buffers; S: this rank's shard."
)


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
    first, costs = rows[0], rows[0].costs
    master = "fp32 (4 B)" if costs.master else "none (the optimizer updates the fp32 parameters in place)"
    header = (
        f"Model-state memory per rank: Psi = {first.numel:,} trainable elements, N = {first.world_size}, "
        f"params {costs.dtype} ({costs.params} B), gradients in the accumulation dtype {costs.grad_accum_dtype} "
        f"({costs.gradients} B; default the parameter dtype, as in DeepSpeed), master {master}, "
        f"optimizer {costs.optimizer} ({costs.optimizer_state} B/element)"
    )
    disk, hpz = any(e.disk for e in rows), any(e.secondary for e in rows)
    lines = [
        header,
        "",
        "| stage | params | gradients | master | optimizer |"
        + (" hpZ secondary |" if hpz else "")
        + " total (RAM) |"
        + (" NVMe |" if disk else "")
        + " P | S |",
        "| --- | ---: | ---: | ---: | ---: |"
        + (" ---: |" if hpz else "")
        + " ---: |"
        + (" ---: |" if disk else "")
        + " ---: | ---: |",
    ]
    for e in rows:
        parts = (e.params, e.gradients, e.master, e.optimizer_state, *((e.secondary,) if hpz else ()), e.total)
        cells = [format_bytes(c) for c in parts]
        if disk:
            cells.append(format_bytes(e.disk))
        label = f"{e.stage} ({STAGE_NAMES[e.stage]})"
        lines.append("| " + " | ".join([label, *cells, f"{e.padded_numel:,}", f"{e.shard_numel:,}"]) + " |")
    lines += ["", _EXCLUDED]
    if disk:
        lines.append(
            "NVMe: the model states ZeRO-Infinity keeps in swap files (offload_optimizer / offload_param "
            '"nvme"), per rank, not counted in total (RAM); plus buffer_count x sub_group_size x 12 B of buffers '
            "(16 B at stage 3, and 128 MiB of gradient staging buffers)."
        )
    if any(e.stage == 3 for e in rows):
        lines.append(
            "Stage 3 keeps the fp32 shard as the parameters (no master)."
            if costs.stage3_param_shard
            else f"Stage 3 keeps no {costs.dtype} parameter shard: gathers cast from the fp32 master."
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- CLI
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
        "--paper",
        action="store_true",
        help="print the paper's Table 1 computed with this engine's formulas under the paper's assumptions, "
        "each cell checked against the printed value (exit status 1 if any differs); takes no other option",
    )
    parser.add_argument(
        "--params",
        type=_parse_count,
        help="trainable parameter count Psi (7.5e9, 7500000000, 7.5B, 350M); required without --paper",
    )
    parser.add_argument("--world-size", type=_positive_int, default=1, help="data-parallel ranks N (default 1)")
    dtypes = sorted(DTYPE_NAMES)
    parser.add_argument(
        "--dtype", default="fp32", type=str.lower, choices=dtypes, help="model parameter dtype (default fp32)"
    )
    parser.add_argument(
        "--grad-accum-dtype",
        default=None,
        type=str.lower,
        choices=dtypes,
        help="dtype the gradients are accumulated and held in (default: --dtype, as in DeepSpeed)",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        type=str.lower,
        choices=list(OPTIMIZER_STATE_BYTES),
        help="optimizer whose state is counted (default adam)",
    )
    parser.add_argument("--stage", type=int, choices=STAGES, default=None, help="one stage only (default: all four)")
    parser.add_argument(
        "--hpz",
        type=_positive_int,
        default=1,
        help="zero_optimization.zero_hpz_partition_size: stage 3 adds the secondary shards (default 1: off)",
    )
    for what in ("optimizer", "param"):
        parser.add_argument(
            f"--offload-{what}",
            default="none",
            choices=("none", "cpu", "nvme"),
            help=f'zero_optimization.offload_{what}.device (default none); "nvme" counts what goes to disk',
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.paper:
        given = [
            f"--{dest.replace('_', '-')}"
            for dest in (
                "params",
                "world_size",
                "dtype",
                "grad_accum_dtype",
                "optimizer",
                "stage",
                "offload_optimizer",
                "offload_param",
                "hpz",
            )
            if getattr(args, dest) != parser.get_default(dest)
        ]
        if given:
            parser.error(f"--paper prints the paper's fixed table; drop {', '.join(given)}")
        cells = paper_cells()
        print(format_paper_table(cells))
        return 0 if all(c.matches for c in cells) else 1
    if args.params is None:
        parser.error("the following arguments are required: --params (or --paper for the paper's Table 1)")
    result = estimate_memory(
        args.params,
        stage=args.stage,
        world_size=args.world_size,
        dtype=args.dtype,
        grad_accum_dtype=args.grad_accum_dtype,
        optimizer=args.optimizer,
        offload_optimizer=args.offload_optimizer,
        offload_param=args.offload_param,
        hpz_partition_size=args.hpz,
    )
    print(format_table(result))
    return 0
