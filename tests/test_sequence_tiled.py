"""ALST's tiled compute (engine/sequence/tiled.py) against the same computation untiled, in one process.

Tiling runs the very same ops on slices of the tokens: every output element is computed from the same
inputs by the same kernels, and only sums over tokens (the parameters' gradients, a loss) are added in
another order, tile by tile. In fp32 that moves a result by a few ulps, so outputs, input gradients and
parameter gradients must agree within 1e-6.

Uneven tiles are cut as torch.chunk (and DeepSpeed) cuts them: ceil(n / shards) tokens, the last tile
shorter (10 tokens in 4 shards: 3, 3, 3, 1), and fewer tiles when the rounding leaves the last ones empty
(9 tokens in 4 shards: 3, 3, 3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

HIDDEN, INTER, VOCAB = 8, 24, 32
UNEVEN = [(12, 3, [4, 4, 4]), (10, 4, [3, 3, 3, 1]), (9, 4, [3, 3, 3])]
"""(seqlen, shards, the tile lengths expected)."""


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


class MLP(torch.nn.Module):
    """Llama's MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = torch.nn.Linear(INTER, HIDDEN, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def mlp_forward(module: MLP, x: torch.Tensor) -> torch.Tensor:
    return MLP.forward(module, x)


def pair(make: Callable[[], torch.nn.Module]) -> tuple[Any, Any]:
    """Two copies of one module: one to run untiled, one tiled."""
    torch.manual_seed(1)
    first = make()
    torch.manual_seed(1)
    return first, make()


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters()}  # type: ignore[misc]


def close_grads(tiled: torch.nn.Module, untiled: torch.nn.Module) -> None:
    for (name, actual), expected in zip(grads(tiled).items(), grads(untiled).values()):
        assert actual is not None, name
        close(actual, expected)


def tiled_mlp(module: MLP, x: torch.Tensor, shards: int, fn: Callable[..., torch.Tensor] = mlp_forward) -> Any:
    return TiledMLP.apply(fn, module, x, shards, list(module.parameters()))


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("seqlen,shards,lengths", UNEVEN)
def test_tiled_mlp_matches_untiled(bs: int, seqlen: int, shards: int, lengths: list[int]) -> None:
    """Two MLPs stacked, so the second one's input gradient must reach the first through the outer graph."""
    (a1, b1), (a2, b2) = pair(MLP), pair(MLP)
    x = torch.randn(bs, seqlen, HIDDEN)
    out_grad = torch.randn(bs, seqlen, HIDDEN)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    seen: list[int] = []

    def counting(module: MLP, tile: torch.Tensor) -> torch.Tensor:
        seen.append(tile.shape[-2])
        return mlp_forward(module, tile)

    expected = a2(a1(xa))
    actual = tiled_mlp(b2, tiled_mlp(b1, xb, shards, counting), shards)
    assert seen == lengths  # the forward's tiles
    close(actual, expected)
    (expected * out_grad).sum().backward()
    (actual * out_grad).sum().backward()
    assert seen == lengths * 2  # and the backward's recompute
    close(xb.grad, xa.grad)  # type: ignore[arg-type]
    close_grads(b1, a1)
    close_grads(b2, a2)


def scaled_mlp(x: torch.Tensor, scale: torch.Tensor, module: MLP, loss: bool) -> torch.Tensor:
    """An MLP times a per-token factor (a second sharded tensor, without grad), or the tile's loss of it."""
    out = mlp_forward(module, x) * scale
    return out.pow(2).mean() if loss else out


@pytest.mark.parametrize("dim,reduction", [(1, None), (1, "mean"), (1, "sum"), (0, None), (0, "mean"), (0, "sum")])
def test_sequence_tiled_compute_matches_untiled(dim: int, reduction: str | None) -> None:
    """dim 1: the function's output side by side (untiled: the function on the whole sequence); dim 0:
    one loss per tile (untiled: the same per-tile losses with ordinary autograd). Then the reduction."""
    a, b = pair(MLP)
    seqlen, shards, lengths = UNEVEN[1]
    x, scale = torch.randn(2, seqlen, HIDDEN), torch.rand(2, seqlen, 1)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    if dim == 1:
        expected = scaled_mlp(xa, scale, a, loss=False)
    else:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        per_tile = [scaled_mlp(xa[:, s : s + n], scale[:, s : s + n], a, True) for s, n in zip(starts, lengths)]
        expected = torch.stack(per_tile)
    if reduction is not None:
        expected = getattr(expected, reduction)()
    actual = sequence_tiled_compute(
        lambda x, scale, module: scaled_mlp(x, scale, module, loss=dim == 0),
        seqlen,
        shards,
        {"x": xb, "scale": scale},
        {"module": b},
        "x",
        list(b.parameters()),
        output_unshard_dimension=dim,
        output_reduction=reduction,
    )
    close(actual, expected)
    out_grad = torch.randn(expected.shape)  # the incoming gradient is used, whatever its shape
    (expected * out_grad).sum().backward()
    (actual * out_grad).sum().backward()
    close(xb.grad, xa.grad)  # type: ignore[arg-type]
    close_grads(b, a)


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def masked_token_sum(head: Head, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """Cross entropy summed over the unmasked, non-ignored tokens, over the batch's count of such tokens:
    with "sum", the token mean of the whole batch, however the tiles divide the tokens."""
    logits = head.lm_head(x).view(-1, VOCAB)
    losses = torch.nn.functional.cross_entropy(logits, y.view(-1), ignore_index=-100, reduction="none")
    return (losses * mask.view(-1)).sum() / count


def token_mean(head: Head, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's example loss: cross entropy averaged over the tile's non-ignored tokens."""
    return torch.nn.functional.cross_entropy(head.lm_head(x).view(-1, VOCAB), y.view(-1), ignore_index=-100)


def labels(bs: int, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, VOCAB, (bs, seqlen))
    y[:, 1::4] = -100  # every tile keeps counted tokens: an all-ignored tile's mean is nan, untiled or not
    mask = torch.rand(bs, seqlen) > 0.3
    return y, mask.to(torch.float32)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("seqlen,shards,lengths", UNEVEN)
def test_tiled_fused_logits_loss_sum_matches_untiled(bs: int, seqlen: int, shards: int, lengths: list[int]) -> None:
    """With "sum" and a per-tile sum over the batch's token count, the tiled loss is the untiled token mean.
    The backward's incoming gradient (0.25, as engine.backward divides by gradient_accumulation_steps)
    scales the head's gradient as well as the input's."""
    a, b = pair(Head)
    x = torch.randn(bs, seqlen, HIDDEN)
    y, mask = labels(bs, seqlen)
    count = int(((y != -100) * mask).sum())
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()

    def fn(head: Head, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_token_sum(head, x, y, mask, count)

    expected = fn(a, xa, y, mask)
    actual = TiledFusedLogitsLoss.apply(fn, b, xb, y, mask, shards, [b.lm_head.weight], "sum")
    close(actual, expected)
    (expected * 0.25).backward()
    (actual * 0.25).backward()
    close(xb.grad, xa.grad)  # type: ignore[arg-type]
    close_grads(b, a)


@pytest.mark.parametrize("bs", [1, 2])
def test_tiled_fused_logits_loss_mean_is_over_tiles(bs: int) -> None:
    """ "mean": the mean of the tiles' losses; tiles cut the flattened b*s tokens (DeepSpeed's tiling)."""
    a, b = pair(Head)
    seqlen, shards = 10, 3
    x = torch.randn(bs, seqlen, HIDDEN)
    y, _ = labels(bs, seqlen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    tokens = bs * seqlen
    step = -(-tokens // shards)
    flat_x, flat_y = xa.view(tokens, HIDDEN), y.view(tokens)
    expected = torch.stack([token_mean(a, flat_x[s : s + step], flat_y[s : s + step]) for s in range(0, tokens, step)])
    expected = expected.mean()
    actual = TiledFusedLogitsLoss.apply(token_mean, b, xb, y, None, shards, [b.lm_head.weight], "mean")
    close(actual, expected)
    expected.backward()
    actual.backward()
    close(xb.grad, xa.grad)  # type: ignore[arg-type]
    close_grads(b, a)


def record_ready(module: torch.nn.Module) -> dict[str, list[bool]]:
    """Each parameter's ds_grad_is_ready at each accumulation into its .grad, as a ZeRO stage's hook sees it."""
    seen: dict[str, list[bool]] = {}
    for name, p in module.named_parameters():
        seen[name] = []
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen[name].append(p.ds_grad_is_ready))
    return seen


@pytest.mark.parametrize("which", ["mlp", "sequence", "loss"])
@pytest.mark.parametrize("seqlen,shards,lengths", UNEVEN)
def test_grad_ready_only_at_the_last_tile(which: str, seqlen: int, shards: int, lengths: list[int]) -> None:
    """False during every tile's backward but the last, True during the last one and after; nothing is
    accumulated during the forward (also for the loss, which DeepSpeed backpropagates in its forward)."""
    x = torch.randn(1, seqlen, HIDDEN, requires_grad=True)
    module = Head() if which == "loss" else MLP()
    params = list(module.parameters())
    seen = record_ready(module)
    if which == "loss":
        y, _ = labels(1, seqlen)
        out = TiledFusedLogitsLoss.apply(token_mean, module, x, y, None, shards, params, "sum")
    elif which == "mlp":
        out = TiledMLP.apply(mlp_forward, module, x, shards, params)
    else:
        fn = lambda x, module: mlp_forward(module, x)
        out = sequence_tiled_compute(fn, seqlen, shards, {"x": x}, {"module": module}, "x", params)
    assert all(flags == [] for flags in seen.values())
    assert not any(hasattr(p, "ds_grad_is_ready") for p in module.parameters())
    out.sum().backward()
    for flags in seen.values():
        assert flags == [False] * (len(lengths) - 1) + [True]
    assert all(p.ds_grad_is_ready is True for p in module.parameters())  # type: ignore[attr-defined]


def test_grad_ready_restored_when_a_tile_fails() -> None:
    module, calls = MLP(), []

    def failing(module: MLP, x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        if calls == [False, False, True, True]:  # the second tile of the backward's recompute
            raise RuntimeError("tile failed")
        return mlp_forward(module, x)

    out = tiled_mlp(module, torch.randn(1, 4, HIDDEN, requires_grad=True), 2, failing)
    with pytest.raises(RuntimeError, match="tile failed"):
        out.sum().backward()
    assert all(p.ds_grad_is_ready is True for p in module.parameters())  # type: ignore[attr-defined]


class SavedSizes:
    """The numel of every activation autograd saves under it (parameters, which a Linear saves, left out)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.sizes: list[int] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.params:
            self.sizes.append(t.numel())
        return t

    def __call__(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def test_tiled_mlp_keeps_no_full_length_intermediate() -> None:
    """The forward keeps only its input; the backward's recompute saves intermediates of one tile at most.
    Untiled, the MLP saves [b, s, intermediate] tensors, the size ALST removes."""
    bs, seqlen, shards = 2, 12, 4
    module = MLP()
    params = list(module.parameters())
    x = torch.randn(bs, seqlen, HIDDEN, requires_grad=True)
    full, tile = bs * seqlen * INTER, bs * (seqlen // shards) * INTER

    untiled = SavedSizes(params)
    with untiled():
        module(x)
    assert max(untiled.sizes) == full

    forward = SavedSizes(params)
    with forward():
        out = tiled_mlp(module, x, shards)
    assert forward.sizes == [x.numel()]

    recompute = SavedSizes(params)

    def recorded(module: MLP, x: torch.Tensor) -> torch.Tensor:
        with recompute():
            return mlp_forward(module, x)

    out = tiled_mlp(module, x, shards, recorded)
    out.sum().backward()
    assert recompute.sizes and max(recompute.sizes) == tile


def test_recompute_replays_dropout() -> None:
    """A tile's recompute draws the forward's dropout mask: the gradient is that of the forward that ran
    (untiled: the same tiles run with ordinary autograd from the same seed)."""
    a, b = pair(MLP)
    x = torch.randn(2, 9, HIDDEN)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()

    def dropped(module: MLP, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(mlp_forward(module, x), p=0.5)

    torch.manual_seed(7)
    expected = torch.cat([dropped(a, xa[:, s : s + 3]) for s in (0, 3, 6)], dim=1)
    torch.manual_seed(7)
    actual = tiled_mlp(b, xb, 3, dropped)
    torch.randn(100)  # the backward runs elsewhere in the random stream
    close(actual, expected)
    expected.pow(2).sum().backward()
    actual.pow(2).sum().backward()
    close(xb.grad, xa.grad)  # type: ignore[arg-type]
    close_grads(b, a)


def test_refused_inputs() -> None:
    module, x = MLP(), torch.randn(1, 6, HIDDEN, requires_grad=True)

    def call(sharded: dict[str, torch.Tensor], key: str = "x", reduction: str | None = None, seqlen: int = 6) -> Any:
        fn = lambda x, module, **_: mlp_forward(module, x)
        return sequence_tiled_compute(fn, seqlen, 2, sharded, {"module": module}, key, None, 1, reduction)

    with pytest.raises(ValueError, match="only 'x' gets a gradient"):
        call({"x": x, "other": torch.randn(1, 6, 1, requires_grad=True)})
    with pytest.raises(ValueError, match="not one of kwargs_to_shard"):
        call({"x": x}, key="y")
    with pytest.raises(ValueError, match="unknown output_reduction"):
        call({"x": x}, reduction="max")
    with pytest.raises(ValueError, match=r"must be a tensor \[b, 7"):
        call({"x": x}, seqlen=7)
    with pytest.raises(ValueError, match="shards=0"):
        TiledMLP.apply(mlp_forward, module, x, 0, None)
    assert issubclass(SequenceTiledCompute, torch.autograd.Function)
