"""`tensorboard`: events as TensorBoard scalars, in output_path/job_name, as DeepSpeed writes them."""

from __future__ import annotations

import os

from engine.config.types import MonitorConfig


class TensorBoardMonitor:
    """torch.utils.tensorboard's SummaryWriter; each event ("Train/Samples/train_loss", value, global_samples)
    is one scalar at that step. Flushed after every batch of events, so a crash loses nothing written."""

    def __init__(self, config: MonitorConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (checked at initialize)

        self.directory = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.directory, exist_ok=True)
        self._writer = SummaryWriter(log_dir=self.directory)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
