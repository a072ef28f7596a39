"""The stage of an engine built without an optimizer at zero_optimization.stage 0, 1 or 2.

Without an optimizer there is nothing to partition (no optimizer state, no gradients to reduce) and
the parameters are whole on every rank at these stages, so the stage holds nothing and installs no
hooks: the engine only runs forward (evaluation, as HF's ZeRO inference does). Stage 3 keeps its
own class without an optimizer, because its parameters stay partitioned. The Engine refuses
backward and step before they reach a stage (engine.runtime.engine.NoOptimizerError).
"""

from __future__ import annotations

import torch

from engine.offload.optimizer_swap import OptimizerSwap
from engine.parallel.groups import ParallelGroups
from engine.zero.base import StepOutcome
from engine.zero.offload_states import OffloadStateTypeEnum
from engine.zero.records import NamedPiece, ShardRecord
from engine.zero.tp_state import whole_state_dict


class ForwardOnly:
    def __init__(self, module: torch.nn.Module, stage: int, parallel: ParallelGroups | None = None) -> None:
        self.stage = stage
        self.optimizer: torch.optim.Optimizer | None = None
        self.offload: OptimizerSwap | None = None
        self._module = module
        self.parallel = parallel or ParallelGroups.data_parallel_only()

    def prepare_backward(self, *, boundary: bool, sync: bool) -> None:
        raise RuntimeError(f"zero_optimization.stage {self.stage} engine without an optimizer cannot run backward")

    def finish_backward(self) -> None:
        pass

    def step(self, max_grad_norm: float) -> StepOutcome:
        raise RuntimeError(f"zero_optimization.stage {self.stage} engine without an optimizer cannot step")

    def zero_grad(self) -> None:
        pass

    def memory_report(self) -> dict[str, int]:
        return {"params": 0, "master": 0, "gradients": 0, "optimizer_state": 0}

    def resident_states(self) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
        return {OffloadStateTypeEnum.lp_params: [p.data for p in self._module.parameters()]}

    def release_scratch(self) -> None:
        pass

    def checkpoint_shards(self) -> list[ShardRecord]:
        """Every parameter whole, as a frozen record (no optimizer state); the first rank of each
        data-parallel group writes (rank 0 without tensor parallelism)."""
        write = self.parallel.dp_rank == 0
        return [
            ShardRecord(p, [NamedPiece(name, 0, 0, p.numel())], None, write)
            for name, p in self._module.named_parameters()
        ]

    def consolidated_state_dict(self, device: torch.device | None) -> dict[str, torch.Tensor]:
        return whole_state_dict(self._module.state_dict(keep_vars=True), self.parallel, device)

    def destroy(self) -> None:
        pass
