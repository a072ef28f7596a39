"""`UlyssesSPAttentionHF`: sequence parallelism for Hugging Face models, in the attention function
transformers dispatches to (DeepSpeed's `deepspeed.runtime.sequence_parallel.ulysses_sp` API).

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="sdpa", sequence_parallel_size=2, micro_batch_size=1)
    engine, *_ = engine.initialize(model=model, config=..., mpu=mpu)

register_with_transformers makes the sequence-parallel groups and puts a wrapper in place of the model's
attention implementation in transformers' ALL_ATTENTION_FUNCTIONS (under the same name, so every branch
transformers takes for "sdpa" or "flash_attention_2" still runs). Each rank's model then sees only its
slice of the tokens; in every attention layer the wrapper:

1. all-gathers position_ids over the group (the attention needs every token's position: sdpa and flex to
   mask causally, flash attention to find packed documents);
2. trades q, k and v's sequence split for a split of the heads (engine/sequence/all_to_all.py):
   [b, h, s/p, d] -> [b, h/p, s, d]. With fewer key/value heads than ranks (GQA, MQA), each key/value
   head is repeated first so that every rank gets one, and the module's num_key_value_groups follows;
3. runs the original attention on whole sequences with the local heads, causally: a 4D mask built by
   transformers for the local length means nothing for the whole sequence (and would be O(s^2)), so
   it is dropped, as DeepSpeed drops it; a flex BlockMask is rebuilt, causal, for the whole length;
4. trades the output back: [b, s, h/p, d] -> [b, s/p, h, d].

Everything else in the model is per token. The loss must weigh each rank's tokens (Hugging Face's
deepspeed_sp_compute_loss does: an all-gathered, token-weighted mean).
"""

from __future__ import annotations

from typing import Any

import torch

from engine import comm
from engine.comm import ProcessGroup
from engine.comm.torch_style import all_gather
from engine.parallel import sequence_groups
from engine.sequence.all_to_all import seq_all_to_all

UNSUPPORTED_ATTENTION = ("eager", "paged|eager")
"""Eager attention always builds a 4D mask of the whole sequence (O(s^2) memory) and cannot fall back to
a causal flag once the mask is dropped."""


class UlyssesSPAttentionHF(torch.nn.Module):
    """A transformers attention function (`attn`) made sequence-parallel over `process_group`."""

    def __init__(
        self,
        attn: Any,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: ProcessGroup,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        self.sp_rank = comm.group_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None
        p = self.world_size
        if attn_head_count % p:
            raise ValueError(
                f"sequence parallelism: {attn_head_count} attention heads cannot be split over sequence_parallel_size "
                f"{p} (each rank attends with heads / sp of them); use a size that divides {attn_head_count}"
            )
        if kv_head_count % p and p % kv_head_count:
            raise ValueError(
                f"sequence parallelism: {kv_head_count} key/value heads cannot be shared out over "
                f"sequence_parallel_size {p}: one of the two must divide the other"
            )
        self.kv_replication_factor = max(p // kv_head_count, 1)
        """Each key/value head is repeated this many times when there are fewer of them than ranks."""
        self._block_mask: tuple[tuple[int, int], Any] | None = None

    def forward(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key)
        kwargs["position_ids"] = self._whole_positions(kwargs.get("position_ids"))
        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        group = self.process_group
        # [b, h, s/p, d] -> [b, h/p, s, d]
        q, k, v = (seq_all_to_all(t, 1, 2, group) for t in (query, key, value))
        mask = self._mask_for_whole_sequence(attention_mask, q)
        # The local heads' grouping (after replication, MQA/GQA have other ratios), for this call only: an
        # evaluation without sequence parallelism (disable_in_eval) must see the module's own.
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            context, weights = self.attn(module, q, k, v, mask, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        # [b, s, h/p, d] -> [b, s/p, h, d]
        return seq_all_to_all(context, 1, 2, group), weights

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor) -> None:
        local = query.shape[2]
        if not self.seq_length_is_variable and self.local_seq_length is not None and local != self.local_seq_length:
            raise ValueError(
                f"sequence parallelism: a rank's slice has {local} tokens, but register_with_transformers was told "
                f"seq_length={self.global_seq_length} ({self.local_seq_length} a rank); pass seq_length_is_variable="
                "True for batches of varying length"
            )
        if query.shape[1] != self.attn_head_count or key.shape[1] != self.global_kv_head_count:
            raise ValueError(
                f"sequence parallelism: attention got {query.shape[1]} query and {key.shape[1]} key/value heads; the "
                f"model's config says {self.attn_head_count} and {self.global_kv_head_count}"
            )

    def _whole_positions(self, position_ids: torch.Tensor | None) -> torch.Tensor:
        if position_ids is None:
            raise ValueError(
                "sequence parallelism needs position_ids in every forward: without them each rank numbers its "
                "slice 0..s/p-1, and the whole sequence looks like p packed documents to attention. Put "
                "position_ids in the batch (torch.arange(seq_len) per sample; restarting at each document for "
                "packed ones) before the batch is sharded: UlyssesSPDataLoaderAdapter requires them"
            )
        parts = [torch.empty_like(position_ids) for _ in range(self.world_size)]
        all_gather(parts, position_ids.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=1)

    def _mask_for_whole_sequence(self, attention_mask: Any, q: torch.Tensor) -> Any:
        """None (causal attention over the whole sequence), or for flex attention a causal BlockMask of it."""
        if self.core_attn_implementation != "flex_attention" or attention_mask is None:
            return None
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        if not isinstance(attention_mask, BlockMask):
            return None
        shape = (q.shape[0], q.shape[2])
        if self._block_mask is None or self._block_mask[0] != shape:  # one per shape: every layer shares it

            def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return q_idx >= kv_idx

            mask = create_block_mask(causal, B=shape[0], H=None, Q_LEN=shape[1], KV_LEN=shape[1], device=q.device)
            self._block_mask = (shape, mask)
        return self._block_mask[1]

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> Any:
        """Make the sequence-parallel groups and route `core_attn_implementation` through the wrapper;
        returns the mpu (engine.parallel.sequence_groups, DeepSpeed's parallel_state_sp interface) to pass
        to initialize, or None when sequence_parallel_size is 1."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length  # max_length: DeepSpeed's old name
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "register_with_transformers: seq_length_is_variable=False needs seq_length (every batch's length)"
            )
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config = getattr(model_name_or_path, "config", None) or AutoConfig.from_pretrained(model_name_or_path)
        _check_implementation(config, core_attn_implementation, ALL_ATTENTION_FUNCTIONS)
        made = sequence_groups.initialize_sequence_parallel(sequence_parallel_size)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        core = getattr(core, "ulysses_core", core)  # registered before: wrap the original, not the wrapper
        wrapper = cls(
            attn=core,
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
            kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=made.group,
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length is None else seq_length // sequence_parallel_size,
            global_seq_length=seq_length,
            disable_in_eval=disable_in_eval,
        )
        wrapper.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            return wrapper(module, *args, **kwargs)

        ulysses_attention.ulysses_core = core  # type: ignore[attr-defined]
        ulysses_attention.ulysses = wrapper  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        return sequence_groups


def _check_implementation(config: Any, implementation: str, functions: Any) -> None:
    configured = getattr(config, "_attn_implementation", None)
    if configured is not None and configured != implementation:
        raise ValueError(
            f"register_with_transformers: core_attn_implementation={implementation!r} but the model's config uses "
            f"attn_implementation={configured!r}: load the model with attn_implementation={implementation!r} (or "
            "pass that name) so the sequence-parallel wrapper sits on the path the model takes"
        )
    if implementation in UNSUPPORTED_ATTENTION:
        raise ValueError(
            f"sequence parallelism with attn_implementation={implementation!r}: eager attention needs a 4D mask of "
            "the whole sequence (O(s^2) memory) and cannot attend causally without it; use 'sdpa', "
            "'flex_attention' or a flash attention"
        )
    if implementation not in functions:
        raise ValueError(
            f"attn_implementation={implementation!r} is not one of transformers' attention functions "
            f"({', '.join(sorted(functions.valid_keys()))})"
        )
