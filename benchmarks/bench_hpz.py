"""ZeRO++ hpZ on a shaped link: 2 hosts x 2 ranks, stage 3 with and without zero_hpz_partition_size 2.

    sudo .venv/bin/python benchmarks/bench_hpz.py          # root: network namespaces and tc

The hosts are network namespaces on one Linux bridge (tests/separate_hosts.py, as the multi-host launcher
tests build them); each host's link to the bridge is shaped with tc (a token bucket at RATE below), so the
traffic between hosts is slow and the traffic inside a host (2 ranks over the host's own address) is not.
Each configuration runs alternately, REPEATS times, with a fresh set of ranks; the table gives each run's
median step time and the bytes rank 0 sent, per group. Writes benchmarks/results/hpz_shaped_link.md, .json
and .png (when matplotlib is installed).

DeepSpeed's own hpZ is not run here (not tried yet: the peer column of this table is missing).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from machine import machine_facts
from separate_hosts import separate_hosts, why_no_separate_hosts

RATE, REPEATS = "1gbit", 2
SHAPE = ["tbf", "rate", RATE, "burst", "128kb", "latency", "50ms"]
"""Token bucket on each host's link. tc netem (which would add the 0.5 ms delay too) is not in this kernel."""
WORKER = ROOT / "benchmarks" / "hpz_worker.py"
RESULTS = ROOT / "benchmarks" / "results"


def run(hosts: Any, hpz: int, out: Path, port: int) -> dict[str, Any]:
    procs = []
    for host in (0, 1):
        for local in (0, 1):
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "RANK": str(2 * host + local),
                "WORLD_SIZE": "4",
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": hosts.addrs[0],
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1",
            }
            procs.append(hosts.popen(host, [sys.executable, str(WORKER), str(hpz), str(out)], env=env))
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise RuntimeError(f"hpz {hpz}: ranks exited with {codes}")
    return json.loads(out.read_text())


def main() -> None:
    if reason := why_no_separate_hosts():
        sys.exit(f"bench_hpz: {reason}")
    load = os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, separate_hosts(2, Path(tmp)) as hosts:
        for i in (0, 1):
            hosts.exec(i, ["tc", "qdisc", "add", "dev", "eth0", "root", *SHAPE])
        for repeat in range(REPEATS):
            for hpz in (1, 2):
                result = run(hosts, hpz, Path(tmp) / f"r{repeat}_{hpz}.json", 29500 + 2 * repeat + hpz)
                runs.append({**result, "repeat": repeat, "median_s": statistics.median(result["step_s"])})
                print(f"hpz {hpz} run {repeat}: median step {runs[-1]['median_s']:.3f} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hpz_shaped_link.json").write_text(json.dumps(runs, indent=1))
    plotted = plot(runs, RESULTS / "hpz_shaped_link.png")
    (RESULTS / "hpz_shaped_link.md").write_text(table(runs, plotted, machine_facts(str(ROOT), load, 2)))
    print((RESULTS / "hpz_shaped_link.md").read_text())


def table(runs: list[dict[str, Any]], plotted: bool, machine: list[str]) -> str:
    volume = runs[0]["param_bytes"]
    lines = [
        "# ZeRO++ hpZ on a shaped link (benchmarks/bench_hpz.py)",
        "",
        f"2 hosts x 2 ranks (network namespaces, each host's link shaped with tc {' '.join(SHAPE)}; netem, for",
        "a delay, is not in this kernel),",
        "stage 3 over 4 ranks, an MLP of 8 x Linear(1024, 1024) (8.4M parameters, fp32), micro-batch 4, units",
        "released between forward and backward (stage3_max_live_parameters 2M). Median of 6 timed steps per run.",
        "Bytes: what rank 0 sent per step, in parameter volumes (the model's fp32 bytes), by group",
        "(all_gather and reduce_scatter: the world, crossing hosts; hpz.all_gather: inside rank 0's host).",
        "",
        "| hpZ size | run | median step (s) | world all_gather | hpz.all_gather | reduce_scatter |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        per_step = {k: v / len(r["step_s"]) / volume for k, v in r["sent"].items()}
        lines.append(
            f"| {r['hpz']} | {r['repeat']} | {r['median_s']:.3f} | {per_step.get('all_gather', 0):.2f} | "
            f"{per_step.get('hpz.all_gather', 0):.2f} | {per_step.get('reduce_scatter', 0):.2f} |"
        )
    plain = statistics.median(r["median_s"] for r in runs if r["hpz"] == 1)
    hpz = statistics.median(r["median_s"] for r in runs if r["hpz"] == 2)
    lines += [
        "",
        f"Step time with hpZ / without: {hpz / plain:.2f} (goal: <= 0.8).",
        "",
        "![step time](hpz_shaped_link.png)" if plotted else "- No plot: matplotlib is not installed here.",
        "",
        "Machine:",
        *machine,
    ]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for hpz, color in ((1, "tab:gray"), (2, "tab:blue")):
        times = [r["median_s"] for r in runs if r["hpz"] == hpz]
        ax.bar([f"{'plain stage 3' if hpz == 1 else 'hpZ 2'}\nrun {i}" for i in range(len(times))], times, color=color)
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"stage 3, 2 hosts x 2 ranks, link {RATE}")
    fig.tight_layout()
    fig.savefig(path)
    return True


if __name__ == "__main__":
    main()
