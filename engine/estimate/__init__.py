"""The memory estimator: per-rank model-state bytes for each ZeRO stage, in this engine's dtypes (the
ZeRO paper's Table 1), without building an engine.

- model.py: the byte costs and per-state formulas, sized from the engine's own layout code
  (estimate_memory, MemoryEstimate);
- paper.py with paper_table.py: the paper's Table 1 recomputed and checked cell by cell;
- cli.py: format_table and `python -m engine.estimate` (__main__.py).

`engine.estimate_memory` is estimate_memory (a lazy attribute of the engine package).
"""

from engine.estimate.cli import format_bytes, format_table, main
from engine.estimate.model import (
    DEFAULT_BUCKET_SIZE,
    PAPER_COSTS,
    STAGES,
    ByteCosts,
    MemoryEstimate,
    count_sizes,
    engine_costs,
    estimate_from_costs,
    estimate_memory,
    flat_sizes,
    unit_sizes,
)
from engine.estimate.paper import PaperCell, format_paper_table, matches_printed, paper_cells

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "PAPER_COSTS",
    "STAGES",
    "ByteCosts",
    "MemoryEstimate",
    "PaperCell",
    "count_sizes",
    "engine_costs",
    "estimate_from_costs",
    "estimate_memory",
    "flat_sizes",
    "format_bytes",
    "format_paper_table",
    "format_table",
    "main",
    "matches_printed",
    "paper_cells",
    "unit_sizes",
]
