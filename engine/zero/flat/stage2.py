"""Stage 2: optimizer state and gradients partitioned; full parameters per rank.

There is no full-size gradient buffer. The post-accumulate-grad hook of each parameter copies its
gradient into the buffer of its bucket (cast to the wire dtype in the same copy) and frees it; a
complete bucket is reduce-scattered asynchronously and its slice added into this rank's gradient
shard (in the accumulation dtype, as DeepSpeed accumulates), on every micro-step. Bucket buffers come from a small pool: with overlap_comm two
may be in flight, so backward keeps filling one while the other reduces; without it, one. Only
when gradients arrive far out of layout order does the pool grow (logged once at debug level).

Inside engine.no_sync() gradients accumulate in a temporary full-size buffer per group (a
documented memory cost: DeepSpeed refuses no_sync at stage 2 instead), which the next synchronised
backward (or step) adds into its buckets and frees.
"""

from __future__ import annotations

import torch

from engine.zero.flat.bucket import Bucket, Reduction
from engine.zero.flat.stage import FlatStage
from engine.zero.owners import grad_is_ready


class Stage2(FlatStage):
    stage = 2
    partitioned = True

    _unsynced: dict[int, torch.Tensor]  # group index -> full-size no_sync accumulation

    def _allocate_gradients(self) -> None:
        # Only the shard's rows; bucket buffers come from the pool as gradients arrive.
        self._unsynced = {}
        for g in self.groups:
            g.shard_grad = torch.zeros(
                (g.layout.num_buckets, g.layout.slice_numel),
                dtype=self.precision.grad_accum_dtype(g.dtype),
                device=g.flat.device,
            )

    # ------------------------------------------------------------------------------- hooks
    def _on_grad(self, param: torch.Tensor) -> None:
        g, i = self._where[id(param)]
        grad = param.grad
        if grad is None or not grad_is_ready(param):  # more pieces to come (owners.grad_is_ready)
            return
        param.grad = None
        if self.reduction is not Reduction.REDUCING:
            self._accumulate_unsynced(g.index, i, grad)
            return
        flat_grad = grad.reshape(-1)
        unsynced = self._unsynced.get(g.index)
        for b in g.layout.buckets_of(i):
            bk = self._bucket[(g.index, b)]
            if self._launcher.launched(bk.order):  # accumulated again after it was sent; see stage.py's Note
                self._add_late(bk, i, grad)
                continue
            data = self._acquire(bk)
            in_bucket, in_param = bk.portion(i)
            if i in bk.ready:
                data[in_bucket].add_(flat_grad[in_param])
                continue
            data[in_bucket].copy_(flat_grad[in_param])
            if unsynced is not None:
                span = g.layout.params[i]
                data[in_bucket].add_(unsynced[span.offset : span.end][in_param])
            self._mark_ready(bk, i)

    def _accumulate_unsynced(self, group: int, i: int, grad: torch.Tensor) -> None:
        g = self.groups[group]
        buf = self._unsynced.get(group)
        if buf is None:
            buf = self._unsynced[group] = torch.zeros(
                g.layout.padded_numel, device=g.flat.device, dtype=self.precision.grad_accum_dtype(g.dtype)
            )
        span = g.layout.params[i]
        buf[span.offset : span.end].add_(grad.reshape(-1))

    def _fill(self, bk: Bucket) -> None:
        data = self._acquire(bk)
        g = bk.group
        unsynced = self._unsynced.get(g.index)
        for i in bk.params:
            if i in bk.ready:
                continue
            in_bucket, in_param = bk.portion(i)  # no gradient this backward: zeros or the no_sync sum
            if unsynced is None:
                data[in_bucket].zero_()
            else:
                span = g.layout.params[i]
                data[in_bucket].copy_(unsynced[span.offset : span.end][in_param])
        start, _ = g.layout.bucket_range(bk.b)
        pad_from = max(0, g.layout.numel - start)
        if pad_from < data.numel():
            data[pad_from:].zero_()

    # ------------------------------------------------------------------------ stage interface
    def _has_unreduced(self) -> bool:
        return bool(self._unsynced)

    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        self._begin_backward(reducing=sync)  # every synchronised micro-step reduces

    def _consumed_local(self) -> None:
        self._unsynced.clear()  # consumed by this reduction

    def zero_grad(self) -> None:
        super().zero_grad()
        self._unsynced.clear()

    def _gradient_buffers(self) -> list[torch.Tensor]:
        return list(self._unsynced.values())

    def destroy(self) -> None:
        super().destroy()
        self._unsynced.clear()
