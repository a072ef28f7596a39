"""The "Machine:" lines every benchmark report ends with: what ran, where, and how busy it was."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

import torch


def machine_facts(root: str, load_before: tuple[float, ...], busy_cores: int) -> list[str]:
    """CPU, cores, RAM, commit (and whether engine/ had uncommitted changes), platform, date, and the
    load average before and after: above `busy_cores` (what the benchmark itself keeps busy) other
    work shared the cores and the timings are noisier."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem_total = "unknown"
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
            mem_total = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    try:
        head = (
            subprocess.run(
                ["git", "-C", root, "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "engine"],
            capture_output=True,
            check=False,
            text=True,
            timeout=10,
        ).stdout.strip()
        code = f"commit {head}" + (" with uncommitted changes in engine/" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        code = "commit unknown (no git)"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"- CPU: {cpu}; {os.cpu_count()} logical cores ({affinity} usable by this process); RAM {mem_total}",
        f"- code: {code}",
        f"- {platform.system()} {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        (
            f"- load average (1/5/15 min) before the run {' / '.join(f'{x:.2f}' for x in load_before)}, after "
            f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} (this benchmark alone keeps up to "
            f"{min(busy_cores, affinity or 1)} cores busy; more means other work shared the cores and the "
            "timings are noisier)"
        ),
    ]


def in_repo(path: str) -> str:
    """`path` relative to the repository when it lies inside it (a report names no folder of the machine
    it was run on, only the checkout's own files); otherwise as given."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = os.path.abspath(path)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else path


DS_PYTHON = os.environ.get("DEEPSPEED_PYTHON", "")
"""The interpreter of a venv with the real DeepSpeed and torch (DEEPSPEED_PYTHON): the benchmarks'
DeepSpeed rows run there, as DeepSpeed is no dependency of this project."""


def ds_python() -> str:
    """DS_PYTHON, or a named exit when it is not set."""
    if not DS_PYTHON:
        raise SystemExit(
            "the DeepSpeed rows need the interpreter of a venv with deepspeed 0.19.8 and torch: set DEEPSPEED_PYTHON "
            "(e.g. DEEPSPEED_PYTHON=/path/to/dsvenv/bin/python)"
        )
    return DS_PYTHON
