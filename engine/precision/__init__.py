"""Mixed precision: what every stage shares about dtypes and loss scaling. It imports nothing of
engine/zero/: the step that asks it (engine/zero/shard_step.py) is above it.

- policy.py: `Precision`, one engine's model dtype, wire and accumulation dtypes and loss scaler, and
  `NonFiniteGradientError` (a step whose global norm was inf/nan, with check_for_nan_in_loss_and_grad);
- loss_scaler.py: fp16's static or dynamic loss scale, with DeepSpeed's semantics;
- cpu_precision.py: whether this CPU computes bf16/fp16 natively (the warning at initialize and in
  `python -m engine.report`).
"""

from engine.precision.loss_scaler import LossScaler
from engine.precision.policy import NonFiniteGradientError, Precision, dtype_from_name

__all__ = ["LossScaler", "NonFiniteGradientError", "Precision", "dtype_from_name"]
