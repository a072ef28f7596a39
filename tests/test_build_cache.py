"""The extension cache cannot stall a run: one build directory per torch installation, one builder per
directory with its owner on record, a dead owner's lock taken over at once, a live one waited for by name.
Real processes hold the lock (killed with SIGKILL mid-"build"); every cache here is a tmp dir."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.ops import build_lock, builder

ROOT = Path(__file__).resolve().parents[1]
LOCK_PY = ROOT / "engine" / "ops" / "build_lock.py"

# The lock module needs only the standard library: loading it by path keeps these processes free of torch.
_PRELUDE = f"""
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("build_lock", {str(LOCK_PY)!r})
build_lock = sys.modules["build_lock"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_lock)
d = Path(sys.argv[1])
"""

HOLDER = (
    _PRELUDE
    + """
release = Path(sys.argv[2])
with build_lock.held(d, "the test extension"):
    (d / "lock").write_text("")  # torch's baton, as while compiling
    print("held", flush=True)
    while not release.exists():
        time.sleep(0.05)
    (d / "lock").unlink()
"""
)

TURN = (
    _PRELUDE
    + """
import os
with build_lock.held(d, "the test extension"):
    with open(d / "turns.log", "a") as log:
        log.write(f"start {os.getpid()}\\n")
    time.sleep(0.3)
    with open(d / "turns.log", "a") as log:
        log.write(f"end {os.getpid()}\\n")
"""
)


def _start_holder(build_dir: Path, release: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(build_dir), str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "held", holder.stderr.read() if holder.stderr else ""
    return holder


def test_build_dir_is_keyed_on_the_torch_installation(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ZERO_ENGINE_CACHE", str(tmp_path))
    base = {
        "compiler": "c++ 13",
        "torch_dir": "/venv-a/lib/python3.12/site-packages/torch",
        "torch_version": "2.13.0",
        "python": "3.12.3 (main)",
        "abi": "cpython-312-x86_64-linux-gnu",
    }
    key = builder.installation_key(**base)
    assert builder.installation_key(**base) == key
    for field, other in (
        ("torch_dir", "/venv-b/lib/python3.12/site-packages/torch"),
        ("torch_version", "2.12.0"),
        ("python", "3.13.1 (main)"),
        ("abi", "cpython-313-x86_64-linux-gnu"),
        ("compiler", "clang 18"),
    ):
        assert builder.installation_key(**{**base, field: other}) != key, field
    here = builder.build_dir("ext", "abc", "c++ 13")
    assert here == builder.build_dir("ext", "abc", "c++ 13")
    assert here.parent == tmp_path / "ops"
    assert here.name == f"ext-abc-{builder.installation_key('c++ 13')}"
    import torch

    assert builder.installation_key("c++ 13") == builder.installation_key(
        "c++ 13",
        torch_dir=os.path.dirname(os.path.abspath(torch.__file__)),
        torch_version=torch.__version__,
        python=sys.version,
    )
    assert builder.installation_key("c++ 13", torch_dir="/elsewhere/torch") != builder.installation_key("c++ 13")


def test_build_key_is_per_checkout(tmp_path) -> None:
    """Two checkouts of the same sources (git worktrees) get two builds: ninja names sources by absolute
    path, so a shared build folder was rebuilt by each checkout in turn."""
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        root.mkdir()
        (root / "op.cpp").write_text("int f() { return 1; }\n")
    key_a = builder.cache_key([a / "op.cpp"], "c++ 13")
    assert builder.cache_key([a / "op.cpp"], "c++ 13") == key_a
    assert builder.cache_key([b / "op.cpp"], "c++ 13") != key_a
    (a / "op.cpp").write_text("int f() { return 2; }\n")
    assert builder.cache_key([a / "op.cpp"], "c++ 13") != key_a  # and the sources' contents


def test_a_killed_builders_lock_is_taken_over_at_once(tmp_path, capsys) -> None:
    build_dir = tmp_path / "ext"
    holder = _start_holder(build_dir, tmp_path / "never")
    assert (build_dir / "lock").exists() and str(holder.pid) in (build_dir / "owner").read_text()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    started = time.monotonic()
    build_lock.acquire(build_dir, "the test extension")
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert f"removed a stale build lock of pid {holder.pid} on {socket.gethostname()}" in err, err
    assert f"pid {holder.pid} on {socket.gethostname()} is gone" in err, err
    assert took < 30, f"took {took:.1f} s: a dead owner must not be waited for"
    assert not (build_dir / "lock").exists(), "torch's baton of the dead build must go with it"
    assert f'"pid": {os.getpid()}' in (build_dir / "owner").read_text()
    build_lock.release(build_dir)
    assert not (build_dir / "owner").exists()


def test_a_live_builder_is_waited_for_by_name(monkeypatch, tmp_path, capsys) -> None:
    build_dir, release = tmp_path / "ext", tmp_path / "release"
    holder = _start_holder(build_dir, release)
    acquired = threading.Event()
    # Every poll of a waiter judges the owner once; counting the judgements lets the test wait for the
    # polls themselves rather than for a time that may hold fewer of them on a loaded machine.
    judged: list[str] = []
    polled = threading.Condition()
    stale_reason = build_lock._stale_reason

    def counted(owner: build_lock.Owner) -> str:
        reason = stale_reason(owner)
        with polled:
            judged.append(reason)
            polled.notify_all()
        return reason

    def polls_reach(count: int) -> bool:
        with polled:
            return polled.wait_for(lambda: len(judged) >= count, timeout=60)

    monkeypatch.setattr(build_lock, "_stale_reason", counted)

    def acquire() -> None:
        build_lock.acquire(build_dir, "the test extension")
        acquired.set()

    waiter = threading.Thread(target=acquire, daemon=True)
    waiter.start()
    assert polls_reach(2), "the waiter never polled"  # the first poll wrote the message, before its sleep
    err = capsys.readouterr().err
    assert (
        f"waiting for pid {holder.pid} on {socket.gethostname()}, which is building the test extension in {build_dir}"
    ) in err, err
    assert f"if that process is gone, delete {build_dir / 'owner'}" in err
    # several polls: the waiter must neither proceed nor repeat itself while the holder lives
    assert polls_reach(len(judged) + 5), f"the waiter stopped polling after {len(judged)} polls"
    assert not acquired.is_set() and holder.poll() is None
    release.touch()
    assert acquired.wait(timeout=60), "the waiter must proceed once the holder releases"
    holder.wait(timeout=60)
    err += capsys.readouterr().err
    assert err.count("waiting for pid") == 1, err
    assert "removed" not in err, err
    build_lock.release(build_dir)


def test_several_processes_at_once_take_turns(tmp_path) -> None:
    build_dir = tmp_path / "ext"
    racers = [
        subprocess.Popen([sys.executable, "-c", TURN, str(build_dir)], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    errs = [racer.communicate(timeout=120)[1] for racer in racers]
    assert all(racer.returncode == 0 for racer in racers), errs
    turns = (build_dir / "turns.log").read_text().split()
    assert len(turns) == 12
    for i in range(0, 12, 4):  # start A, end A: nobody else inside in between
        assert turns[i] == "start" and turns[i + 2] == "end" and turns[i + 1] == turns[i + 3], turns
    assert sum("waiting for pid" in err for err in errs) == 2, errs  # the two that waited, one line each
    assert not (build_dir / "owner").exists()


def test_an_owner_on_another_host_is_waited_for_then_expires_by_age(tmp_path, capsys) -> None:
    build_dir = tmp_path / "ext"
    build_dir.mkdir()
    (build_dir / "owner").write_text(f'{{"pid": 4242, "host": "other-node", "started": {time.time() - 2000}}}')
    build_lock.acquire(build_dir, "the test extension")
    err = capsys.readouterr().err
    assert "removed a stale build lock of pid 4242 on other-node" in err and "cannot be checked" in err, err
    build_lock.release(build_dir)

    (build_dir / "owner").write_text(f'{{"pid": 4242, "host": "other-node", "started": {time.time()}}}')
    waiter = threading.Thread(target=build_lock.acquire, args=(build_dir, "the test extension"), daemon=True)
    waiter.start()
    err, deadline = "", time.monotonic() + 60
    while "waiting for pid 4242" not in err and time.monotonic() < deadline:
        time.sleep(0.1)
        err += capsys.readouterr().err
    assert "waiting for pid 4242 on other-node" in err and "on another host" in err, err
    assert waiter.is_alive()
    (build_dir / "owner").unlink()  # what the message tells a person to do
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    build_lock.release(build_dir)


def test_the_builder_says_it_compiles_and_builds_under_the_lock(monkeypatch, tmp_path, capsys) -> None:
    seen: list[str] = []
    real_compile = builder.compile_library

    def spy(files: list[Path], library: Path) -> None:
        seen.append((library.parent / "owner").read_text())
        real_compile(files, library)

    monkeypatch.setenv("ZERO_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(builder.ENV_MODE, "require")
    monkeypatch.setattr(builder, "compile_library", spy)
    try:
        builder.reset_for_tests()
        ops = builder.load()
        assert ops is not None and ops.simd_level() in ("avx512", "avx2", "scalar")
        err = capsys.readouterr().err
        directory = Path(builder.status().cache_dir)
        assert directory.parent == tmp_path / "ops"
        assert (
            f"compiling the C++ extension ({len(builder.sources())} sources, first use for this torch "
            "installation; about 5-15 s;"
        ) in err, err
        assert f"pid {os.getpid()} on {socket.gethostname()}; cached in {directory}" in err, err
        assert f"compiled the C++ extension in {builder.status().seconds:.1f} s ({ops.simd_level()})" in err, err
        assert builder.status().state == "compiled"
        assert len(seen) == 1 and f'"pid": {os.getpid()}' in seen[0], "the compiler must run under the lock"
        assert not (directory / "owner").exists()

        builder.reset_for_tests()
        assert builder.load() is not None
        assert builder.status().state == "cached"
        assert "compiling" not in capsys.readouterr().err and len(seen) == 1
    finally:
        builder.reset_for_tests()


@pytest.mark.parametrize("content", ["", "not json"])
def test_an_unreadable_owner_is_judged_by_age(tmp_path, capsys, content: str) -> None:
    build_dir = tmp_path / "ext"
    build_dir.mkdir()
    owner = build_dir / "owner"
    owner.write_text(content)
    old = time.time() - 2000
    os.utime(owner, (old, old))
    build_lock.acquire(build_dir, "the test extension")
    assert "removed a stale build lock" in capsys.readouterr().err
    build_lock.release(build_dir)


def test_report_names_the_torch_installation_and_its_build_key(monkeypatch) -> None:
    import torch

    from engine import report

    monkeypatch.setenv(builder.ENV_MODE, "fallback")
    try:
        builder.reset_for_tests()
        lines = report.lines()
    finally:
        builder.reset_for_tests()
    key = builder.installation_key(builder.compiler_version())
    assert (
        f"torch installation .... {os.path.dirname(os.path.abspath(torch.__file__))} (build key {key}: one cache "
        "per installation)"
    ) in lines, lines
