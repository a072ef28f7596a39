"""The ZeRO paper's Table 1 as printed, for `python -m engine.estimate --paper` and its test.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020),
Table 1: "Per-device memory consumption of different optimizations in ZeRO-DP as a function of DP
degree", in GB (1e9 bytes). The values are kept as the strings the paper prints: their number of
decimals says how precisely to compare, and the paper sometimes truncates rather than rounds
(128B P_os+g at N_d = 1024 is 257.75, printed "257"; 1T P_os at 64 is 4187.5, printed "4187").
Pure data: engine/estimate/paper.py computes the cells.
"""

from __future__ import annotations

PAPER_MODELS: dict[str, int] = {"7.5B": 7_500_000_000, "128B": 128_000_000_000, "1T": 1_000_000_000_000}
"""The table's models: label -> Psi, the parameter count."""

PAPER_STAGES: tuple[int, ...] = (1, 2, 3)
"""The table's columns per model: P_os, P_os+g, P_os+g+p (ZeRO stages 1, 2, 3)."""

# Table 1 row by row, as printed: N_d -> (7.5B P_os, P_os+g, P_os+g+p, 128B ..., 1T ...).
_ROWS: dict[int, tuple[str, ...]] = {
    1: ("120", "120", "120", "2048", "2048", "2048", "16000", "16000", "16000"),
    4: ("52.5", "41.3", "30", "896", "704", "512", "7000", "5500", "4000"),
    16: ("35.6", "21.6", "7.5", "608", "368", "128", "4750", "2875", "1000"),
    64: ("31.4", "16.6", "1.88", "536", "284", "32", "4187", "2218", "250"),
    256: ("30.4", "15.4", "0.47", "518", "263", "8", "4046", "2054", "62.5"),
    1024: ("30.1", "15.1", "0.12", "513", "257", "2", "4011", "2013", "15.6"),
}

PAPER_WORLD_SIZES: tuple[int, ...] = tuple(_ROWS)
"""The table's rows: data-parallel degrees N_d."""

PAPER_TABLE: dict[tuple[str, int, int], str] = {
    (model, stage, world_size): row[3 * m + s]
    for world_size, row in _ROWS.items()
    for m, model in enumerate(PAPER_MODELS)
    for s, stage in enumerate(PAPER_STAGES)
}
"""(model label, stage, N_d) -> the printed GB, all 54 cells."""
