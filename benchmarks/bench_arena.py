"""Stage 3 with and without its memory arena: step time and peak memory per rank, in fresh processes.

    python benchmarks/bench_arena.py [--model M] [--steps 8] [--warmup 2]

Each variant runs in its own pair of freshly spawned ranks (gloo, CPU, one thread each), so no
variant inherits another's heap: peak RSS is the process's VmHWM over the whole run (model build,
engine set-up and every step) less the RSS once the model was built, and "steady RSS" is VmRSS after
the last step less the same. Variants: the default
allocator (`stage3_arena_bytes: 0`) with torch's own linear (`memory_efficient_linear: false`: saved
weight.t() views keep released units alive until backward) and with the engine's, against the arena
sized automatically, for fp32 and bf16, with
every block gathered again for backward (stage3_max_reuse_distance 0, prefetching two blocks ahead)
and with DeepSpeed's defaults (units kept gathered from forward to backward).
Writes benchmarks/results/arena_<model>.md and arena_<model>.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpt_workload import MICRO, MODELS, batches

RESULTS = ROOT / "benchmarks" / "results"
LR = 3e-4


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rank(
    rank: int, port: int, model: str, zero: dict[str, Any], precision: str, steps: int, warmup: int, out: Any
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT

    import engine

    cfg = MODELS[model]
    torch.manual_seed(0)
    net = GPT(cfg)
    built = _status_mib("VmRSS")
    eng, *_ = engine.initialize(
        model=net,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": {"stage": 3, "overlap_comm": True, **zero},
        },
    )
    times = []
    for i, (x, y) in enumerate(batches(cfg, steps + warmup)):
        engine.comm.barrier()
        start = time.perf_counter()
        eng.backward(eng(x, y))
        eng.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    result = {
        "times": times,
        "peak": _status_mib("VmHWM") - built,
        "steady": _status_mib("VmRSS") - built,
        "memory": dict(eng.memory_report()),
    }
    eng.destroy()
    engine.comm.destroy_process_group()
    out.put((rank, result))


def run_variant(model: str, zero: dict[str, Any], precision: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from distributed import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, model, zero, precision, steps, warmup, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return [results[0], results[1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="M")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    cfg = MODELS[args.model]
    block = 12 * cfg.d_model * cfg.d_model  # about one transformer block's elements
    modes = {
        "re-gather for backward": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 2 * block},
        "kept (DeepSpeed defaults)": {},
    }
    rows = []
    for precision in ("fp32", "bf16"):
        for mode, zero in modes.items():
            for label, arena in (
                ("default allocator, linear saving views", {"stage3_arena_bytes": 0, "memory_efficient_linear": False}),
                ("default allocator", {"stage3_arena_bytes": 0}),
                ("arena (auto size)", {"stage3_arena_bytes": "auto"}),
            ):
                ranks = run_variant(args.model, {**zero, **arena}, precision, args.steps, args.warmup)
                median = statistics.median(ranks[0]["times"])
                rows.append(
                    (
                        precision,
                        mode,
                        label,
                        median,
                        max(r["peak"] for r in ranks),
                        max(r["steady"] for r in ranks),
                        ranks[0]["memory"],
                    )
                )
                print(f"{precision} {mode} {label}: median {median:.3f} s, peak {rows[-1][4]:.0f} MiB", flush=True)
    mib = 2**20
    lines = [
        f"# Stage 3 with and without the memory arena, model {args.model}, 2 ranks, gloo, CPU",
        "",
        (
            f"Median of {args.steps} steps after {args.warmup} warm-up steps; each variant in fresh processes. "
            "Peak RSS: the larger rank's VmHWM over the whole run less its VmRSS once the model was built (what "
            "the engine and training add); steady RSS: VmRSS after the last step, less the same. "
            "Arena: capacity (auto-sized) and the most of it in use. Time ratio: each row's median over the "
            "first row's (default allocator, torch's linear) in the same mode."
        ),
        "",
        (
            "| precision | mode | allocator | median s | time ratio | peak RSS added MiB | steady RSS added MiB | "
            "arena MiB | arena peak MiB | peak gathered MiB |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base: dict[tuple[str, str], float] = {}
    for precision, mode, label, median, peak, steady, memory in rows:
        base.setdefault((precision, mode), median)
        lines.append(
            f"| {precision} | {mode} | {label} | {median:.3f} | {median / base[(precision, mode)]:.3f} | "
            f"{peak:.0f} | {steady:.0f} | {memory['arena'] / mib:.1f} | {memory['arena_peak'] / mib:.1f} | "
            f"{memory['peak_gathered'] / mib:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"arena_{args.model}.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{p} {m}\n{a}" for p, m, a, *_ in rows]
    colors = ["tab:blue" if a.startswith("arena") else "tab:gray" for _, _, a, *_ in rows]
    ax_t.barh(range(len(rows)), [r[3] for r in rows], color=colors)
    ax_m.barh(range(len(rows)), [r[4] for r in rows], color=colors)
    for ax, title in ((ax_t, "median step s"), (ax_m, "peak RSS added by the engine, MiB (larger rank)")):
        ax.set_yticks(range(len(rows)), labels if ax is ax_t else [""] * len(rows), fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel(title)
    fig.suptitle(f"Stage 3, model {args.model}: arena (blue) vs default allocator (grey)")
    fig.tight_layout()
    fig.savefig(RESULTS / f"arena_{args.model}.png", dpi=120)


if __name__ == "__main__":
    main()
