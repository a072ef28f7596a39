"""zero_optimization.ignore_unused_parameters false: a step where a trainable parameter got no gradient
is refused, naming it and the ranks where it got none (stages 1-2, where DeepSpeed reads the key).

DeepSpeed's default, true, trains such a parameter with a zero gradient (as this engine does everywhere
else). Asked for false, DeepSpeed asserts only with offload_optimizer, on the rank that saw it; here the
check runs with or without offload, and every rank agrees before raising (one all-reduce of a flag per
parameter, at each step), so no rank is left waiting in a collective. Without the key nothing is
installed: no hook, no collective.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from engine import comm
from engine.comm import ProcessGroup


class UnusedParametersError(RuntimeError):
    """A step found trainable parameters that took no part in the loss (ignore_unused_parameters false)."""


class UnusedCheck:
    """Records which parameters got a gradient this window; check() refuses the step if any did not."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], group: ProcessGroup | None, enabled: bool) -> None:
        self._named = named if enabled else []
        self._group = group
        self._arrived: set[int] = set()
        self._hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(lambda p: self._arrived.add(id(p))) for _, p in self._named
        ]

    def check(self) -> None:
        """Every rank calls it at the step (a collective when enabled)."""
        if not self._named:
            return
        missing = torch.tensor([0.0 if id(p) in self._arrived else 1.0 for _, p in self._named])
        where = torch.zeros(comm.group_size(self._group), len(self._named))
        where[comm.group_rank(self._group)] = missing
        comm.all_reduce(where, group=self._group)
        ranks = comm.group_ranks(self._group)  # global ranks, as a user knows them
        unused = [
            (name, [ranks[r] for r in where[:, i].nonzero().flatten().tolist()])
            for i, (name, _) in enumerate(self._named)
        ]
        unused = [(name, ranks) for name, ranks in unused if ranks]
        if unused:
            listed = ", ".join(f"{name!r} (ranks {ranks})" for name, ranks in unused[:8])
            more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
            raise UnusedParametersError(
                f"zero_optimization.ignore_unused_parameters is false and {len(unused)} trainable parameter(s) got "
                f"no gradient in this step: {listed}{more}. Make every trainable parameter take part in the "
                "loss, freeze the unused ones (requires_grad=False) before engine.initialize, or set "
                "ignore_unused_parameters to true (DeepSpeed's default: they train with a zero gradient)"
            )

    def clear(self) -> None:
        self._arrived.clear()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
