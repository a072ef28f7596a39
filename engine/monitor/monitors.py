"""The writers the config turns on (csv_monitor, tensorboard, wandb, comet), fed the same events on
rank 0, as DeepSpeed's MonitorMaster: ("Train/Samples/train_loss", value, global_samples) tuples.

Each optional writer needs its package; `check_packages` runs at initialize on every rank, before the
ranks agree, so a missing one is one ConfigError naming the pip command everywhere, not a crash on
rank 0 after the others started.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

from engine.config.errors import ConfigError
from engine.config.types import EngineConfig

Event = tuple[str, float, int]

_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "comet": ("comet_ml", "comet")}
"""Config section -> (module it imports, the engine's pip extra that installs it)."""


class Writer(Protocol):
    def write_events(self, events: list[Event]) -> None: ...
    def close(self) -> None: ...


def enabled_sections(config: EngineConfig) -> list[str]:
    return [name for name in ("csv_monitor", "tensorboard", "wandb", "comet") if getattr(config, name).enabled]


def check_packages(config: EngineConfig) -> None:
    """ConfigError naming the pip command for every enabled writer whose package is not installed."""
    missing = [
        (section, *_PACKAGES[section])
        for section in enabled_sections(config)
        if section in _PACKAGES and importlib.util.find_spec(_PACKAGES[section][0]) is None
    ]
    if missing:
        raise ConfigError(
            [
                f"{section}.enabled is true but the {module} package is not installed: "
                f"pip install 'zero-engine[{extra}]' (or pip install {module}), or set "
                f"{section}.enabled to false"
                for section, module, extra in missing
            ]
        )


class Monitors:
    """Every enabled writer; `write_events` feeds them all. Only rank 0 builds one (the engine)."""

    def __init__(self, config: EngineConfig) -> None:
        self.writers: list[Writer] = []
        try:
            for section in enabled_sections(config):
                self.writers.append(_build(section, config))
        except BaseException:
            self.close()
            raise

    def __bool__(self) -> bool:
        return bool(self.writers)

    def write_events(self, events: list[Event]) -> None:
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def _build(section: str, config: EngineConfig) -> Writer:
    if section == "csv_monitor":
        from engine.monitor.csv_monitor import CsvMonitor

        return CsvMonitor(config.csv_monitor)
    if section == "tensorboard":
        from engine.monitor.tensorboard_monitor import TensorBoardMonitor

        return TensorBoardMonitor(config.tensorboard)
    if section == "wandb":
        from engine.monitor.wandb_monitor import WandbMonitor

        return WandbMonitor(config.wandb)
    from engine.monitor.comet_monitor import CometMonitor

    return CometMonitor(config.comet)
