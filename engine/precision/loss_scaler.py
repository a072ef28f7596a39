"""fp16 loss scaling, static or dynamic, with DeepSpeed's semantics; one object shared by all ZeRO stages.

The engine multiplies the loss by `scale` before backward, checks the gradients for inf/NaN, skips the
optimizer step when they overflowed, and then calls `update(overflow)` once per optimizer step (also for
skipped steps). Static scaling (`fp16.loss_scale > 0`) never changes the scale. Dynamic scaling
(`fp16.loss_scale == 0`) starts at `2**initial_scale_power` and follows DeepSpeed's DynamicLossScaler:

* On overflow: if hysteresis is 1, or the remaining hysteresis is down to 1, the scale becomes
  `max(scale / scale_factor, min_scale)`; otherwise the overflow is absorbed and the remaining hysteresis
  drops by one. Either way the overflow restarts the growth window.
* Without overflow: the first clean step after an overflow (or the first step of all) never grows the
  scale; after it, the scale is multiplied by `scale_factor` on every `scale_window`-th further clean step.
  Exactly as DeepSpeed >= 0.17.1 (PR #6976) computes it: with `stable = iterations - last_overflow_iter - 1`
  (clean steps before this one since the last overflow, or since the start with last_overflow_iter = -1),
  grow when `stable > 0 and stable % scale_window == 0`. So from the start with window 2 the scale grows at
  steps 2, 4, 6, ... (0-based), and after an overflow at step k at k+3, k+5, ... DeepSpeed <= 0.17.0 grew one
  step earlier (`(iterations - last_overflow_iter) % scale_window == 0`). Each growth restores the remaining
  hysteresis to its configured value.
* `consecutive_hysteresis`: the remaining hysteresis is restored on every clean step too, so only
  consecutive overflows use it up. Without it, absorbed overflows stay counted until the scale next grows.

Unlike DeepSpeed, an overflow at `min_scale` never raises: the step is skipped, the scale stays put and a
single WARNING says that training may be diverging and suggests bf16. Every overflow logs one INFO line.
"""

from __future__ import annotations

from typing import Any

from engine.config.types import FP16Config
from engine.monitor.log import get_logger

_STATE_KEYS = ("dynamic", "scale", "iterations", "skipped_steps", "last_overflow_iter", "hysteresis_left")


def _fmt(value: float) -> str:
    """A scale as people read it: 65536, not 65536.0; fractions (min_scale < 1) keep their digits."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class LossScaler:
    """The loss scale for fp16 training; `dynamic=False` is a static scaler that never changes.

    Keyword arguments have the names and meanings of DeepSpeed's DynamicLossScaler, so its
    `dynamic_loss_args` dict can be passed as is; defaults are those of the `fp16` config section.

    Args:
        dynamic: adjust the scale on overflow / after clean windows (DeepSpeed: loss_scale 0).
        init_scale: starting scale (static: the fixed scale).
        scale_factor: divide by it on overflow, multiply by it on growth (when: see the module docstring).
        scale_window: clean steps between two growths (config `loss_scale_window`).
        min_scale: the scale never drops below it (config `min_loss_scale`).
        delayed_shift: overflows needed to lower the scale (config `hysteresis`); 1 = every overflow.
        consecutive_hysteresis: restore the hysteresis on every clean step, not only on growth.
    """

    def __init__(
        self,
        *,
        dynamic: bool = True,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"loss scale must be > 0, got {init_scale}")
        if dynamic:
            if not scale_factor > 1:
                raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
            if int(scale_window) < 1:
                raise ValueError(f"scale_window (loss_scale_window) must be >= 1, got {scale_window}")
            if not min_scale > 0:
                raise ValueError(f"min_scale (min_loss_scale) must be > 0, got {min_scale}")
            # DeepSpeed accepts hysteresis 0 and then never lowers the scale (the counter just goes negative).
            if int(delayed_shift) < 1:
                raise ValueError(f"delayed_shift (hysteresis) must be >= 1, got {delayed_shift}")
        self._dynamic = bool(dynamic)
        self._scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.hysteresis_left = self.delayed_shift
        """Overflows still needed to lower the scale, counting the one that lowers it (DeepSpeed's cur_hysteresis)."""
        self.iterations = 0
        """update() calls so far, i.e. optimizer steps taken or skipped."""
        self.skipped_steps = 0
        """Steps whose gradients overflowed (and so were skipped)."""
        self.last_overflow_iter = -1
        """Value of `iterations` at the last overflow; -1 before any. The growth window counts from the step after it."""
        self._warned_at_min = False

    @classmethod
    def from_config(cls, fp16: FP16Config) -> LossScaler:
        """The scaler DeepSpeed builds for this `fp16` section: loss_scale > 0 is static at that value,
        0 is dynamic from 2**initial_scale_power. With fp16 disabled (fp32/bf16) DeepSpeed still makes a
        scaler, static at 1.0, and so do we."""
        if not fp16.enabled:
            return cls(dynamic=False, init_scale=1.0)
        if fp16.loss_scale > 0:
            return cls(dynamic=False, init_scale=fp16.loss_scale)
        return cls(
            dynamic=True,
            init_scale=2.0**fp16.initial_scale_power,
            scale_window=fp16.loss_scale_window,
            min_scale=fp16.min_loss_scale,
            delayed_shift=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
        )

    @property
    def scale(self) -> float:
        """The factor to multiply the loss by for the next backward."""
        return self._scale

    @property
    def dynamic(self) -> bool:
        return self._dynamic

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step whose gradients did (`overflow=True`) or did not overflow."""
        if overflow:
            self.skipped_steps += 1
            if self._dynamic:
                self._on_overflow()
            else:
                get_logger().info("fp16 overflow: skipping step, loss scale stays %s (static)", _fmt(self._scale))
            self.last_overflow_iter = self.iterations
        elif self._dynamic:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.delayed_shift
            # DeepSpeed 0.19's rule (see the module docstring): the clean steps before this one since the last
            # overflow must be a positive multiple of the window.
            stable = self.iterations - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                self.hysteresis_left = self.delayed_shift
                self._scale *= self.scale_factor
        self.iterations += 1

    def _on_overflow(self) -> None:
        log = get_logger()
        attempted = self._scale
        if self.delayed_shift > 1 and self.hysteresis_left > 1:
            self.hysteresis_left -= 1
            left = self.hysteresis_left
            absorbed = left - 1
            what = (
                "the next overflow reduces it"
                if absorbed == 0
                else f"{absorbed} more overflow{'s' if absorbed > 1 else ''} absorbed first"
            )
            log.info(
                "fp16 overflow: skipping step, loss scale stays %s (hysteresis %d left: %s)",
                _fmt(attempted),
                left,
                what,
            )
            return
        if attempted <= self.min_scale:
            # DeepSpeed raises here ("cannot decrease scale anymore"); we keep going and say so clearly.
            log.info("fp16 overflow: skipping step, loss scale stays %s (already at min_loss_scale)", _fmt(attempted))
            if not self._warned_at_min:
                self._warned_at_min = True
                log.warning(
                    "fp16 loss scale is at min_loss_scale (%s) and gradients still overflow: training may be "
                    "diverging, and every overflowing step is skipped (%d skipped so far). Consider bf16 "
                    '("bf16": {"enabled": true}) where the hardware supports it, or a lower learning rate. '
                    "This warning is shown once.",
                    _fmt(self.min_scale),
                    self.skipped_steps,
                )
            return
        self._scale = max(attempted / self.scale_factor, self.min_scale)
        floor = " (min_loss_scale reached)" if self._scale <= self.min_scale else ""
        log.info("fp16 overflow: skipping step, loss scale %s -> %s%s", _fmt(attempted), _fmt(self._scale), floor)

    def state_dict(self) -> dict[str, Any]:
        """Plain Python numbers only, so checkpoints load with torch.load(weights_only=True)."""
        return {
            "dynamic": self._dynamic,
            "scale": float(self._scale),
            "iterations": int(self.iterations),
            "skipped_steps": int(self.skipped_steps),
            "last_overflow_iter": int(self.last_overflow_iter),
            "hysteresis_left": int(self.hysteresis_left),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters and, when both this scaler and the saved one are dynamic, the scale.

        The configuration (static/dynamic, window, factor, floor, hysteresis) stays as constructed, so a
        resumed run follows its current config: a static scale is whatever the config says now, and the
        remaining hysteresis is capped at the configured hysteresis.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise KeyError(f"loss scaler state is missing {missing}")
        self.iterations = int(state["iterations"])
        self.skipped_steps = int(state["skipped_steps"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        if self._dynamic and bool(state["dynamic"]):
            self._scale = float(state["scale"])
            self.hysteresis_left = max(1, min(int(state["hysteresis_left"]), self.delayed_shift))

    def __repr__(self) -> str:
        kind = "dynamic" if self._dynamic else "static"
        return (
            f"LossScaler({kind}, scale={_fmt(self._scale)}, iterations={self.iterations}, "
            f"skipped_steps={self.skipped_steps})"
        )
