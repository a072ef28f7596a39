"""`deepspeed.runtime.sequence_parallel.ulysses_sp` -> engine.unsupported (sequence parallelism is
not implemented; using these names raises UnsupportedFeatureError naming the setting and the fix)."""

from engine.unsupported import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
