"""`deepspeed.utils.logging` -> the engine's logger (Lightning's DeepSpeed strategies set its level:
`deepspeed.utils.logging.logger.setLevel(logging_level)`)."""

from engine.monitor.log import get_logger as _get_logger

logger = _get_logger()

__all__ = ["logger"]
