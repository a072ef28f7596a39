"""Stage 3's hooks on the model: the forward hooks that gather and release each unit around its members'
forwards (UnitGathers), and the parameters' hooks that reduce each gradient as it is accumulated
(UnitGradients). Kept as handles, so they can be removed and registered again: TRL removes them around
generation and asks for them back (engine/zero/stage3/parameter_offload.py), destroy() removes them for good.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from engine.zero.stage3.gather import UnitGathers
from engine.zero.stage3.units import Unit


class StageHooks:
    def __init__(
        self,
        module: torch.nn.Module,
        units: Sequence[Unit],
        gathers: UnitGathers,
        on_grad: Callable[[torch.Tensor], None],
    ) -> None:
        self._module, self._units, self._gathers, self._on_grad = module, units, gathers, on_grad
        self.forward: list[RemovableHandle] = []
        """The model's forward hooks that gather and release the units."""
        self.grads: list[RemovableHandle] = []
        """The parameters' hooks that reduce each gradient as it is accumulated."""

    def register(self) -> None:
        """Register both kinds, removing those registered before (never doubled)."""
        self.remove()
        self.forward = self._forward_hooks()
        self.grads = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for u in self._units
            for g in u.trainable
            for p in g.params
        ]

    def remove(self) -> None:
        for handle in (*self.forward, *self.grads):
            handle.remove()  # removing a handle twice does nothing
        self.forward, self.grads = [], []

    def _forward_hooks(self) -> list[RemovableHandle]:
        gathers, module = self._gathers, self._module
        root = next((u for u in self._units if not u.modules), None)
        handles = [module.register_forward_pre_hook(_eager(lambda _m, _i: gathers.start_micro_step()))]
        if root is not None:
            handles.append(module.register_forward_pre_hook(_eager(lambda _m, _i, root=root: gathers.gather(root))))
            handles.append(
                module.register_forward_hook(_eager(lambda _m, _i, _o, root=root: gathers.after_root_forward(root)))
            )
        for unit in self._units:
            for member in unit.modules:
                handles.append(member.register_forward_pre_hook(_eager(lambda _m, _i, unit=unit: gathers.gather(unit))))
                handles.append(
                    member.register_forward_hook(
                        _eager(
                            lambda m, _i, out, unit=unit: gathers.after_forward(unit, out, last=m is unit.modules[-1])
                        )
                    )
                )
        return handles


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A forward hook torch.compile calls without tracing it: the gathers and releases run as the engine
    wrote them (collectives, the memory they free), and a compiled model's graph breaks at each member
    (before its pre-hook, after its hook): what is compiled is each member's forward between them
    (docs/compile.md). Traced instead, Dynamo would guard on the engine's counters and recompile at
    every gather."""
    return torch.compiler.disable(hook, recursive=True)
