"""`csv_monitor`: one CSV file per event, as DeepSpeed writes them (step, value)."""

from __future__ import annotations

import csv
import os
from typing import TextIO

from engine.config.types import MonitorConfig


class CsvMonitor:
    """Appends events like ("Train/Samples/train_loss", value, global_samples) to
    `output_path/job_name/Train_Samples_train_loss.csv`."""

    def __init__(self, config: MonitorConfig) -> None:
        self.directory = os.path.join(config.output_path or "csv_monitor", config.job_name)
        os.makedirs(self.directory, exist_ok=True)
        self._files: dict[str, TextIO] = {}

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            handle = self._files.get(name)
            if handle is None:
                path = os.path.join(self.directory, name.replace("/", "_") + ".csv")
                new = not os.path.exists(path)
                # Open from the event's first write to close(), not for one `with` block.
                handle = open(path, "a", newline="")  # noqa: SIM115
                if new:
                    csv.writer(handle).writerow(["step", name])
                self._files[name] = handle
            csv.writer(handle).writerow([step, value])
            handle.flush()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
