"""The main job's progress bar: tqdm's on a terminal, one line per update in a log.

A bar redraws itself with carriage returns, around every log line (tqdm.write clears it, prints the
line, draws the bar again) and once more when it closes. A terminal overwrites each redraw in place;
a file or a pipe keeps them all, so a log would show the bar's last lines twice. Where the console is
not a terminal, LineProgress prints the same text (tqdm.format_meter) as one line per update, once.

Under zrun a rank's stderr is always a file (zrun copies rank 0's to its own console), so zrun says
whether that console is a terminal in ZRUN_CONSOLE_IS_TERMINAL; without zrun the process's own stderr
decides.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tqdm import tqdm

CONSOLE_ENV = "ZRUN_CONSOLE_IS_TERMINAL"


def console_is_terminal() -> bool:
    told = os.environ.get(CONSOLE_ENV)
    return told == "1" if told is not None else sys.stderr.isatty()


class LineProgress:
    """tqdm's set_postfix/update/close, printing one line per update on stderr. The step rate (and so
    the time left) counts from the first update, so the first step's one-time costs (the C++ ops'
    first build, first-touch allocations) do not skew it."""

    def __init__(self, total: int, initial: int, desc: str, unit: str, disable: bool) -> None:
        self.total, self.n, self.desc, self.unit, self.disable = total, initial, desc, unit, disable
        self.postfix = ""
        self.started = time.perf_counter()
        self.first: tuple[float, int] | None = None  # (time, n) of the first update

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, self.n)
        since, at = self.first
        rate = (self.n - at) / (now - since) if self.n > at and now > since else None
        if not self.disable:
            # initial=at: no rate yet at the first update ("?"), not one that counts its one-time costs
            line = tqdm.format_meter(
                self.n,
                self.total,
                now - self.started,
                prefix=self.desc,
                unit=self.unit,
                rate=rate,
                postfix=self.postfix,
                initial=at,
            )
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass  # every update is printed already


def progress(total: int, initial: int, desc: str, unit: str, disable: bool) -> tqdm | LineProgress:
    """A tqdm bar on a terminal, else a LineProgress (see the module docstring)."""
    if console_is_terminal():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=disable, dynamic_ncols=True)
    return LineProgress(total, initial, desc, unit, disable)
