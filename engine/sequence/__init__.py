"""Sequence parallelism (DeepSpeed-Ulysses, arXiv 2309.14509; ALST, arXiv 2506.13996): each rank of a
sequence-parallel group (engine/parallel/sequence_groups.py) holds a slice of every sample's tokens.
Attention needs whole sequences, so around it two all-to-alls trade the sequence split for a split of
the attention heads and back; everything else (MLPs, norms, embeddings, the loss) is per token and runs
on the local slice. The traffic per rank stays constant when the sequence and the ranks grow together.

- all_to_all.py: the differentiable all-to-all that swaps which dimension is split;
- attention.py: `DistributedAttention`, any local attention wrapped in the two all-to-alls (Megatron's API);
- hf_attention.py: `UlyssesSPAttentionHF`, the same for Hugging Face models, registered in place of the
  attention function transformers dispatches to;
- data.py: `UlyssesSPDataLoaderAdapter`, which shards each batch along the sequence;
- tiled.py: `sequence_tiled_compute`, `TiledMLP`, `TiledFusedLogitsLoss`: per-token work in tiles, so
  activations of a long sequence never exist whole;
- loss.py: `sequence_parallel_loss`, the token-weighted loss over the group.

The engine's names are these modules'; DeepSpeed's paths (deepspeed.sequence.layer,
deepspeed.runtime.sequence_parallel.ulysses_sp) are compat/deepspeed's aliases of them.

ZeRO needs nothing special: it partitions and averages over every rank (sequence_groups.py says why).
"""

from engine.sequence.attention import DistributedAttention
from engine.sequence.data import UlyssesSPDataLoaderAdapter
from engine.sequence.hf_attention import UlyssesSPAttentionHF
from engine.sequence.loss import sequence_parallel_loss
from engine.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = [
    "DistributedAttention",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_parallel_loss",
    "sequence_tiled_compute",
]
