"""The named errors of NVMe offload's swap folders and files (the transfer errors, AioError and
DiskFullError, are engine/ops/aio.py's and are re-exported by engine.offload)."""

from __future__ import annotations


class SwapPathError(OSError):
    """nvme_path cannot hold swap files: missing, not a directory, not writable, or a swap folder of the
    same run and rank is in use by a live process. The message names the config key, the path and the fix."""


class SwapFileError(OSError):
    """A swap file is not what was written: its size differs from the size it was created with
    (truncated or extended by someone else), or a read asks for elements never written (they would
    read back as zeros). The message names the file, the sizes or element range, and what to do."""
