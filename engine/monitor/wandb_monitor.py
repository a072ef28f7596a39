"""`wandb`: events logged to Weights & Biases from rank 0, as DeepSpeed logs them.

WANDB_MODE=offline (or `wandb offline`) writes the run under ./wandb (WANDB_DIR) without a network or an
account; `wandb sync` uploads it later.
"""

from __future__ import annotations

from typing import Any

from engine.config.types import WandbConfig


class WandbMonitor:
    """wandb.init(project=, group=, entity=team); the events of one step go in one wandb.log call at
    step = global_samples (wandb wants the step to grow, and DeepSpeed's events share theirs)."""

    def __init__(self, config: WandbConfig) -> None:
        import wandb  # checked at initialize

        self._wandb = wandb
        self.run: Any = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def close(self) -> None:
        self.run.finish()
