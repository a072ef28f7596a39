"""Stage 0: replicated parameters and optimizer, gradients all-reduced in buckets (DDP-equivalent).

# [Note: the flat gradient buffer]
# Every trainable parameter's gradient lives in a view into one flat buffer per dtype, laid out in
# the order gradients arrive (reverse of registration). A window (the micro-steps of one optimizer
# step) starts with `.grad = None`, so autograd hands the first gradient over as a fresh tensor;
# the post-accumulate hook copies it into the view once and makes the view the `.grad`, and later
# micro-steps accumulate into it in place. That is one copy per window instead of a memset plus
# an in-place add (measured 5% of a 34M-parameter step). Views of parameters that got no gradient
# this window hold stale data until their bucket is launched, which zeroes them first. A bucket
# is a contiguous slice of the buffer, all-reduced in place: no flatten, no unflatten.
#
# [Note: bucket launch order]
# Collectives must be issued in the same order on every rank or gloo/NCCL pair the wrong
# messages and hang. Gradient arrival order can differ between ranks (a parameter unused on one
# rank), so buckets are launched strictly by index: a complete bucket waits until every bucket
# before it has been launched. At the end of backward the rest are launched in order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine import comm
from engine.checkpoint.records import NamedPiece, ShardRecord
from engine.config.types import EngineConfig
from engine.zero import bucket_sizes
from engine.zero.base import StepOutcome


class BucketState(enum.Enum):
    ACCUMULATING = "accumulating"
    """Gradients accumulate locally; no communication started in this accumulation window."""
    REDUCING = "reducing"
    """An async all-reduce of the bucket is in flight; the slice must not be read or written."""
    REDUCED = "reduced"
    """Averaged across ranks for this window; ready for clipping and the optimizer."""


@dataclass
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    flat: torch.Tensor  # 1D view of the dtype's flat gradient buffer covering `params`, contiguous
    state: BucketState = BucketState.ACCUMULATING
    ready: set[int] = field(default_factory=set)  # id() of params whose grad arrived this backward
    work: comm.Work | None = None  # the in-flight all-reduce, waited on in finish_reduction()


def assign_buckets(params: list[torch.nn.Parameter], bucket_size: int) -> list[list[torch.nn.Parameter]]:
    """Split params (already in arrival order, one dtype) into runs of about bucket_size elements.

    A parameter is never split; one larger than bucket_size gets a bucket of its own.
    """
    buckets: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    current_numel = 0
    for p in params:
        if current and current_numel + p.numel() > bucket_size:
            buckets.append(current)
            current, current_numel = [], 0
        current.append(p)
        current_numel += p.numel()
    if current:
        buckets.append(current)
    return buckets


class Stage0:
    """Replicated training with bucketed, overlapped gradient all-reduce."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, config: EngineConfig) -> None:
        self.optimizer = optimizer
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._world_size = comm.get_world_size()
        self._prescale = config.prescale_gradients
        self._predivide = config.gradient_predivide_factor

        # Reverse registration order approximates the order backward produces gradients.
        trainable = [p for p in module.parameters() if p.requires_grad]
        arrival = list(reversed(trainable))
        self._flat_grads: dict[torch.dtype, torch.Tensor] = {}  # one 1D buffer per dtype; see Note
        self._grad_view: dict[int, torch.Tensor] = {}  # id(param) -> its view in the flat buffer
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        reduce_size, _ = bucket_sizes.resolve(config.zero, max((p.element_size() for p in arrival), default=4),
                                              gathers=False)
        for dtype in dict.fromkeys(p.dtype for p in arrival):
            of_dtype = [p for p in arrival if p.dtype == dtype]
            flat = torch.zeros(sum(p.numel() for p in of_dtype), dtype=dtype, device=of_dtype[0].device)
            self._flat_grads[dtype] = flat
            offset = 0
            for members in assign_buckets(of_dtype, reduce_size):
                start = offset
                for p in members:
                    self._grad_view[id(p)] = flat[offset:offset + p.numel()].view_as(p)
                    p.grad = None
                    offset += p.numel()
                bucket = _Bucket(len(self._buckets), members, flat[start:offset])
                self._buckets.append(bucket)
                for p in members:
                    self._bucket_of[id(p)] = bucket

        self._written: set[int] = set()  # id() of params whose view holds this window's gradient
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]
        self._reduce_in_backward = False  # launch bucket all-reduces from hooks in this backward
        self._next_launch = 0  # index of the next bucket to launch; see [Note: bucket launch order]
        self.launched_from_hooks = 0  # buckets started while backward was still running (overlap)

    # ----------------------------------------------------------------------------------- hooks
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        view = self._grad_view[id(param)]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            # .grad was None before this backward (a new window, or the user's own
            # zero_grad(set_to_none=True)): this is the whole gradient so far. See the Note.
            view.copy_(param.grad)
            param.grad = view
        self._written.add(id(param))
        if not self._reduce_in_backward:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.state is not BucketState.ACCUMULATING or id(param) in bucket.ready:
            raise RuntimeError(
                f"a gradient of parameter {tuple(param.shape)} arrived twice in one backward at an "
                "accumulation boundary, after its bucket was already sent for reduction (reentrant "
                "activation checkpointing or a second backward over the same graph). Run the extra "
                "backward on a non-boundary micro-step, or use non-reentrant checkpointing.")
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            before = self._next_launch
            self._launch_complete_in_order()
            self.launched_from_hooks += self._next_launch - before

    def _launch_complete_in_order(self) -> None:
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    # ------------------------------------------------------------------------------ reduction
    def _launch(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            if id(p) not in self._written:
                # No gradient on this rank this window: contribute zeros, and expose the averaged
                # result (other ranks may have used it) to the optimizer.
                view = self._grad_view[id(p)]
                view.zero_()
                p.grad = view
        # DeepSpeed's scaling: prescale divides by N before the sum; otherwise divide by the
        # predivide factor before and by N/predivide after (fp16 range control).
        if self._prescale:
            bucket.flat.mul_(1.0 / self._world_size)
        elif self._predivide != 1.0:
            bucket.flat.mul_(1.0 / self._predivide)
        bucket.work = comm.all_reduce(bucket.flat, async_op=True)
        bucket.state = BucketState.REDUCING
        self._next_launch = bucket.index + 1

    def _finish(self, bucket: _Bucket) -> None:
        assert bucket.work is not None
        bucket.work.wait()
        bucket.work = None
        if not self._prescale and self._predivide != self._world_size:
            bucket.flat.mul_(self._predivide / self._world_size)
        bucket.state = BucketState.REDUCED

    def finish_reduction(self) -> None:
        """Launch every bucket not yet launched (in order) and wait for all of them."""
        for bucket in self._buckets[self._next_launch:]:
            self._launch(bucket)
        for bucket in self._buckets:
            if bucket.state is BucketState.REDUCING:
                self._finish(bucket)

    # ----------------------------------------------------------------------- stage interface
    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        self._reduce_in_backward = boundary and sync
        if not self._reduce_in_backward:
            return
        if any(b.state is not BucketState.ACCUMULATING for b in self._buckets):
            raise RuntimeError(
                "backward() ran again at an accumulation boundary whose gradients were already "
                "reduced; call engine.step() after each boundary backward (or raise "
                "gradient_accumulation_steps to accumulate more micro-batches)")
        for bucket in self._buckets:
            bucket.ready.clear()

    def finish_backward(self) -> None:
        if self._reduce_in_backward:
            self.finish_reduction()
        self._reduce_in_backward = False

    def step(self, max_grad_norm: float) -> StepOutcome:
        # Phase 1: every gradient averaged across ranks (no-op if backward already did it).
        self.finish_reduction()
        # Phase 2: global norm; at stage 0 every rank holds the full averaged gradient.
        norms = [torch.linalg.vector_norm(flat, dtype=torch.float32) for flat in self._flat_grads.values()]
        total_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        # Phase 3: clip like torch.nn.utils.clip_grad_norm_ (same epsilon, so results match it).
        if max_grad_norm > 0:
            coef = max_grad_norm / (total_norm + 1e-6)
            if coef < 1.0:
                for flat in self._flat_grads.values():
                    flat.mul_(coef)
        # Phase 4: update and start the next accumulation window.
        self.optimizer.step()
        self.zero_grad()
        return StepOutcome(total_norm, applied=True)

    def zero_grad(self) -> None:
        """Start a new accumulation window: gradients become None, as torch's zero_grad() does."""
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.state = BucketState.ACCUMULATING
            bucket.ready.clear()
        self._next_launch = 0
        # No memset: the next window's first gradient overwrites each view (see the Note).
        self._written.clear()
        for bucket in self._buckets:
            for p in bucket.params:
                p.grad = None

    def memory_report(self) -> dict[str, int]:
        """Bytes held on this rank per model-state category (the same keys as every stage)."""
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        params = [p for bucket in self._buckets for p in bucket.params]
        state = sum(nbytes(v) for p in params for v in self.optimizer.state.get(p, {}).values()
                    if torch.is_tensor(v) and v.numel() > 1)
        return {
            "params": sum(nbytes(p) for p in params),
            "master": 0,  # fp32 training: the parameters are the master weights
            "gradients": sum(nbytes(f) for f in self._flat_grads.values()),
            "optimizer_state": state,
            "buckets": 0,  # buckets are slices of the gradient buffer: no extra memory
        }

    def checkpoint_shards(self) -> list[ShardRecord]:
        """fp32 replicated training: each trainable parameter is its own master; rank 0 writes."""
        write = comm.get_rank() == 0
        return [ShardRecord(p, [NamedPiece(self._names[id(p)], 0, 0, p.numel())], gi, write)
                for gi, group in enumerate(self.optimizer.param_groups) for p in group["params"] if p.requires_grad]

    def state_dict(self) -> dict[str, object]:
        return {}

    def destroy(self) -> None:
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
            for p in bucket.params:
                p.grad = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._buckets.clear()
        self._bucket_of.clear()
        self._grad_view.clear()
        self._flat_grads.clear()

