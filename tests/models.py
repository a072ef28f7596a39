"""Small models and a single-process reference trainer shared by the parity tests."""

from __future__ import annotations

from typing import Any

import torch


class MLP(torch.nn.Module):
    """Four linear layers (eight parameters) and a buffer, enough to split into several buckets."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x * self.scale


def make_model(seed: int = 0, width: int = 16) -> MLP:
    torch.manual_seed(seed)
    return MLP(width)


class Block(torch.nn.Module):
    """A residual Linear + LayerNorm block: one gather unit at stage 3."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.lin(x)))


class TiedBlocks(torch.nn.Module):
    """An input layer, `blocks` Blocks (the second one's norm frozen: frozen parameters inside a unit)
    and an output layer tied to the input's weight (one Parameter in two modules, in stage 3's root
    unit, whose gradient bucket fills first and last)."""

    def __init__(self, blocks: int = 3, width: int = 16) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.blocks[1].norm.requires_grad_(False)
        self.out = torch.nn.Linear(width, width, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def global_batches(
    steps: int, global_batch: int, width: int = 16, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(global_batch, width, generator=g), torch.randn(global_batch, width, generator=g))
        for _ in range(steps)
    ]


def rank_micro_batch(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int, micro: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's k-th micro-batch of a global batch: rows [(k*ws + r)*micro, +micro)."""
    start = (k * world_size + rank) * micro
    return batch[0][start : start + micro], batch[1][start : start + micro]


def reference_train(
    batches: list[tuple[torch.Tensor, torch.Tensor]], optimizer_config: dict[str, Any], clip: float, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Plain single-process training on whole global batches: the ground truth."""
    model = make_model(seed)
    opt_type = optimizer_config["type"].lower()
    params = optimizer_config.get("params", {})
    if opt_type in ("adamw", "adam"):
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), **params)
    elif opt_type == "sgd":
        opt = torch.optim.SGD(model.parameters(), **params)
    else:
        raise ValueError(opt_type)
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


TINY_DECODER: dict[str, int] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
"""The shape of the transformers decoders the tests build from a config: 2 layers, 4 query heads over 2
key/value heads (grouped-query attention, split over 2 sequence-parallel ranks)."""


def tiny_hf_config(kind: str = "llama", experts: int = 4, top_k: int = 2, **overrides: Any) -> Any:
    """A transformers config of TINY_DECODER's shape: "llama", "mixtral" or "qwen2_moe" (`experts`, each token
    routed to `top_k`), with `overrides` (attn_implementation, pad_token_id, ...) on top."""
    import transformers

    shape = {**TINY_DECODER, **overrides}
    if kind == "llama":
        return transformers.LlamaConfig(**shape)
    if kind == "mixtral":
        return transformers.MixtralConfig(**shape, num_local_experts=experts, num_experts_per_tok=top_k)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **shape,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=experts,
            num_experts_per_tok=top_k,
            decoder_sparse_step=1,
        )
    raise ValueError(f"tiny_hf_config: unknown kind {kind!r}")
