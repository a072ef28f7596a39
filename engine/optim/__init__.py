"""Optimizers and LR schedules, and their builders from the `optimizer` / `scheduler` config sections.

- optimizers.py: `optimizer` -> a torch.optim.Optimizer (DeepSpeed's names, defaults and checks).
- per_tensor.py: the step shared by the engine's plain-torch optimizers (closure, param walk,
  state, hyper-parameter checks); adam.py (ReferenceAdam, and the Adam hyper-parameters and moment
  math Lamb shares), lamb.py (Lamb), lion.py (Lion) implement its per-tensor update.
- deepspeed_classes.py: DeepSpeed's optimizer classes under their own names and signatures.
- schedule_factory.py: `scheduler` -> a DeepSpeed schedule (schedules.py, one_cycle.py) or a
  torch.optim.lr_scheduler one.
- _check.py: the `_check_*` helpers behind both builders' ConfigErrors.

The fused CPU Adam kernel and its optimizer (CPUAdam) live in engine/ops/adam.py.
"""

from engine.optim.adam import ReferenceAdam
from engine.optim.lamb import Lamb
from engine.optim.lion import Lion
from engine.optim.one_cycle import OneCycle
from engine.optim.optimizers import build_optimizer
from engine.optim.schedule_factory import Scheduler, build_scheduler
from engine.optim.schedules import BatchSchedule, LRRangeTest, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "BatchSchedule",
    "LRRangeTest",
    "Lamb",
    "Lion",
    "OneCycle",
    "ReferenceAdam",
    "Scheduler",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
]
