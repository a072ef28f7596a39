"""What a rank holds of each trainable parameter, read and written by parameter: the machinery under
DeepSpeed's tensor-fragment functions (engine/zero/tensor_fragment.py: safe_get_full_fp32_param and
the rest).

Every stage describes what it holds as `HeldGroup`s: the optimizer's fp32 tensor (the master), the
reduced gradient laid out like it, and this rank's runs of each parameter in them (layout pieces,
engine/zero/layout.py). A stage builds them once and registers its `HeldState` for each of its
trainable parameters (engine/zero/owners.py); frozen parameters have none (DeepSpeed answers None).

# [Note: full values]
A parameter's full value is assembled from every rank's runs: each rank copies its runs into a buffer
of zeros and one all-reduce (sum) over the data-parallel group fills in the rest. Every element is
held by exactly one rank of the group (stages 1-3), so the sum adds only zeros to it: exact, in any
dtype, at any world size. At stage 0 every rank holds everything (`replicated`): no collective.
Several parameters share one buffer and one all-reduce (safe_update_full_grad_vectorized). Writing a
full value needs no collective: every rank is given the same value and keeps its own runs of it.

Gradients are read as the optimizer will see them before clipping: the mean over the data-parallel
group and the accumulation window, without fp16's loss scale, in fp32. (DeepSpeed returns the stored
gradient, which at fp16 still carries the loss scale.) A write takes a value in the same units.
They exist only once a backward's reduction has landed: after the backward of an accumulation boundary
(at stage 2 and 3, after any backward), until the step; otherwise reading one is an error.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from engine import comm
from engine.offload.optimizer_swap import OptimizerSwap
from engine.precision import Precision
from engine.zero import owners
from engine.zero.layout import Piece
from engine.zero.shard_reduce import Averaging

PARAM = "fp32 parameter"
GRAD = "gradient"
"""The two kinds of value that are not optimizer state; any other kind names an optimizer state key."""


@dataclass(frozen=True, eq=False)
class HeldGroup:
    """Parameters laid out together, as this rank holds them."""

    params: list[torch.nn.Parameter]
    names: list[str]
    shapes: list[tuple[int, ...]]
    """Each parameter's full shape (a stage-3 parameter's `.data` is empty between uses)."""
    pieces: list[Piece]
    """This rank's runs of the parameters' elements in `master` and `grad` (padding omitted)."""
    master: torch.Tensor
    """The optimizer's fp32 parameter: 1-D, or (buckets, slice) rows (`Piece.shard_offset` counts along
    the rows), or a whole parameter (stage 0)."""
    grad: torch.Tensor
    """The reduced gradient, laid out like `master`, in the accumulation dtype."""
    grad_ready: Callable[[], bool]
    """A reduction of this window landed in `grad` (the same answer on every rank)."""
    write_whole: Callable[[int, torch.Tensor], None]
    """`params[i]` takes a whole new value (fp32) in the copies the forward reads (its low-precision
    parameter, a gathered buffer); the master's runs are written by HeldState."""
    grads_changed: Callable[[], None] = lambda: None
    """`grad` was written by the user: forget whatever was derived from it (stage 3's norm partial sums)."""
    runs: dict[int, list[Piece]] = field(init=False)
    """Param index -> its pieces."""

    def __post_init__(self) -> None:
        runs: dict[int, list[Piece]] = {i: [] for i in range(len(self.params))}
        for piece in self.pieces:
            runs[piece.param].append(piece)
        object.__setattr__(self, "runs", runs)


def _run(tensor: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A writable 1-D view of `numel` elements at `offset` of a (rows, slice) or contiguous tensor."""
    if tensor.is_contiguous():
        return tensor.view(-1)[offset : offset + numel]
    row, col = divmod(offset, tensor.shape[-1])
    return tensor[row, col : col + numel]


class HeldState:
    """One stage's HeldGroups, found by parameter; see the module docstring."""

    def __init__(
        self,
        groups: Sequence[HeldGroup],
        *,
        stage: int,
        optimizer: torch.optim.Optimizer,
        group: comm.ProcessGroup | None,
        replicated: bool,
        averaging: Averaging,
        precision: Precision,
        offload: OptimizerSwap | None,
    ) -> None:
        self.stage = stage
        self._optimizer = optimizer
        self._group = group
        """The data-parallel group whose ranks hold the runs (None: the world)."""
        self._replicated = replicated
        self._averaging = averaging
        self._precision = precision
        self._offload = offload
        self._where = {id(p): (g, i) for g in groups for i, p in enumerate(g.params)}

    def register(self) -> HeldState:
        """Make every parameter of the groups findable by the tensor-fragment API (engine/zero/owners.py)."""
        for g, _ in self._where.values():
            for p in g.params:
                owners.set_held(p, self)
        return self

    def _grad_factor(self) -> float:
        """Stored gradient x this = the mean gradient, unscaled: the averaging still owed, over the loss scale."""
        return self._averaging.after / self._precision.loss_scale

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._where

    def name(self, param: torch.Tensor) -> str:
        g, i = self._where[id(param)]
        return g.names[i]

    # ------------------------------------------------------------------------------ full values
    def full(self, params: Sequence[torch.Tensor], kind: str) -> list[torch.Tensor]:
        """Every rank must call with the same parameters: each one's whole value of `kind`, fp32, in its
        full shape (see [Note: full values])."""
        located = [self._where[id(p)] for p in params]
        if kind == GRAD:
            self._check_grads(located)
        numels = [math.prod(g.shapes[i]) for g, i in located]
        device = located[0][0].master.device if located else torch.device("cpu")
        buffer = torch.zeros(sum(numels), dtype=torch.float32, device=device)
        with self._resident(kind):
            base = 0
            for (g, i), numel in zip(located, numels):
                source = self._source(g, i, kind)
                for piece in g.runs[i]:
                    start = base + piece.param_offset
                    buffer[start : start + piece.numel].copy_(_run(source, piece.shard_offset, piece.numel))
                base += numel
        if not self._replicated and located:
            comm.all_reduce(buffer, group=self._group)
        if kind == GRAD:
            buffer.mul_(self._grad_factor())
        return [part.view(g.shapes[i]) for part, (g, i) in zip(buffer.split(numels), located)]

    def set_full(self, param: torch.Tensor, value: torch.Tensor, kind: str) -> None:
        """Keep this rank's runs of `value` (every rank is given the same whole value; no collective)."""
        g, i = self._where[id(param)]
        flat = self._whole(g, i, value).to(torch.float32)
        if kind == GRAD:
            self._check_grads([(g, i)])
            flat = flat / self._grad_factor()
        with self._resident(kind):
            target = self._source(g, i, kind)
            for piece in g.runs[i]:
                start = piece.param_offset
                _run(target, piece.shard_offset, piece.numel).copy_(flat[start : start + piece.numel])
        if kind == PARAM:
            g.write_whole(i, flat.view(g.shapes[i]))
        elif kind == GRAD:
            g.grads_changed()

    # ----------------------------------------------------------------------------- local values
    def local(self, param: torch.Tensor, kind: str) -> torch.Tensor:
        """This rank's run of the parameter (1-D, fp32, a copy; empty where it holds none of it)."""
        g, i = self._where[id(param)]
        if kind == GRAD:
            self._check_grads([(g, i)])
        with self._resident(kind):
            source = self._source(g, i, kind)
            parts = [_run(source, p.shard_offset, p.numel).to(torch.float32) for p in g.runs[i]]
        local = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=g.master.device)
        return local * self._grad_factor() if kind == GRAD else local

    def set_local(self, param: torch.Tensor, value: torch.Tensor, kind: str) -> None:
        g, i = self._where[id(param)]
        numel = sum(p.numel for p in g.runs[i])
        if value.numel() != numel:
            raise ValueError(
                f"the {kind} of parameter {g.names[i]!r}: a local value of {value.numel()} elements was given, "
                f"this rank holds {numel} of them (safe_get_local_* returns a value of the right size)"
            )
        flat = value.detach().reshape(-1).to(torch.float32)
        if kind == GRAD:
            self._check_grads([(g, i)])
            flat = flat / self._grad_factor()
        with self._resident(kind):
            target = self._source(g, i, kind)
            start = 0
            for p in g.runs[i]:
                _run(target, p.shard_offset, p.numel).copy_(flat[start : start + p.numel])
                start += p.numel
        if kind == GRAD:
            g.grads_changed()

    # -------------------------------------------------------------------------------- helpers
    def _source(self, g: HeldGroup, i: int, kind: str) -> torch.Tensor:
        """The tensor holding `kind` of the group's runs: the master, the gradient or an optimizer state."""
        if kind == PARAM:
            return g.master
        if kind == GRAD:
            return g.grad
        state = self._optimizer.state.get(g.master, {})
        value = state.get(kind)
        if not torch.is_tensor(value) or value.numel() != g.master.numel():
            keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.numel() == g.master.numel())
            raise KeyError(
                f"optimizer state {kind!r} of parameter {g.names[i]!r}: the optimizer "
                f"{type(self._optimizer).__name__} holds "
                + (
                    f"the states {keys}"
                    if keys
                    else "no state for it yet (a torch optimizer creates it at its first step)"
                )
            )
        return value

    def _check_grads(self, located: Sequence[tuple[HeldGroup, int]]) -> None:
        for g, i in located:
            if not g.grad_ready():
                raise RuntimeError(
                    f"the gradient of parameter {g.names[i]!r} is not available: gradients are reduced "
                    f"{'at every backward' if self.stage >= 2 else 'in the backward of an accumulation boundary'} "
                    f"at zero_optimization.stage {self.stage} and consumed by the step. Read or write it after "
                    "engine.backward() and before engine.step()"
                    + ("" if self.stage >= 2 else " at the last micro-step of the accumulation window")
                )

    @staticmethod
    def _whole(g: HeldGroup, i: int, value: torch.Tensor) -> torch.Tensor:
        if value.numel() != math.prod(g.shapes[i]):
            raise ValueError(
                f"parameter {g.names[i]!r} has {math.prod(g.shapes[i])} elements {tuple(g.shapes[i])}; the value "
                f"given has {value.numel()} {tuple(value.shape)}: pass the whole (unpartitioned) value"
            )
        return value.detach().reshape(-1)

    @contextlib.contextmanager
    def _resident(self, kind: str) -> Iterator[None]:
        """Swapped masters and moments in memory for the access (NVMe offload), written back after."""
        if self._offload is None or kind == GRAD:
            yield
            return
        with self._offload.resident():
            yield
