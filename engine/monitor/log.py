"""The engine's logger: rank-0 lines that do not tear a tqdm progress bar."""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm


class _TqdmHandler(logging.Handler):
    """Writes through tqdm.write so log lines appear above an active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)  # where the bars and logging live
        except Exception:  # noqa: BLE001 - logging must never take the training step down (as logging.StreamHandler)
            self.handleError(record)


class _RankZeroInfo(logging.Filter):
    """INFO and below from rank 0 only (N identical lines help nobody); warnings from every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or os.environ.get("RANK", "0") == "0"


def get_logger() -> logging.Logger:
    """The "engine" logger: its own handler at INFO, like DeepSpeed's, so step logs show whatever the
    application did to the root logger. Quiet it with logging.getLogger("engine").setLevel(...)."""
    logger = logging.getLogger("engine")
    if not any(isinstance(h, _TqdmHandler) for h in logger.handlers):
        handler = _TqdmHandler()
        handler.setFormatter(logging.Formatter("[engine] %(message)s"))
        handler.addFilter(_RankZeroInfo())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
