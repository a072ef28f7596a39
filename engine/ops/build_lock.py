"""One builder per extension build directory, with its owner on record, so a dead builder never stalls a run.

    with build_lock.held(build_dir, "the C++ extension"):
        cpp_extension.load(..., build_directory=build_dir)

torch's own baton (`DIR/lock`) is an empty file: a process killed mid-compile leaves it behind and every
later load waits on it forever. `held()` takes a lock of our own first, `DIR/owner`, created atomically
with the holder's pid, host and start time in it. A waiter reads it and says on stderr whom it waits for;
an owner whose pid is gone on this host is stale at once (removed with torch's baton, and said so); an
owner on another host cannot be checked, so it is removed only when older than STALE_LOCK_SECONDS.
torch's baton found while we hold the owner lock can only be a dead builder's (a live one holds the
owner lock for as long as it holds the baton), so it is removed too.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

OWNER = "owner"
TORCH_BATON = "lock"
STALE_LOCK_SECONDS = 900  # only for owners on another host, whose pid cannot be checked from here
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    started: float
    text: str
    """The file's content as read: a stale owner is removed only if the file still holds exactly this."""


def say(message: str) -> None:
    """One "[engine] ..." line on stderr, written above a progress bar as the engine logger's are (tqdm.write),
    so a build message does not run on from the bar's line."""
    tqdm.write(f"[engine] {message}", file=sys.stderr)
    sys.stderr.flush()


def _read_owner(path: Path) -> Owner | None:
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        return Owner(int(record["pid"]), str(record["host"]), float(record["started"]), text)
    except (ValueError, KeyError, TypeError):  # not ours or damaged: unknown owner, judged by age
        return Owner(0, "an unknown host", mtime, text)


def _try_create(path: Path) -> bool:
    """Creates the owner file with its content in one step (link of a finished temp file), so a reader
    never sees it empty; False when it already exists."""
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
    partial = path.with_name(f"{OWNER}.{socket.gethostname()}.{os.getpid()}.tmp")
    partial.write_text(record)
    try:
        os.link(partial, path)
        return True
    except FileExistsError:
        return False
    finally:
        partial.unlink(missing_ok=True)


def _alive(owner: Owner) -> bool | None:
    """True/False for a process on this host, None when it cannot be checked (another host)."""
    if owner.host != socket.gethostname() or owner.pid <= 0:
        return None
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_if_unchanged(build_dir: Path, owner: Owner) -> bool:
    """Removes a stale owner file (and torch's baton) if it still holds what was judged stale. Waiters
    that judge at the same time serialise here on a flock, so none removes the lock a faster one has
    just taken."""
    guard = os.open(build_dir / f"{OWNER}.guard", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        current = _read_owner(build_dir / OWNER)
        if current is None or current.text != owner.text:
            return False
        (build_dir / TORCH_BATON).unlink(missing_ok=True)
        (build_dir / OWNER).unlink(missing_ok=True)
        return True
    finally:
        os.close(guard)  # closing releases the flock


def _stale_reason(owner: Owner) -> str:
    """Why this owner may be removed now, or "" when it has to be waited for."""
    alive = _alive(owner)
    if alive is False:
        return f"pid {owner.pid} on {owner.host} is gone"
    age = time.time() - owner.started
    if alive is None and age > STALE_LOCK_SECONDS:
        return (
            f"it is {age / 60:.0f} min old, older than any build, and pid {owner.pid} on {owner.host} cannot be "
            "checked from here"
        )
    return ""


def acquire(build_dir: Path, what: str, announce_after_s: float = 0.0) -> None:
    """Blocks until this process owns `build_dir`; says on stderr whom it waits for (once, after
    `announce_after_s`) and when it removes a dead owner's lock."""
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / OWNER
    began = time.monotonic()
    announced: tuple[int, str] | None = None
    while not _try_create(path):
        owner = _read_owner(path)
        if owner is None:  # released between our attempt and the read
            continue
        reason = _stale_reason(owner)
        if reason:
            if _remove_if_unchanged(build_dir, owner):
                say(
                    f"removed a stale build lock of pid {owner.pid} on {owner.host} in {build_dir} ({reason}); "
                    f"building {what} here"
                )
            continue
        if announced != (owner.pid, owner.host) and time.monotonic() - began >= announce_after_s:
            local = owner.host == socket.gethostname()
            limit = (
                ""
                if local
                else (
                    f"; it is on another host, so it cannot be checked from here and is taken over "
                    f"after {STALE_LOCK_SECONDS // 60} min"
                )
            )
            say(
                f"waiting for pid {owner.pid} on {owner.host}, which is building {what} in {build_dir} (started "
                f"{max(0.0, time.time() - owner.started):.0f} s ago){limit}; if that process is gone, delete {path}"
            )
            announced = (owner.pid, owner.host)
        time.sleep(POLL_SECONDS)
    baton = build_dir / TORCH_BATON
    if baton.exists():  # no live builder holds torch's baton without our owner file: a dead one left it
        baton.unlink(missing_ok=True)
        say(f"removed torch's build lock {baton}, left by a build that died")


def release(build_dir: Path) -> None:
    """Removes the owner file if it is still this process's."""
    owner = _read_owner(build_dir / OWNER)
    if owner is not None and owner.pid == os.getpid() and owner.host == socket.gethostname():
        (build_dir / OWNER).unlink(missing_ok=True)


@contextmanager
def held(build_dir: Path, what: str, announce_after_s: float = 0.0) -> Iterator[None]:
    acquire(build_dir, what, announce_after_s)
    try:
        yield
    finally:
        release(build_dir)
