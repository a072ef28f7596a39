"""Megatron's tensor-parallel layers (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding), built
from the region boundaries in mappings.py.

A tensor-parallel MLP splits the first weight by rows (output features) and the second by columns
(input features), so the hidden activation never leaves its rank:

    x ──copy──> [X W1_r^T + b1_r] ─gelu─> [h_r W2_r^T] ──reduce──> + b2     (r: this TP rank)
       identity fwd                                       all-reduce fwd
       all-reduce bwd                                     identity bwd

# [Note: a TP layer is a slice of a dense layer]
# By default a layer initialises the FULL weight exactly as the dense torch layer would (same
# draws, in the same order, from torch's default generator or the `generator` given) and keeps this
# rank's slice. So seeding every rank alike and building the TP model gives the dense model's
# weights, split; the parity tests and users' own checks rely on it. The full weight exists only
# during construction (Megatron's use_cpu_initialization does the same). from_dense() slices an
# existing nn.Linear / nn.Embedding instead.

Parameters carry Megatron's attributes (set_tensor_model_parallel_attributes): `tensor_model_parallel`
(True: each TP rank holds a different slice; False: replicated on every TP rank, such as
RowParallelLinear's bias), `partition_dim` and `partition_stride`, so a gradient norm over the
model counts a replicated parameter once (param_is_not_tensor_parallel_duplicate).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Self

from engine.comm import ProcessGroup
from engine.config.errors import ConfigError
from engine.parallel.mappings import (
    check_divisible,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    resolve_group,
    scatter_to_tensor_parallel_region,
    size_and_rank,
)

InitMethod = Callable[[torch.Tensor], object]
"""Fills a full (dense) weight in place, drawing from torch's default generator (Megatron's init_method)."""


# ------------------------------------------------------------------ parameter attributes (Megatron's names)
def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Mark `param` as this rank's slice along `dim` (is_parallel) or as replicated across the
    tensor-parallel group (is_parallel False, dim -1)."""
    param.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = stride  # type: ignore[attr-defined]


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Megatron's mark of a tensor each tensor-parallel rank holds a different slice of."""
    return bool(getattr(param, "tensor_model_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, group: ProcessGroup | None = None) -> bool:
    """True when this rank's copy of `param` must be counted (a norm, a checksum): every slice of a
    split parameter, a replicated one only on the group's first rank."""
    if is_tensor_parallel(param):
        return True
    return size_and_rank(resolve_group(group))[1] == 0


# ------------------------------------------------------------------ initialisation (see [Note: a TP layer ...])
@contextmanager
def _drawing_from(generator: torch.Generator | None) -> Iterator[None]:
    """Make torch's default CPU generator draw from `generator` inside the block (init functions
    such as an init_method take no generator argument); `generator` advances as if it drew."""
    if generator is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(generator.get_state())
        yield
        generator.set_state(torch.get_rng_state())


def _linear_init(weight: torch.Tensor, bias: torch.Tensor | None, init_method: InitMethod | None) -> None:
    """nn.Linear.reset_parameters' draws when init_method is None; else init_method on the weight
    and a zero bias (Megatron's)."""
    with torch.no_grad():
        if init_method is not None:
            init_method(weight)
            if bias is not None:
                bias.zero_()
            return
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if bias is not None:
            bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0.0
            nn.init.uniform_(bias, -bound, bound)


def _skip_init(weight: torch.Tensor) -> None:
    """For from_dense: the values are copied in afterwards."""


def _dense_linear(
    input_size: int,
    output_size: int,
    bias: bool,
    init_method: InitMethod | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.empty(output_size, input_size, dtype=dtype, device=device)
    full_bias = torch.empty(output_size, dtype=dtype, device=device) if bias else None
    with _drawing_from(generator):
        _linear_init(weight, full_bias, init_method)
    return weight, full_bias


def _check_dense_linear(linear: nn.Linear) -> None:
    if type(linear) is not nn.Linear:
        raise ConfigError(f"from_dense expects a torch.nn.Linear, got {type(linear).__name__}")


# ------------------------------------------------------------------ layers
class _ParallelLinear(nn.Module):
    """What ColumnParallelLinear and RowParallelLinear share: the full weight initialised as
    nn.Linear's and split along `split_dim` of the weight (0: rows, output features; 1: columns,
    input features). The bias is split with the rows, or replicated when the columns are split."""

    split_dim: int
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        init_method: InitMethod | None,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        generator: torch.Generator | None,
        group: ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.tp_size, self.tp_rank = size_and_rank(self.group)
        self.input_size, self.output_size = input_size, output_size
        split_name, split_size = ("output_size", output_size) if self.split_dim == 0 else ("input_size", input_size)
        self.size_per_partition = check_divisible(split_name, split_size, self.tp_size)
        full_weight, full_bias = _dense_linear(input_size, output_size, bias, init_method, dtype, device, generator)
        self._keep_slice(full_weight, full_bias)

    def _keep_slice(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None, parts: int = 1) -> None:
        """Keep this rank's slice along split_dim; with `parts` > 1 the dimension holds that many equal
        parts (a fused [q; k; v]) and this rank keeps its slice of each, concatenated in order
        (Megatron's partition_stride)."""
        self.weight = nn.Parameter(self._mine(full_weight, self.split_dim, parts))
        set_tensor_model_parallel_attributes(self.weight, True, self.split_dim, parts)
        if full_bias is None:
            self.register_parameter("bias", None)
        elif self.split_dim == 0:
            self.bias = nn.Parameter(self._mine(full_bias, 0, parts))
            set_tensor_model_parallel_attributes(self.bias, True, 0, parts)
        else:
            self.bias = nn.Parameter(full_bias.detach().clone())
            set_tensor_model_parallel_attributes(self.bias, False, -1)

    @classmethod
    def _sliced(cls, linear: nn.Linear, group: ProcessGroup | None, parts: int, **flag: Any) -> Self:
        """from_dense: a layer of `linear`'s sizes, dtype and device holding this rank's slice of its
        values (copied), in its training mode, with its parameters' requires_grad. `flag`: the
        subclass's own constructor argument (gather_output or input_is_parallel)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            init_method=_skip_init,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            group=group,
            **flag,
        )
        dense_name = ("out_features", "in_features")[layer.split_dim]
        check_divisible(f"{dense_name} / {parts}", linear.weight.shape[layer.split_dim] // parts, layer.tp_size)
        layer._keep_slice(linear.weight, linear.bias, parts)
        layer.train(linear.training)
        for name, param in layer.named_parameters(recurse=False):
            param.requires_grad_(getattr(linear, name).requires_grad)
        return layer

    def _mine(self, full: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
        width = self.size_per_partition // parts
        pieces = [part.narrow(dim, self.tp_rank * width, width) for part in full.detach().chunk(parts, dim)]
        return torch.cat(pieces, dim).clone() if parts > 1 else pieces[0].clone()


class ColumnParallelLinear(_ParallelLinear):
    """Y = X W^T + b with W split by rows (output features): this rank holds W's rows
    [r * output_size/tp, (r+1) * output_size/tp) and the same slice of b, and computes that slice
    of Y. gather_output=True concatenates the slices (every rank gets the full Y); False leaves
    Y split along its last dimension, for a RowParallelLinear(input_is_parallel=True) next."""

    split_dim = 0
    # weight: (output_size / tp, input_size), this rank's rows; bias: (output_size / tp,), its slice

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(input_size, output_size, bias, init_method, dtype, device, generator, group)
        self.gather_output = gather_output
        self.output_size_per_partition = self.size_per_partition

    @classmethod
    def from_dense(
        cls, linear: nn.Linear, gather_output: bool = True, group: ProcessGroup | None = None, *, parts: int = 1
    ) -> ColumnParallelLinear:
        """This rank's rows of an existing nn.Linear (copied; same dtype and device).

        parts > 1: the output features are that many equal parts stacked (a fused qkv Linear is
        [q; k; v], parts=3) and this rank keeps its rows of each part: [q_r; k_r; v_r], so its heads'
        q, k and v. The output then stays split (gather_output=False): gathering it would interleave
        the ranks' parts instead of restoring the dense order."""
        _check_dense_linear(linear)
        if parts < 1 or linear.out_features % parts:
            raise ConfigError(f"from_dense: out_features {linear.out_features} is not {parts} equal parts")
        if parts > 1 and gather_output:
            raise ConfigError(
                f"from_dense: a Linear of {parts} fused parts must keep its output split; pass "
                "gather_output=False (gathering would interleave the ranks' parts)"
            )
        return cls._sliced(linear, group, parts, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size} (this rank: "
            f"{self.output_size_per_partition}), bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_ParallelLinear):
    """Y = X W^T + b with W split by columns (input features): this rank holds W's columns
    [r * input_size/tp, (r+1) * input_size/tp), multiplies them by the same slice of X's last
    dimension, and the partial products are summed across the group (all-reduce). b is replicated
    and added after the sum. input_is_parallel=True takes X already split (a
    ColumnParallelLinear(gather_output=False)'s output); False takes the full X and keeps its slice."""

    split_dim = 1
    # weight: (output_size, input_size / tp), this rank's columns; bias: (output_size,), replicated
    # on every TP rank (tensor_model_parallel False)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(input_size, output_size, bias, init_method, dtype, device, generator, group)
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = self.size_per_partition

    @classmethod
    def from_dense(
        cls, linear: nn.Linear, input_is_parallel: bool = False, group: ProcessGroup | None = None
    ) -> RowParallelLinear:
        """This rank's columns of an existing nn.Linear, and its whole bias (copied)."""
        _check_dense_linear(linear)
        return cls._sliced(linear, group, 1, input_is_parallel=input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_slice = x if self.input_is_parallel else scatter_to_tensor_parallel_region(x, self.group)
        y = reduce_from_tensor_parallel_region(F.linear(x_slice, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size} (this rank: {self.input_size_per_partition}), "
            f"output_size={self.output_size}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with the vocabulary split into contiguous ranges: this rank holds rows
    [r * num_embeddings/tp, (r+1) * num_embeddings/tp). Ids outside the range look up zeros here,
    and an all-reduce sums the ranks' lookups (exactly one rank contributes each id's row).
    Default init is nn.Embedding's (normal(0, 1) on the full table, padding_idx's row zeroed)."""

    weight: torch.Tensor  # (num_embeddings / tp, embedding_dim): this rank's vocabulary rows

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.tp_size, self.tp_rank = size_and_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ConfigError(f"padding_idx {padding_idx} is outside the vocabulary of {num_embeddings}")
        self.padding_idx = padding_idx % num_embeddings if padding_idx is not None else None
        self.num_embeddings_per_partition = check_divisible("num_embeddings", num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        full = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device)
        with _drawing_from(generator), torch.no_grad():
            (init_method or nn.init.normal_)(full)
            if self.padding_idx is not None:
                full[self.padding_idx].zero_()
        self._keep_slice(full)

    def _keep_slice(self, full: torch.Tensor) -> None:
        self.weight = nn.Parameter(full.detach()[self.vocab_start : self.vocab_end].clone())
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group: ProcessGroup | None = None) -> VocabParallelEmbedding:
        """This rank's vocabulary rows of an existing nn.Embedding (copied)."""
        if type(embedding) is not nn.Embedding:
            raise ConfigError(f"from_dense expects a torch.nn.Embedding, got {type(embedding).__name__}")
        unsupported = [
            name
            for name, on in (
                ("max_norm", embedding.max_norm is not None),
                ("scale_grad_by_freq", embedding.scale_grad_by_freq),
                ("sparse", embedding.sparse),
            )
            if on
        ]
        if unsupported:
            raise ConfigError(f"VocabParallelEmbedding does not support nn.Embedding's {', '.join(unsupported)}")
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            padding_idx=embedding.padding_idx,
            init_method=_skip_init,
            dtype=embedding.weight.dtype,
            device=embedding.weight.device,
            group=group,
        )
        layer._keep_slice(embedding.weight)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        rows = F.embedding(local_ids, self.weight, local_pad)
        # The zeroed lookups carry no gradient to row 0: masked_fill's backward zeroes it there.
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(rows, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (this rank: [{self.vocab_start}, {self.vocab_end})), {self.embedding_dim}" + (
            f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        )
