"""ALST's tiled compute (arXiv 2506.13996): per-token work run on tiles of the sequence, so
that its large intermediate activations never exist for the whole sequence at once.

At long sequence lengths the memory of a transformer layer is dominated by tensors that are wider than
the hidden states and live only inside one block: a Llama MLP's gate, up and SiLU outputs
([b, s, intermediate], each ~3.5x the hidden states), and at the loss the logits ([b, s, vocab], the
vocabulary 16-32x the hidden size in Llama 3; cross entropy adds an fp32 copy and a gradient as large).
These blocks act on each token independently, so they can run on a tile of s / shards tokens at a time:

- forward: each tile runs without grad and only its output is kept (concatenated, or reduced to a loss);
  the inputs are saved whole, as they already exist;
- backward: each tile is run again with grad and backpropagated at once, its input's gradient copied
  into the whole one, so the recomputed graph of one tile at most is alive at any moment.

What exists whole is the block's input, its output and the input's gradient ([b, s, hidden]); the wide
intermediates exist for one tile at a time.

As with reentrant activation checkpointing (and in DeepSpeed), autograd runs the backward only when an
input tensor requires grad: the parameters `fn` reaches through `module` are not inputs, so when the tiled
input does not require grad (everything below it frozen) they get no gradient. The price is a second forward of the tiled block, as with
activation checkpointing (a third one if the layer is checkpointed too). The recompute runs under the
forward's randomness and autocast (engine/activation_checkpointing/function.py's `Replay`), so dropout
and mixed precision give the forward's values.

- `sequence_tiled_compute` (`SequenceTiledCompute`): any function of tensors [b, s, ...] tiled along
  dim 1; outputs concatenated along `output_unshard_dimension`, or reduced by "mean" or "sum";
- `TiledMLP`: an MLP module's forward tiled along dim -2 ([b, s, h] or the [tokens, h] of MoE experts);
- `TiledFusedLogitsLoss`: lm_head + loss per tile of the flattened tokens: the whole logits never exist.

# [Note: tiles]
A sequence of n tokens in `shards` tiles is cut as torch.chunk cuts it: tiles of ceil(n / shards)
tokens, the last one shorter; when the rounding leaves nothing for the last ones there are fewer tiles
(9 tokens in 4 shards: 3, 3, 3), and a "mean" is over the tiles there are. A "mean" of per-tile losses is
the mean over tokens only when every tile has as many counted tokens: with a mask, ignored labels or an
uneven last tile, return per-tile sums and reduce with "sum", dividing by the token count in `fn`.

# [Note: parameter gradients]
Each tile's backward adds into the parameters' `.grad`, so a parameter's gradient is complete only after
the last tile, while the engine's ZeRO stages react to every accumulation (post-accumulate-grad hooks).
DeepSpeed's convention, read by engine/zero/owners.grad_is_ready: `param.ds_grad_is_ready` is False on
the trainable parameters in `compute_params` during every tile's backward but the last and True during
the last one (and after, also when a tile fails), so a stage reduces the gradient once, whole.

# [Note: differences from DeepSpeed]
Same names, signatures and forward values. Where DeepSpeed's behaviour is not consistent we do this:
- `TiledFusedLogitsLoss` recomputes each tile in the backward. DeepSpeed backpropagates during the
  forward with a gradient of 1 and only scales the input's gradient by the incoming one, so the head's
  gradient misses any scaling of the loss (the division by gradient_accumulation_steps in
  engine.backward, an fp16 loss scale) and reaches ZeRO's hooks before the backward has begun;
- every tile that exists is run and counted (DeepSpeed can call `fn` on an empty tile, or leave the
  flags False when torch.chunk makes fewer tiles than `shards`); `compute_params=None` is accepted;
- `sequence_tiled_compute` with a reduction and `output_unshard_dimension` != 0 has the gradient of that
  reduction (DeepSpeed's backward assumes one scalar per tile);
- refused rather than mishandled: a sharded tensor other than `grad_requiring_tensor_key` that requires
  grad (it would get no gradient), a passed one that requires grad and is not a leaf (its gradient would
  need a backward through the outer graph once per tile).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from engine.activation_checkpointing.function import Replay

_REDUCTIONS = (None, "mean", "sum")

Tiles = list[tuple[int, int]]
"""(start, length) of each tile along the tiled dimension."""


def tile_bounds(length: int, shards: int) -> Tiles:
    """The tiles of `length` tokens in `shards` (see [Note: tiles])."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"tiled compute: shards={shards!r} must be an int >= 1")
    if length < 1:
        raise ValueError(f"tiled compute: nothing to tile, the sequence has {length} tokens")
    size = math.ceil(length / shards)
    return [(start, min(size, length - start)) for start in range(0, length, size)]


def _trainable(params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    return [p for p in params or () if p.requires_grad]


def _mark_ready(params: Sequence[torch.Tensor], ready: bool) -> None:
    for param in params:
        param.ds_grad_is_ready = ready  # type: ignore[attr-defined]


def _check_reduction(reduction: str | None, allowed: Sequence[str | None]) -> None:
    if reduction not in allowed:
        raise ValueError(f"tiled compute: unknown output_reduction {reduction!r}; valid values: {list(allowed)}")


def _combine(outputs: list[torch.Tensor], dim: int, reduction: str | None) -> torch.Tensor:
    """The tiles' outputs as one: side by side along `dim` (dim 0: stacked, one row per tile, as for
    per-tile losses), then reduced over every element."""
    if dim == 0:
        whole = torch.cat([out.unsqueeze(0) for out in outputs], dim=0)
    else:
        whole = torch.cat(outputs, dim=dim)
    if reduction == "mean":
        return whole.mean()
    if reduction == "sum":
        return whole.sum()
    return whole


def _output_grads(
    grad: torch.Tensor, shapes: list[torch.Size], dim: int, reduction: str | None
) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """Each tile's share of the gradient of `_combine`'s result: the adjoint of its cat and reduction."""
    if reduction is not None:
        # Every element of every tile's output went into one sum (or mean): each gets the same gradient.
        count = sum(math.prod(shape) for shape in shapes)
        each = grad / count if reduction == "mean" else grad
        return [each.expand(shape) for shape in shapes]
    if dim == 0:
        return grad.unbind(0)
    return grad.split([shape[dim] for shape in shapes], dim=dim)


def _backward_tiles(
    x: torch.Tensor,
    dim: int,
    tiles: Tiles,
    replays: list[Replay],
    params: list[torch.Tensor],
    needs_x_grad: bool,
    run_tile: Callable[[int, torch.Tensor], torch.Tensor],
    output_grads: Sequence[torch.Tensor],
) -> torch.Tensor | None:
    """Recompute and backpropagate tile by tile: `run_tile(i, x_tile)` is tile i's output, whose gradient is
    `output_grads[i]`. Parameters' gradients accumulate in their `.grad`; x's is returned whole."""
    x_grad = torch.empty_like(x) if needs_x_grad else None
    source = x.detach()  # the recompute starts a graph of its own: no way back into the outer one
    try:
        for i, (start, length) in enumerate(tiles):
            _mark_ready(params, i == len(tiles) - 1)  # [Note: parameter gradients]
            tile = source.narrow(dim, start, length).requires_grad_(needs_x_grad)
            with replays[i].replaying():  # grad on, the forward's RNG and autocast
                out = run_tile(i, tile)
            if out.requires_grad:  # False when neither x nor any parameter in the tile needs a gradient
                torch.autograd.backward(out, output_grads[i])
            if x_grad is not None:
                # A tile's gradient is written once, not accumulated: an empty buffer suffices, and the
                # tile's own .grad (fresh, laid out as autograd likes) lives for one tile only.
                dest = x_grad.narrow(dim, start, length)
                if tile.grad is None:
                    dest.zero_()
                else:
                    dest.copy_(tile.grad)
    finally:
        _mark_ready(params, True)
    return x_grad


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """`fn(**kwargs_to_shard, **kwargs_to_pass)` computed in `shards` tiles of dim 1 (the sequence, `seqlen`
    long) of every tensor in `kwargs_to_shard` ([b, seqlen, ...]); `kwargs_to_pass` go to every tile as they
    are. Only `kwargs_to_shard[grad_requiring_tensor_key]` gets a gradient (parameters `fn` uses get theirs
    through `.grad`); `compute_params` are those parameters, flagged for ZeRO (module docstring).

    The tiles' outputs are concatenated along `output_unshard_dimension` (0: stacked, one per tile, for
    per-tile losses), then `output_reduction` ("mean", "sum", or None for none) reduces all their elements.
    DeepSpeed's API: a wrapper because an autograd.Function takes no dicts and no defaults."""
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


_SEQUENCE_LEADING = 9
"""SequenceTiledCompute.forward's arguments before the tensors: they get no gradient."""


def _check_sequence_inputs(sharded: dict[str, Any], passed: dict[str, Any], seqlen: int, key: str) -> None:
    if key not in sharded:
        raise ValueError(
            f"tiled compute: grad_requiring_tensor_key {key!r} is not one of kwargs_to_shard {list(sharded)}"
        )
    for name, value in sharded.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"tiled compute: kwargs_to_shard[{name!r}] must be a tensor [b, {seqlen}, ...], got {shape}"
            )
        if name != key and value.requires_grad:
            raise ValueError(
                f"tiled compute: kwargs_to_shard[{name!r}] requires grad but only {key!r} gets a gradient; "
                "detach it, or tile that computation separately"
            )
    for name, value in passed.items():
        # A parameter-like leaf gets its gradient per tile through .grad; a non-leaf would need a backward
        # through the outer graph from inside this one, once per tile.
        if isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is not None:
            raise ValueError(f"tiled compute: kwargs_to_pass[{name!r}] requires grad and is not a leaf: detach it")


def _narrowed(tensors: dict[str, torch.Tensor], dim: int, start: int, length: int) -> dict[str, torch.Tensor]:
    return {name: value.detach().narrow(dim, start, length) for name, value in tensors.items()}


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd Function behind `sequence_tiled_compute` (DeepSpeed's positional arguments)."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Iterable[torch.Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: Any,
    ) -> torch.Tensor:
        _check_reduction(output_reduction, _REDUCTIONS)
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(f"tiled compute: {len(args)} values for keys {keys_to_shard + keys_to_pass}")
        sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard) :]))
        _check_sequence_inputs(sharded, passed, seqlen, grad_requiring_tensor_key)

        tiles = tile_bounds(seqlen, shards)
        outputs, replays = [], []
        for start, length in tiles:  # Function.forward runs without grad: each tile's graph is never built
            replays.append(Replay.capture())
            outputs.append(fn(**_narrowed(sharded, 1, start, length), **passed))

        ctx.save_for_backward(*sharded.values())
        ctx.fn, ctx.keys, ctx.passed, ctx.key = fn, keys_to_shard, passed, grad_requiring_tensor_key
        ctx.tiles, ctx.replays, ctx.params = tiles, replays, _trainable(compute_params)
        ctx.dim, ctx.reduction, ctx.shapes = output_unshard_dimension, output_reduction, [o.shape for o in outputs]
        ctx.n_args = len(args)
        return _combine(outputs, output_unshard_dimension, output_reduction)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sharded = dict(zip(ctx.keys, ctx.saved_tensors))
        index = ctx.keys.index(ctx.key)

        def run_tile(i: int, tile: torch.Tensor) -> torch.Tensor:
            kwargs = _narrowed(sharded, 1, *ctx.tiles[i])
            kwargs[ctx.key] = tile
            return ctx.fn(**kwargs, **ctx.passed)

        x_grad = _backward_tiles(
            sharded[ctx.key],
            1,
            ctx.tiles,
            ctx.replays,
            ctx.params,
            ctx.needs_input_grad[_SEQUENCE_LEADING + index],
            run_tile,
            _output_grads(grad, ctx.shapes, ctx.dim, ctx.reduction),
        )
        grads: list[torch.Tensor | None] = [None] * (_SEQUENCE_LEADING + ctx.n_args)
        grads[_SEQUENCE_LEADING + index] = x_grad
        return tuple(grads)


class TiledMLP(torch.autograd.Function):
    """`fn(module, x)` in `shards` tiles of x's dim -2 (the sequence of [b, s, h], the tokens of an MoE
    expert's [tokens, h]): an MLP's wide intermediates exist one tile at a time. `compute_params`: the
    module's parameters, flagged for ZeRO (module docstring). DeepSpeed's use, in a patched forward:

        def forward(self, x):
            params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
            return TiledMLP.apply(mlp_forward, self, x, math.ceil(x.shape[-2] / x.shape[-1]), params)

    (under sequence parallelism every rank must use the same shards: all-reduce its maximum first, since a
    ZeRO-3 gather per tile is a collective.)"""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[[Any, torch.Tensor], torch.Tensor],
        module: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None,
    ) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [..., seq, hidden], got shape {tuple(x.shape)}")
        tiles = tile_bounds(x.shape[-2], shards)
        outputs, replays = [], []
        for start, length in tiles:
            replays.append(Replay.capture())
            outputs.append(fn(module, x.narrow(-2, start, length)))
        ctx.save_for_backward(x)
        ctx.fn, ctx.module, ctx.tiles, ctx.replays = fn, module, tiles, replays
        ctx.params = _trainable(compute_params)
        return torch.cat(outputs, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        x_grad = _backward_tiles(
            x,
            -2,
            ctx.tiles,
            ctx.replays,
            ctx.params,
            ctx.needs_input_grad[2],
            lambda i, tile: ctx.fn(ctx.module, tile),
            grad.split([length for _, length in ctx.tiles], dim=-2),
        )
        return None, None, x_grad, None, None


def _check_loss_inputs(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> None:
    if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
        raise ValueError(
            f"TiledFusedLogitsLoss: x and y must be [batch, seq, ...] alike, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if mask is not None and mask.shape != x.shape[:2]:
        raise ValueError(
            f"TiledFusedLogitsLoss: mask must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}"
        )


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss from hidden states `x` [b, s, h] and targets `y` [b, s, ...], computed by `fn(module, x, y)`
    (`fn(module, x, y, mask)` when a [b, s] `mask` is given) in `shards` tiles of the b*s flattened tokens
    (as DeepSpeed tiles them: `fn` sees [tokens, h]): lm_head and loss per tile, so the logits exist one tile
    at a time. Per-tile losses are combined by `output_reduction`, "mean" (over tiles) or "sum" (see
    [Note: tiles] for a mean over tokens). `compute_params`: lm_head's parameters, flagged for ZeRO.

        loss = TiledFusedLogitsLoss.apply(loss_fn, model, hidden, shift_labels, None, 4, [head.weight], "mean")

    The backward recomputes each tile ([Note: differences from DeepSpeed])."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        module: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None,
        output_reduction: str,
    ) -> torch.Tensor:
        _check_reduction(output_reduction, ("mean", "sum"))
        _check_loss_inputs(x, y, mask)
        flat = _flat_tokens(x, y, mask)
        tiles = tile_bounds(flat[0].shape[0], shards)
        outputs, replays = [], []
        for start, length in tiles:
            replays.append(Replay.capture())
            outputs.append(fn(module, *_narrowed_list(flat, start, length)))
        ctx.save_for_backward(x, y, mask)
        ctx.fn, ctx.module, ctx.tiles, ctx.replays = fn, module, tiles, replays
        ctx.params, ctx.reduction, ctx.shapes = _trainable(compute_params), output_reduction, [o.shape for o in outputs]
        return _combine(outputs, 0, output_reduction)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, y, mask = ctx.saved_tensors
        flat = _flat_tokens(x, y, mask)

        def run_tile(i: int, tile: torch.Tensor) -> torch.Tensor:
            rest = _narrowed_list(flat[1:], *ctx.tiles[i])
            return ctx.fn(ctx.module, tile, *rest)

        x_grad = _backward_tiles(
            flat[0],
            0,
            ctx.tiles,
            ctx.replays,
            ctx.params,
            ctx.needs_input_grad[2],
            run_tile,
            _output_grads(grad, ctx.shapes, 0, ctx.reduction),
        )
        return None, None, None if x_grad is None else x_grad.view(x.shape), None, None, None, None, None


def _flat_tokens(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """x, y (and mask) with batch and sequence flattened into one token dimension."""
    flat = [x.flatten(0, 1), y.flatten(0, 1)]
    return flat if mask is None else [*flat, mask.flatten()]


def _narrowed_list(tensors: list[torch.Tensor], start: int, length: int) -> list[torch.Tensor]:
    return [t.detach().narrow(0, start, length) for t in tensors]
