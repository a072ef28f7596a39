"""Copy rank 0's log files to zrun's console as raw bytes.

torchrun's own tee reads a rank's log line by line and prints every partial line with a prefix and a
newline, so a progress bar's carriage-return redraws become hundreds of lines. Rank 0's output is
what a user watches, so zrun shows it itself, byte for byte: `\r` redraws in place, as if the script
ran in the terminal. Every rank, rank 0 included, still has its log files (for --log_dir and for the
failure report); only the console copy of rank 0 bypasses torchrun's tee.
"""

from __future__ import annotations

import sys
import threading
from typing import BinaryIO

from launcher.report import rank_log_files

POLL_S = 0.05


class Rank0Mirror(threading.Thread):
    def __init__(self, log_dir: str, run_id: str) -> None:
        super().__init__(daemon=True, name="zrun-rank0-mirror")
        self.log_dir, self.run_id = log_dir, run_id
        self._done = threading.Event()
        self._offsets: dict[str, int] = {}

    def _copy_new_bytes(self) -> None:
        for path in rank_log_files(self.log_dir, self.run_id, 0):
            sink: BinaryIO = (sys.stderr if path.endswith("stderr.log") else sys.stdout).buffer
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            if data:
                self._offsets[path] = self._offsets.get(path, 0) + len(data)
                sink.write(data)
                sink.flush()

    def run(self) -> None:
        while not self._done.wait(POLL_S):
            self._copy_new_bytes()
        self._copy_new_bytes()  # what the rank wrote just before it exited

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)


def tee_spec(nproc: int, mirrored_local_rank: int | None) -> str:
    """torchrun --tee value: every local rank except the one zrun mirrors itself."""
    ranks = [r for r in range(nproc) if r != mirrored_local_rank]
    if len(ranks) == nproc:
        return "3"
    return ",".join(f"{r}:3" for r in ranks) or "0"
