"""`optimizer.parameter_offload` at stage 3: DeepSpeed's DeepSpeedZeRoOffload, as the clients that suspend
the stage-3 hooks use it.

TRL's generation with its default `ds3_gather_for_generation=True` (trl.models.utils
unwrap_model_for_generation: GRPO, RLOO, online DPO and the other online trainers) does, on every rank:

    with deepspeed.zero.GatheredParameters(model.parameters()):    # every unit whole, once
        remove_hooks(model)     # param.ds_active_sub_modules.clear() for module.named_parameters() and
                                # module.ds_external_parameters(); every forward_hooks/backward_hooks handle
                                # .remove()d, the lists set to []
        ...generate...          # forwards without hooks: no gather, no release, nothing recorded
        add_hooks(model)        # param_coordinator.is_invalid_trace() / _invalidate_trace(), then
                                # _register_deepspeed_module(module)

Here the forward hooks are the stage's unit gathers and releases (without them the gathered units stay whole
for the whole generation) and the backward hooks are its gradient hooks; `_register_deepspeed_module` puts
both back. The trace is the prefetch plan's recorded order of unit uses: invalidated, the next training
micro-step records it again. Parameters carry DeepSpeed's `ds_active_sub_modules` (an empty set: units are
gathered by the stage, not counted per submodule) and the model `ds_external_parameters()` (none: a unit holds
every parameter its modules use).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from engine.zero.stage3.stage import Stage3


def _no_external_parameters(_module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return []


def give_deepspeed_attributes(module: torch.nn.Module) -> None:
    """The attributes DeepSpeed's stage 3 puts on a model's parameters and modules that clients read."""
    for p in module.parameters():
        if not hasattr(p, "ds_active_sub_modules"):
            p.ds_active_sub_modules = set()  # type: ignore[attr-defined]
    for m in module.modules():
        if not hasattr(m, "ds_external_parameters"):
            # object.__setattr__: Module.__setattr__ (and its stub) take tensors and modules only
            object.__setattr__(m, "ds_external_parameters", types.MethodType(_no_external_parameters, m))


class TraceCoordinator:
    """DeepSpeed's PartitionedParameterCoordinator, as far as clients call it: the recorded order of unit uses."""

    def __init__(self, stage: Stage3) -> None:
        self._stage = stage

    def is_invalid_trace(self) -> bool:
        return self._stage.prefetch_plan.trace is None

    def _invalidate_trace(self) -> None:
        self._stage.drop_prefetched()
        self._stage.prefetch_plan.forget()


class ParameterOffload:
    """DeepSpeed's DeepSpeedZeRoOffload face of a stage-3 engine (see the module docstring)."""

    def __init__(self, stage: Stage3) -> None:
        self._stage = stage
        self.param_coordinator = TraceCoordinator(stage)
        give_deepspeed_attributes(stage.module)

    @property
    def module(self) -> torch.nn.Module:
        return self._stage.module

    def get_param_coordinator(self, training: bool = True) -> TraceCoordinator:
        """DeepSpeed keeps one coordinator for training and one for evaluation; here one order of unit uses is
        recorded by training micro-steps (evaluation follows none): the same object either way."""
        del training
        return self.param_coordinator

    @property
    def forward_hooks(self) -> list[RemovableHandle]:
        return self._stage.hooks.forward

    @forward_hooks.setter
    def forward_hooks(self, handles: list[RemovableHandle]) -> None:
        self._stage.hooks.forward = list(handles)

    @property
    def backward_hooks(self) -> list[RemovableHandle]:
        return self._stage.hooks.grads

    @backward_hooks.setter
    def backward_hooks(self, handles: list[RemovableHandle]) -> None:
        self._stage.hooks.grads = list(handles)

    def _register_deepspeed_module(self, module: torch.nn.Module) -> None:
        """Put the stage's hooks back on the model (those still registered are replaced, never doubled)."""
        if module is not self._stage.module:
            raise ValueError(
                "parameter_offload._register_deepspeed_module: only the engine's own model can be registered "
                f"(got a {type(module).__name__}, the engine trains a {type(self._stage.module).__name__})"
            )
        self._stage.hooks.register()
