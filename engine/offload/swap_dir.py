"""One swap folder per rank and run: <nvme_path>/zero_engine_swap/<run id>/rank<k>/.

    swap = SwapDir.create(nvme_path, rank, run_id, config_key="zero_optimization.offload_optimizer.nvme_path")
    f = swap.file("fp32_master.0", numel, torch.float32, context)   # a SwapFile in swap.path
    swap.close()                                                    # closes the files, removes the folder

The folder holds `owner.json` (pid, host, the process's start time, rank, run id) written before the
folder appears under its name: it is built as `.rank<k>.<pid>.tmp` and renamed into place. Every
create() first removes the folders of this host whose owner is no longer running (a run killed by
SIGKILL or a crash never reaches its exit handlers), and the run folders they leave empty. A folder is
removed only when its owner.json says it belongs to a dead process of this host: folders of other
hosts (a shared file system), of live processes (a PID reused by another program counts as dead: the
start time differs) and anything without an owner.json are kept. A SwapDir removes its own folder on
close() and at interpreter exit (in the process that created it, not in a forked child).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch

from engine.offload.errors import SwapPathError
from engine.offload.mapped_file import MappedFile
from engine.offload.swap_file import SwapFile
from engine.ops.aio import AioContext

ROOT_NAME = "zero_engine_swap"
MARKER = "owner.json"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
STAGING_GRACE_S = 60.0
_STAGING = re.compile(r"\.rank[0-9]+\.([0-9]+)\.tmp")


def check_nvme_path(nvme_path: str | os.PathLike[str], config_key: str = "nvme_path") -> Path:
    """`nvme_path` as a Path after checking that it is an existing, writable directory (by creating and
    removing a probe file there, which also catches a read-only mount); SwapPathError otherwise."""
    path = Path(nvme_path)
    where = f"{config_key} = {os.fspath(nvme_path)!r}"
    if not path.exists():
        raise SwapPathError(f"{where}: no such directory; create it on a fast local disk, or point {config_key} at one")
    if not path.is_dir():
        raise SwapPathError(f"{where}: not a directory; point {config_key} at a directory on a fast local disk")
    try:
        fd, probe = tempfile.mkstemp(prefix=".zero_engine_probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise SwapPathError(
            f"{where}: cannot write there ({error.strerror}); make it writable for this user, or point "
            f"{config_key} at a writable directory"
        ) from error
    return path


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def owner_alive(owner: dict[str, object]) -> bool:
    """Whether the process an owner.json names still runs (on this host: the caller checks the host)."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, someone else's
    now = _start_time(pid)
    return owner.get("start") is None or now is None or now == owner.get("start")


def read_owner(folder: Path) -> dict[str, object] | None:
    try:
        owner = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def remove_dead(root: Path) -> list[Path]:
    """Removes the rank folders under `root` (<nvme_path>/zero_engine_swap) whose owner is a dead process
    of this host, and run folders left empty; returns the rank folders removed."""
    host, removed = socket.gethostname(), []
    for run in sorted(p for p in _subfolders(root)):
        for folder in _subfolders(run):
            owner = read_owner(folder) or _staging_owner(folder, host)
            if owner is not None and owner.get("host") == host and not owner_alive(owner):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        try:
            run.rmdir()  # only when empty; another rank may be creating its folder there now
        except OSError:
            pass
    return removed


def _staging_owner(folder: Path, host: str) -> dict[str, object] | None:
    """A staging folder (.rank<k>.<pid>.tmp) whose owner.json was never written (its maker died between
    the two steps): read as owned by the pid in its name on this host, once it is older than
    STAGING_GRACE_S, so that another host's folder on a shared file system, which gets its owner.json
    within microseconds, is never taken for one."""
    match = _STAGING.fullmatch(folder.name)
    try:
        old = time.time() - folder.stat().st_mtime > STAGING_GRACE_S
    except OSError:
        return None
    return {"pid": int(match.group(1)), "host": host, "start": None} if match and old else None


def _subfolders(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


class SwapDir:
    """This rank's swap folder of one run (see the module docstring); create() makes it."""

    def __init__(self, path: Path, rank: int, run_id: str) -> None:
        self.path, self.rank, self.run_id = path, rank, run_id
        self.pid = os.getpid()
        self.files: dict[str, SwapFile] = {}
        self.mapped_files: dict[str, MappedFile] = {}
        self._closed = False
        atexit.register(self._remove_at_exit)

    @classmethod
    def create(
        cls, nvme_path: str | os.PathLike[str], rank: int, run_id: str, config_key: str = "nvme_path"
    ) -> SwapDir:
        """The folder <nvme_path>/zero_engine_swap/<run_id>/rank<rank>/, made after the folders of dead
        runs are removed. SwapPathError when nvme_path is unusable or this run's rank folder exists (a
        live process's, or one this host cannot judge)."""
        base = check_nvme_path(nvme_path, config_key)
        if not _PLAIN_NAME.fullmatch(run_id):
            raise ValueError(f"swap folder run id {run_id!r}: use letters, digits, '_', '.' and '-' only")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"swap folder rank must be a non-negative integer, got {rank!r}")
        root = base / ROOT_NAME
        try:
            root.mkdir(exist_ok=True)
        except OSError as error:
            raise SwapPathError(f"{config_key}: cannot create {root} ({error.strerror})") from error
        remove_dead(root)
        run, final = root / run_id, root / run_id / f"rank{rank}"
        if final.exists():
            raise _in_use(final, config_key)
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start": _start_time(os.getpid()),
            "rank": rank,
            "run_id": run_id,
            "created": time.time(),
        }
        staging = run / f".rank{rank}.{os.getpid()}.tmp"
        for attempt in range(3):  # another rank's remove_dead may remove the empty run folder meanwhile
            try:
                run.mkdir(exist_ok=True)
                staging.mkdir()
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        (staging / MARKER).write_text(json.dumps(owner))
        try:
            staging.rename(final)
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise _in_use(final, config_key) from error
        return cls(final, rank, run_id)

    def file(self, name: str, numel: int, dtype: torch.dtype, context: AioContext) -> SwapFile:
        """A new swap file `<name>.swp` of `numel` elements of `dtype` in this folder (see SwapFile)."""
        if self._closed:
            raise RuntimeError(f"swap folder {self.path} is closed")
        if name in self.files:
            raise ValueError(f"swap file {name!r} already exists in {self.path}")
        swap = SwapFile(self.path, name, numel, dtype, context)
        self.files[name] = swap
        return swap

    def mapped(self, name: str, numel: int, dtype: torch.dtype) -> MappedFile:
        """A new memory-mapped swap file `<name>.swp` (see engine/offload/mapped_file.py)."""
        if self._closed:
            raise RuntimeError(f"swap folder {self.path} is closed")
        if name in self.files or name in self.mapped_files:
            raise ValueError(f"swap file {name!r} already exists in {self.path}")
        mapped = MappedFile(self.path, name, numel, dtype)
        self.mapped_files[name] = mapped
        return mapped

    def close(self) -> None:
        """Closes every swap file and removes the folder (and the run folder when it is left empty)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._remove_at_exit)
        for swap in self.files.values():
            swap.close()
        self.files.clear()
        for mapped in self.mapped_files.values():
            mapped.close()
        self.mapped_files.clear()
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()
        except OSError:
            pass

    def _remove_at_exit(self) -> None:
        if os.getpid() == self.pid:  # a forked child inherits the handler, not the folder
            self.close()

    def __enter__(self) -> SwapDir:  # noqa: PYI034 (Self needs Python 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_use(folder: Path, config_key: str) -> SwapPathError:
    owner = read_owner(folder)
    who = (
        f"pid {owner.get('pid')} on host {owner.get('host')}"
        if owner is not None
        else "an unknown owner (no readable owner.json)"
    )
    return SwapPathError(
        f"{config_key}: swap folder {folder} already exists, made by {who}; two processes of one run "
        "cannot share a rank's folder: give this run another run id, or remove the folder if that "
        "process is gone"
    )
