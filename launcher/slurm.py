"""What a SLURM allocation says about the world: its nodes, in SLURM's node order."""

from __future__ import annotations

import re
from collections.abc import Mapping

from launcher.config import Host
from launcher.errors import LaunchError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: `a[1-2,4],b` -> [`a[1-2,4]`, `b`]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(name: str, whole: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.find("]", open_at)
    if close_at < 0:
        raise LaunchError(f"SLURM_JOB_NODELIST {whole!r}: unclosed '[' in {name!r}")
    prefix, ranges, rest = name[:open_at], name[open_at + 1 : close_at], name[close_at + 1 :]
    out: list[str] = []
    for item in ranges.split(","):
        m = _RANGE.match(item)
        if not m:
            raise LaunchError(f"SLURM_JOB_NODELIST {whole!r}: bad range {item!r} in {name!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)  # node[01-10]: zero-padded to the width SLURM wrote
        for k in range(int(lo), int(hi) + 1):
            # The rest may hold further bracket groups (a[1-2]-b[3-4]): expand them for each prefix.
            out.extend(f"{prefix}{k:0{width}d}{tail}" for tail in _expand_one(rest, whole))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list (`node[01-03,07],gpu-a[1-2]`) in order, like `scontrol show hostnames`."""
    return [h for part in _split_top_level(nodelist.strip()) for h in _expand_one(part, nodelist)]


def slurm_hosts(environ: Mapping[str, str], nproc: int, num_nodes: int | None) -> tuple[Host, ...]:
    """The allocation's nodes (the first num_nodes of them), nproc slots each."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError(
            "--launcher slurm: not inside a SLURM allocation (SLURM_JOB_NODELIST is unset); "
            "hint: run zrun from an sbatch script or an salloc shell"
        )
    names = expand_nodelist(nodelist)
    if num_nodes is not None and num_nodes > 0:
        if num_nodes > len(names):
            raise LaunchError(
                f"--num_nodes {num_nodes}: the allocation has {len(names)} node(s) ({nodelist}); "
                f"hint: allocate more nodes or lower --num_nodes"
            )
        names = names[:num_nodes]
    return tuple(Host(n, tuple(range(nproc))) for n in names)
