"""The engine logger's warnings, kept in a list while attached (tests that check what a rank logged)."""

from __future__ import annotations

import logging


class EngineWarnings(logging.Handler):
    """The "engine" logger's messages at WARNING and above, in `messages`, from attach() to detach(), or
    inside `with EngineWarnings() as warnings:`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def attach(self) -> EngineWarnings:
        logging.getLogger("engine").addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger("engine").removeHandler(self)

    def __enter__(self) -> EngineWarnings:
        return self.attach()

    def __exit__(self, *_exc: object) -> None:
        self.detach()
