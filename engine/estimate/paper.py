"""The ZeRO paper's Table 1 recomputed: every printed cell beside what the per-state formulas of
model.py give under the paper's assumptions (PAPER_COSTS), for `python -m engine.estimate --paper`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

from engine.estimate.model import PAPER_COSTS, STAGE_NAMES, ByteCosts, MemoryEstimate, count_sizes, estimate_from_costs
from engine.estimate.paper_table import PAPER_MODELS, PAPER_STAGES, PAPER_TABLE, PAPER_WORLD_SIZES


@dataclass(frozen=True)
class PaperCell:
    """One cell of the paper's Table 1 beside the value the formulas give for it."""

    model: str
    """The paper's model label ("7.5B", "128B", "1T")."""
    stage: int
    world_size: int
    printed: str
    """The paper's value in GB, as printed."""
    estimate: MemoryEstimate

    @property
    def matches(self) -> bool:
        return matches_printed(self.estimate.total, self.printed)


def matches_printed(total_bytes: int, printed: str) -> bool:
    """Whether `total_bytes` in GB (1e9 bytes) is `printed` within the paper's rounding: rounded
    half-up, or truncated, to the printed number of decimals (the paper does both)."""
    decimals = len(printed.partition(".")[2])
    scaled = Fraction(total_bytes * 10**decimals, 10**9)
    target = Fraction(printed) * 10**decimals
    return target in (math.floor(scaled + Fraction(1, 2)), math.floor(scaled))


def paper_cells(costs: ByteCosts = PAPER_COSTS) -> list[PaperCell]:
    """All 54 cells of the paper's Table 1, computed from `costs` (the paper's by default)."""
    cells = []
    for (model, stage, world_size), printed in PAPER_TABLE.items():
        numel = PAPER_MODELS[model]
        padded, shard = count_sizes(numel, stage, world_size)
        estimate = estimate_from_costs(
            costs, stage, world_size=world_size, numel=numel, padded_numel=padded, shard_numel=shard
        )
        cells.append(PaperCell(model, stage, world_size, printed, estimate))
    return cells


def _gb(total_bytes: int) -> str:
    """GB to at most 4 decimals, rounded half-up (exact: no binary float in between)."""
    value = (Decimal(total_bytes) / 10**9).quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP)
    return f"{value:f}".rstrip("0").rstrip(".")


def format_paper_table(cells: Sequence[PaperCell]) -> str:
    """The paper's Table 1 in its shape (rows N_d, columns model x stage): each cell the computed GB
    and `= printed` when it matches the paper's value, `!= printed` when not."""
    by_key = {(c.model, c.stage, c.world_size): c for c in cells}
    columns = [(model, stage) for model in PAPER_MODELS for stage in PAPER_STAGES]
    costs = cells[0].estimate.costs
    lines = [
        _PAPER_HEADER,
        "",
        "| N_d | " + " | ".join(f"{model} {STAGE_NAMES[stage]}" for model, stage in columns) + " |",
        "| ---: |" + " ---: |" * len(columns),
    ]
    for world_size in PAPER_WORLD_SIZES:
        row = []
        for model, stage in columns:
            cell = by_key[(model, stage, world_size)]
            row.append(f"{_gb(cell.estimate.total)} {'=' if cell.matches else '!='} {cell.printed}")
        lines.append(f"| {world_size} | " + " | ".join(row) + " |")
    matched = sum(c.matches for c in cells)
    return "\n".join(
        [*lines, "", f"{matched} of {len(cells)} cells match the printed values.", _assumptions(costs), _ENGINE_DIFFERS]
    )


_PAPER_HEADER = (
    "ZeRO paper, Table 1: per-device model-state memory in GB (1e9 bytes), computed with this engine's "
    "per-state formulas; '= x' when the paper prints x (rounded half-up or truncated), '!= x' when not."
)
_ENGINE_DIFFERS = (
    "This engine differs: stage 3 keeps no fp16/bf16 parameter shard (gathers cast from the fp32 master: "
    "14 Psi/N_d in bf16, not 16); gradients are held in the accumulation dtype (default the parameter "
    "dtype, as in DeepSpeed); fp32 training keeps no master (the optimizer updates the fp32 parameters in "
    "place). See python -m engine.estimate --params 7.5e9 --world-size 64 --dtype bf16."
)


def _assumptions(costs: ByteCosts) -> str:
    stage3 = "a parameter shard at stage 3" if costs.stage3_param_shard else "no parameter shard at stage 3"
    return (
        f"Assumptions: {costs.dtype} parameters ({costs.params} B/element), {costs.grad_accum_dtype} gradients "
        f"({costs.gradients} B), K = {costs.master + costs.optimizer_state} B of optimizer state (fp32 master "
        f"{costs.master} + {costs.optimizer} state {costs.optimizer_state}), {stage3}; Psi/N_d rounded up, "
        "no padding."
    )
