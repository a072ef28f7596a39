"""Mixed precision: what every stage shares about dtypes, loss scaling and the gradient norm.

- policy.py: `Precision`, one engine's model dtype, wire and accumulation dtypes, loss scaler and the
  global-norm / overflow decision (a skipped step, or `NonFiniteGradientError`);
- loss_scaler.py: fp16's static or dynamic loss scale, with DeepSpeed's semantics;
- cpu_precision.py: whether this CPU computes bf16/fp16 natively (the warning at initialize and in
  `python -m engine.report`).
"""

from engine.precision.loss_scaler import LossScaler
from engine.precision.policy import GradNorm, NonFiniteGradientError, Precision, dtype_from_name

__all__ = ["GradNorm", "LossScaler", "NonFiniteGradientError", "Precision", "dtype_from_name"]
