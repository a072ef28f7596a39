"""What a checkpoint keeps of its inputs from the forward to the recompute, and getting them back.

Only floating-point tensors are activations to keep specially (DeepSpeed's is_activation_to_checkpoint);
anything else (masks, ints, Python values) is kept as it is. Each floating input is kept

- whole, by reference (nothing copied) when no option applies, as torch.utils.checkpoint does;
- partitioned (P_a): this rank's 1/TP of its flattened elements, copied (the last rank's piece padded
  when the count does not divide), and all-gathered over the tensor-parallel group before the
  recompute. Every rank of the group holds the same replicated activation (the residual stream);
  the gather rebuilds it bit for bit;
- in pinned host memory (P_a+cpu) when it is on a CUDA device and cpu_checkpointing is set;
- in the contiguous arena (M_D) when it is kept in host memory and contiguous_memory_optimization is
  set (engine/activation_checkpointing/contiguous.py).

A kept reference is checked at restore against the tensor's version counter: an input modified in
place after the forward would be recomputed from other values, so that is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from engine import comm
from engine.activation_checkpointing import contiguous, ledger
from engine.activation_checkpointing.settings import SECTION, Settings, say_once


@dataclass
class _Kept:
    """One positional argument as kept."""

    value: Any
    """The argument itself (not an activation, or kept whole by reference) or the kept copy."""
    copied: bool
    partitioned: bool
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    version: int


def is_activation(value: Any) -> bool:
    return torch.is_tensor(value) and value.is_floating_point()


def _host(settings: Settings, tensor: torch.Tensor) -> bool:
    """Whether this input's kept copy goes to host memory (P_a+cpu)."""
    if not settings.options.cpu_checkpointing:
        return False
    if tensor.device.type == "cpu":
        say_once(
            "cpu-on-cpu",
            f"{SECTION}.cpu_checkpointing has no effect here: the activations are already in "
            "host memory (training on CPU)",
        )
        return False
    return True


class KeptInputs:
    """A checkpoint's positional arguments, kept as the settings say until restore()."""

    def __init__(self, args: tuple[Any, ...], settings: Settings) -> None:
        self._settings = settings
        tp = settings.tensor_parallel
        partition = settings.partitions
        plans: list[tuple[int, torch.Tensor, bool, bool]] = []  # (index, tensor, partitioned, to host)
        self._kept: list[_Kept] = []
        for index, arg in enumerate(args):
            if not is_activation(arg):
                self._kept.append(_Kept(arg, False, False, torch.Size(), torch.float32, torch.device("cpu"), False, 0))
                continue
            part = partition and arg.numel() >= tp.size
            host = _host(settings, arg)
            self._kept.append(
                _Kept(arg.detach(), False, part, arg.shape, arg.dtype, arg.device, arg.requires_grad, arg._version)
            )
            if part or host or (settings.options.contiguous_memory_optimization and arg.device.type == "cpu"):
                plans.append((index, arg, part, host))
        self._copy(plans)
        kept = sum(k.value.numel() * k.value.element_size() for k in self._kept if is_activation(k.value))
        whole = sum(k.shape.numel() * k.dtype.itemsize for k in self._kept if is_activation(k.value))
        ledger.add(self, kept, whole)

    def _copy(self, plans: list[tuple[int, torch.Tensor, bool, bool]]) -> None:
        """Copy the planned inputs into their kept form: a piece per rank, host memory, the arena."""
        if not plans:
            return
        tp = self._settings.tensor_parallel
        sources = []
        for _, arg, part, _ in plans:
            flat = arg.detach().reshape(-1)
            if part:
                per = math.ceil(flat.numel() / tp.size)  # each rank's elements, the last piece padded
                flat = flat[tp.rank * per : (tp.rank + 1) * per]
                if flat.numel() < per:  # the last rank's piece of a count that does not divide
                    flat = torch.cat([flat, flat.new_zeros(per - flat.numel())])
            sources.append(flat)
        specs = [(src.shape, src.dtype) for src in sources]
        on_host = [host or arg.device.type == "cpu" for _, arg, _, host in plans]
        targets: list[torch.Tensor] | None = None
        if self._settings.options.contiguous_memory_optimization and all(on_host):
            targets = contiguous.place(specs, self._settings.options.number_checkpoints)
        elif self._settings.options.contiguous_memory_optimization:
            say_once(
                "contiguous-device",
                f"{SECTION}.contiguous_memory_optimization applies to checkpoints in host "
                "memory (the arena is host memory); device checkpoints stay with the "
                "device's caching allocator. Set cpu_checkpointing to use it",
            )
        if targets is None:
            pin = torch.cuda.is_available()
            targets = [
                torch.empty(
                    shape,
                    dtype=dtype,
                    device="cpu" if host else src.device,
                    pin_memory=pin and host and src.device.type != "cpu",
                )
                for (shape, dtype), src, host in zip(specs, sources, on_host)
            ]
        for (index, _, part, _), src, dst in zip(plans, sources, targets):
            dst.copy_(src, non_blocking=dst.is_pinned())
            kept = self._kept[index]
            kept.value, kept.copied, kept.partitioned = dst, True, part

    def restore(self) -> list[Any]:
        """The arguments as they were at the forward: tensors detached on their device with their
        requires_grad, partitioned ones all-gathered. The kept copies are released."""
        tp = self._settings.tensor_parallel
        out: list[Any] = []
        for i, kept in enumerate(self._kept):
            if not is_activation(kept.value):
                out.append(kept.value)
                continue
            if not kept.copied:
                if kept.value._version != kept.version:
                    raise RuntimeError(
                        f"engine.checkpointing: input {i} of a checkpointed function (shape "
                        f"{list(kept.shape)}) was modified in place after its forward, so its "
                        "recompute would see other values; clone it before modifying it"
                    )
                value = kept.value
            else:
                local = kept.value.to(kept.device, non_blocking=True)
                if kept.partitioned:
                    whole = torch.empty(local.numel() * tp.size, dtype=kept.dtype, device=kept.device)
                    comm.all_gather(whole, local, group=tp.group)
                    ledger.gathered()
                    value = whole[: kept.shape.numel()].view(kept.shape)
                else:
                    value = local.view(kept.shape)
            out.append(value.detach().requires_grad_(kept.requires_grad))
        self._kept = []
        return out
