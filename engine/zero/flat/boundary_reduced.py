"""Stages 0 and 1: gradients accumulate locally in one full-size flat buffer per group and are reduced
once per accumulation window, during the backward of the boundary micro-step.

Each parameter's .grad is a view into the buffer, laid out like the parameters (engine/zero/layout.py).
A window starts with `.grad = None`, so autograd hands the first gradient over as a fresh tensor;
the post-accumulate hook copies it into the view once and makes the view the `.grad`, and later
micro-steps accumulate into it in place: one copy per window instead of a memset plus an in-place
add (measured 5% of a 34M-parameter step). Parameters that got no gradient this window contribute
zeros when their bucket is launched. During the boundary backward every bucket is reduced as soon as
all its gradients are in, overlapped with the rest of backward, in the global launch order. The
reduction lands in place in this rank's slices of the buffer, so those slices are the gradient rows
the optimizer step reads: no second gradient buffer, in any dtype (the paper's 2 Psi of fp16
gradients at stage 1).
"""

from __future__ import annotations

import torch

from engine.zero.flat.bucket import Bucket, Reduction
from engine.zero.flat.stage import FlatStage
from engine.zero.owners import grad_is_ready


class BoundaryReducedStage(FlatStage):
    _grad_flat: dict[int, torch.Tensor]  # group index -> full-size flat gradient buffer (accumulation dtype)
    _view: dict[int, torch.Tensor]  # id(param) -> its view in the flat gradient buffer
    _written: set[int]  # id() of params whose view holds this window's gradient

    def _allocate_gradients(self) -> None:
        self._grad_flat, self._view, self._written = {}, {}, set()
        for g in self.groups:
            flat = torch.zeros(
                g.layout.padded_numel, dtype=self.precision.grad_accum_dtype(g.dtype), device=g.flat.device
            )
            self._grad_flat[g.index] = flat
            g.shard_grad = g.shard_view(flat)  # the reduction lands in place in these slices
            for p, span in zip(g.params, g.layout.params):
                self._view[id(p)] = flat[span.offset : span.end].view(p.shape)

    def _on_grad(self, param: torch.Tensor) -> None:
        g, i = self._where[id(param)]
        grad = param.grad
        if grad is None or not grad_is_ready(param):  # more pieces to come (owners.grad_is_ready)
            return
        buckets = [self._bucket[(g.index, b)] for b in g.layout.buckets_of(i)]
        reducing = self.reduction is Reduction.REDUCING
        if reducing and any(self._launcher.launched(bk.order) for bk in buckets):
            for bk in buckets:  # accumulated again after its bucket was sent; see stage.py's Note
                self._add_late(bk, i, grad)
            param.grad = None
            return
        view = self._view[id(param)]
        if grad.data_ptr() != view.data_ptr():
            # A fresh tensor from autograd: the first gradient of the window (copied once, then the
            # view becomes .grad and autograd accumulates into it), or any gradient when the buffer's
            # dtype differs from the parameter's (data_types.grad_accum_dtype).
            if id(param) in self._written:
                view.add_(grad)
            else:
                view.copy_(grad)
            param.grad = view if view.dtype == grad.dtype else None
        self._written.add(id(param))
        if not reducing:
            return
        for bk in buckets:
            self._mark_ready(bk, i)

    def _fill(self, bk: Bucket) -> None:
        g = bk.group
        flat = self._grad_flat[g.index]
        for i in bk.params:
            p = g.params[i]
            if id(p) not in self._written:  # no gradient on this rank this window: contribute zeros
                in_bucket, _ = bk.portion(i)
                g.bucket(flat, bk.b)[in_bucket].zero_()
            p.grad = None  # a later accumulation in this backward must not write into memory in flight
        source = g.bucket(flat, bk.b)
        wire = self.wire_dtype(g)
        if source.dtype == wire:
            bk.data, bk.pooled = source, False
        else:  # the wire dtype (communication_data_type, or the model's) differs from the accumulation dtype
            self._acquire(bk).copy_(source)

    def _has_unreduced(self) -> bool:
        """Gradients were written this window and its one reduction has not run (it runs at the boundary)."""
        return bool(self._written) and not self._reduced_window()

    def _reduced_window(self) -> bool:
        return any(any(g.grad_written) for g in self.groups)

    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        if self._reduced_window():
            raise RuntimeError(
                "backward() ran again at an accumulation boundary whose gradients were already reduced; call "
                "engine.step() after each boundary backward (or raise gradient_accumulation_steps to accumulate "
                "more micro-batches)"
            )
        self._begin_backward(reducing=boundary and sync)

    def zero_grad(self) -> None:
        super().zero_grad()
        self._written.clear()

    def _gradient_buffers(self) -> list[torch.Tensor]:
        return list(self._grad_flat.values())

    def destroy(self) -> None:
        super().destroy()
        self._grad_flat.clear()
        self._view.clear()
