"""`deepspeed.runtime.sequence_parallel.ulysses_sp` -> engine.sequence (Ulysses attention for Hugging
Face models, the sequence-sharding DataLoader adapter, ALST's tiled compute)."""

from engine.sequence.data import UlyssesSPDataLoaderAdapter
from engine.sequence.hf_attention import UlyssesSPAttentionHF
from engine.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]
