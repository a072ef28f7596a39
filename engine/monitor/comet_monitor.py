"""`comet`: events logged to Comet from rank 0, as DeepSpeed logs them (comet_ml.start with the config's
keys; `online: false` writes an offline experiment archive, uploaded later with comet upload)."""

from __future__ import annotations

from typing import Any

from engine.config.types import CometConfig


class CometMonitor:
    """Each event name is logged when samples_log_interval samples have passed since it was last logged
    (DeepSpeed's EventsLogScheduler), at step = global_samples."""

    def __init__(self, config: CometConfig) -> None:
        import comet_ml  # checked at initialize

        self.experiment: Any = comet_ml.start(
            api_key=config.api_key,
            project=config.project,
            workspace=config.workspace,
            experiment_key=config.experiment_key,
            mode=config.mode,
            online=config.online,
        )
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self._interval = config.samples_log_interval
        self._last_logged: dict[str, int] = {}

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            last = self._last_logged.get(name)
            if last is not None and step - last < self._interval:
                continue
            self._last_logged[name] = step
            self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()
