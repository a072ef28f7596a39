"""Swap folders and files (engine/offload): the folder layout and its owner marker, folders of dead runs
removed by the next start, unusable nvme_path, a full disk, truncated or never-written files, all as
named errors. Transfers go through the Python back-end here (tests/test_aio.py covers both); the full
disk runs both back-ends in a child process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.offload import (
    AioConfig,
    AioContext,
    DiskFullError,
    SwapDir,
    SwapFileError,
    SwapPathError,
    check_nvme_path,
)
from engine.offload.swap_dir import ROOT_NAME, _start_time

KEY = "zero_optimization.offload_optimizer.nvme_path"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ctx() -> AioContext:
    return AioContext(AioConfig(block_size=8192, thread_count=2, backend="python"))


def test_folder_per_rank_and_run_removed_on_close(tmp_path: Path, ctx: AioContext) -> None:
    swap = SwapDir.create(tmp_path, 3, "run-a", config_key=KEY)
    assert swap.path == tmp_path / ROOT_NAME / "run-a" / "rank3"
    owner = json.loads((swap.path / "owner.json").read_text())
    assert (owner["pid"], owner["host"], owner["rank"], owner["run_id"]) == (
        os.getpid(),
        socket.gethostname(),
        3,
        "run-a",
    )
    data = torch.randn(3000).to(torch.bfloat16)
    f = swap.file("exp_avg.0", 5000, torch.bfloat16, ctx)
    assert f.path == swap.path / "exp_avg.0.swp" and f.path.stat().st_size == 10_000
    assert f.path.stat().st_blocks * 512 >= 10_000  # the space is reserved (allocated) at creation
    f.write(data, 1000).wait()
    out = torch.empty(2000, dtype=torch.bfloat16)
    f.read(out, 2000).wait()
    assert torch.equal(out, data[1000:])
    with pytest.raises(SwapPathError, match="already exists, made by pid"):
        SwapDir.create(tmp_path, 3, "run-a", config_key=KEY)  # a live process's folder is never taken
    swap.close()
    assert not (tmp_path / ROOT_NAME / "run-a").exists()
    ctx.close()


def test_unusable_nvme_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(SwapPathError, match=f"{KEY} = '{tmp_path / 'nope'}': no such directory"):
        SwapDir.create(tmp_path / "nope", 0, "run", config_key=KEY)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SwapPathError, match="not a directory"):
        check_nvme_path(tmp_path / "file", KEY)
    # Read-only: root writes anywhere, so the check runs in a child that is not root (nobody) there.
    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o555)
    readonly.chmod(0o555)
    for folder in (tmp_path, *tmp_path.parents):
        if folder != Path("/") and os.geteuid() == 0:
            folder.chmod(folder.stat().st_mode | 0o005)  # nobody may walk down to it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child runs no torch code and leaves with os._exit
        os.close(read)
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            check_nvme_path(readonly, KEY)
            message = "no error"
        except SwapPathError as error:
            message = f"SwapPathError: {error}"
        except BaseException as error:  # noqa: BLE001 (reported to the parent)
            message = f"{type(error).__name__}: {error}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    message = os.read(read, 4096).decode()
    os.close(read)
    assert message.startswith("SwapPathError:") and "cannot write there (Permission denied)" in message, message


def _marker(folder: Path, pid: int, host: str, start: str | None) -> None:
    folder.mkdir(parents=True)
    (folder / "owner.json").write_text(json.dumps({"pid": pid, "host": host, "start": start}))
    (folder / "fp32.0.swp").write_bytes(b"\0" * 64)


def test_next_start_removes_dead_runs_and_keeps_live_ones(tmp_path: Path) -> None:
    root = tmp_path / ROOT_NAME
    dead_pid = os.fork()
    if dead_pid == 0:  # a rank of another run, killed mid-swap: no exit handler runs (no torch code here)
        try:
            crashed = SwapDir.create(tmp_path, 5, "crashed")
            (crashed.path / "exp_avg.0.swp").write_bytes(b"\0" * 64)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(dead_pid, 0)
    assert os.WIFSIGNALED(status) and (root / "crashed" / "rank5" / "exp_avg.0.swp").exists()
    here = socket.gethostname()
    _marker(root / "killed" / "rank0", dead_pid, here, None)  # a run killed before its exit handlers
    _marker(root / "killed" / ".rank1.123.tmp", dead_pid, here, None)  # killed while making its folder
    _marker(root / "reused" / "rank0", os.getpid(), here, "1")  # this PID, but another process's start time
    _marker(root / "live" / "rank0", os.getpid(), here, _start_time(os.getpid()))
    _marker(root / "other-host" / "rank0", dead_pid, here + "-elsewhere", None)  # cannot be judged from here
    (root / "unknown" / "rank0").mkdir(parents=True)  # no owner.json: not ours to remove
    (root / "killed" / f".rank2.{dead_pid}.tmp").mkdir()  # died before writing owner.json, a while ago
    os.utime(root / "killed" / f".rank2.{dead_pid}.tmp", (0, 0))
    (root / "staging" / f".rank0.{dead_pid}.tmp").mkdir(parents=True)  # just made (maybe by another host)
    swap = SwapDir.create(tmp_path, 0, "new-run")
    assert sorted(p.name for p in root.iterdir()) == ["live", "new-run", "other-host", "staging", "unknown"]
    assert (root / "live" / "rank0" / "fp32.0.swp").exists()
    swap.close()


def test_a_truncated_or_removed_file_is_named_on_the_next_read(tmp_path: Path, ctx: AioContext) -> None:
    with SwapDir.create(tmp_path, 0, "run") as swap:
        f = swap.file("master", 1000, torch.float32, ctx)
        f.write(torch.ones(1000)).wait()
        os.truncate(f.path, 2000)
        with pytest.raises(SwapFileError, match=rf"{f.path} has 2000 bytes, expected 4000 \(1000 torch.float32"):
            f.read(torch.empty(10), 0)
        g = swap.file("moments", 10, torch.float32, ctx)
        g.write(torch.ones(10)).wait()
        g.path.unlink()
        g.path.write_bytes(b"\0" * 40)  # replaced by a file of the right size
        with pytest.raises(SwapFileError, match="removed or replaced outside the engine"):
            g.read(torch.empty(10), 0)
    ctx.close()


def test_a_range_never_written_is_not_read_as_zeros(tmp_path: Path, ctx: AioContext) -> None:
    with SwapDir.create(tmp_path, 0, "run") as swap:
        f = swap.file("master", 100, torch.float32, ctx)
        f.write(torch.ones(40), 10).wait()
        f.read(torch.empty(20), 20).wait()
        with pytest.raises(SwapFileError, match=r"elements \[0, 10\) were never written"):
            f.read(torch.empty(30), 0)
        pending = f.write(torch.ones(10), 60)
        f.read(torch.empty(30), 10).wait()  # [10, 40) was written, even with a write in flight elsewhere
        pending.wait()
        f.read(torch.empty(10), 60).wait()
        with pytest.raises(SwapFileError, match=r"elements \[50, 60\) were never written"):
            f.read(torch.empty(60), 10)
        with pytest.raises(ValueError, match=r"elements \[90, 110\) but the file holds 100 elements"):
            f.write(torch.ones(20), 90)
        with pytest.raises(ValueError, match="holds torch.float32, got torch.bfloat16"):
            f.read(torch.empty(2, dtype=torch.bfloat16), 0)
    ctx.close()


FULL_DISK = """
import json, os, resource, signal, sys
import torch
from engine.offload import AioConfig, AioContext, DiskFullError, SwapDir
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG instead of a killed process
results = {}
swap = SwapDir.create(sys.argv[1], 0, "full")
for backend in ("compiled", "python"):
    ctx = AioContext(AioConfig(block_size=16384, thread_count=2, backend=backend))
    big = swap.file(f"big-{backend}", 1 << 16, torch.float32, ctx)  # 256 KiB, reserved before the limit
    big.write(torch.zeros(1 << 16)).wait()  # readable until the failed write below
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 17, resource.RLIM_INFINITY))  # "the disk": 128 KiB
    try:
        swap.file(f"too-big-{backend}", 1 << 16, torch.float32, ctx)
    except DiskFullError as error:
        results[f"create-{backend}"] = [str(error), os.path.exists(error.path)]
    try:
        big.write(torch.ones(1 << 16)).wait()  # 256 KiB: the file's second half lies past the limit
    except DiskFullError as error:
        results[f"write-{backend}"] = [str(error), error.expected, error.got, error.free_bytes]
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        big.read(torch.empty(1 << 16), 0)
    except Exception as error:
        results[f"read-{backend}"] = f"{type(error).__name__}: {error}"
    ctx.close()
print(json.dumps(results))
# no swap.close(): the exit handler removes the folder
"""


def test_a_full_disk_is_a_named_error_and_the_folder_goes_at_exit(tmp_path: Path) -> None:
    env = {**os.environ, "ZERO_ENGINE_OPS": "require", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FULL_DISK), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for backend in ("compiled", "python"):
        message, exists = results[f"create-{backend}"]
        assert "aio create of 262144 bytes at offset 0" in message and "File too large" in message, message
        assert "bytes free" in message and not exists  # nothing half-made is left behind
        message, expected, got, free = results[f"write-{backend}"]
        # Blocks past the limit fail; blocks not started after a failure are skipped, so how many of the
        # first 128 KiB were written before depends on the threads' timing.
        assert expected == 262144 and 0 <= got <= 131072 and free > 0, message
        assert f"big-{backend}.swp: moved {got} bytes (File too large)" in message
        # The failed write left the range unreadable instead of half old, half new.
        assert results[f"read-{backend}"].startswith("SwapFileError:") and "never written" in results[f"read-{backend}"]
    assert not (tmp_path / ROOT_NAME / "full").exists()
    assert isinstance(DiskFullError("write", "x", 0, 1, 0, 28), OSError)


def test_a_file_larger_than_the_free_space_is_refused_before_it_exists(tmp_path: Path, ctx: AioContext) -> None:
    with SwapDir.create(tmp_path, 0, "run") as swap:
        numel = 1 << 50  # 4 PiB of fp32
        with pytest.raises(DiskFullError, match=r"aio create of 4503599627370496 bytes .*No space left on device") as e:
            swap.file("huge", numel, torch.float32, ctx)
        assert e.value.free_bytes > 0 and f"has {e.value.free_bytes} bytes free" in str(e.value)
        assert not (swap.path / "huge.swp").exists()
    ctx.close()
