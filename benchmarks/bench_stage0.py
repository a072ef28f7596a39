"""Stage 0 step time against PyTorch DDP and the naive per-parameter all-reduce, in one run.

    zrun --nproc_per_node 2 benchmarks/bench_stage0.py [--steps 20] [--model S]

Every variant trains the same GPT (examples/gpt.py) on the same random batches with AdamW and
clipping 1.0, one after the other in the same processes, so the ratios compare like with like.
Rank 0 writes benchmarks/results/stage0_<model>.md (table) and .png (plot, if matplotlib is there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt import GPT, GPTConfig
from gpt_workload import MICRO, MODELS
from gpt_workload import batches as make_batches

import engine
from engine import comm

LR = 1e-4


def _time_steps(step: Callable[[torch.Tensor, torch.Tensor], None], batches: list, warmup: int) -> list[float]:
    times = []
    for i, (x, y) in enumerate(batches):
        comm.barrier()  # every variant's step starts together on all ranks
        t0 = time.perf_counter()
        step(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def run_engine(cfg: GPTConfig, batches: list, warmup: int, bucket: int) -> list[float]:
    torch.manual_seed(0)
    model = GPT(cfg)
    eng, _, _, _ = engine.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket},
        },
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        eng.backward(eng(x, y))
        eng.step()

    times = _time_steps(step, batches, warmup)
    eng.destroy()
    return times


def run_ddp(cfg: GPTConfig, batches: list, warmup: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return _time_steps(step, batches, warmup)


def run_naive(cfg: GPTConfig, batches: list, warmup: int) -> list[float]:
    """The seeds' toy data parallelism: one blocking all-reduce per parameter after backward."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=True)
    n = comm.get_world_size()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()
        for p in model.parameters():
            comm.all_reduce(p.grad)
            p.grad.div_(n)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return _time_steps(step, batches, warmup)


def _write_results(model_name: str, cfg: GPTConfig, rows: list[tuple[str, list[float]]], steps: int) -> None:
    out_dir = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    base = statistics.median(dict(rows)["PyTorch DDP"])
    params = sum(p.numel() for p in GPT(cfg).parameters())
    lines = [
        f"# Stage 0 step time, model {model_name} ({params / 1e6:.1f}M params), "
        f"{comm.get_world_size()} ranks, {torch.get_num_threads()} thread(s) per rank, gloo, fp32",
        "",
        f"Median of {steps} timed steps (forward + backward + clip + AdamW step), micro batch {MICRO} "
        f"x {cfg.seq_len} tokens. Ratio: median / DDP's median in the same run.",
        "",
        "| variant | median s | p90 s | ratio to DDP |",
        "| --- | --- | --- | --- |",
    ]
    for name, times in rows:
        med = statistics.median(times)
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        lines.append(f"| {name} | {med:.3f} | {p90:.3f} | {med / base:.3f} |")
    path = os.path.join(out_dir, f"stage0_{model_name}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: table only (pip install matplotlib for the plot)")
        return
    fig, ax = plt.subplots(figsize=(9, 3.4))
    names = [n for n, _ in rows]
    ax.barh(names, [statistics.median(t) for _, t in rows], color="#4c72b0")
    ax.set_xlabel("median step time (s), lower is better")
    ax.set_title(f"Stage 0 vs DDP, model {model_name}, {comm.get_world_size()} ranks (gloo, CPU)", fontsize=10)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"stage0_{model_name}.png"), dpi=110)
    print(f"wrote {path} and the .png beside it")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="S")
    args = parser.parse_args()
    engine.init_distributed()  # explicit: the engines below must not tear the group down
    cfg = MODELS[args.model]
    batches = make_batches(cfg, args.steps + args.warmup)
    rows = [
        ("PyTorch DDP", run_ddp(cfg, batches, args.warmup)),
        ("engine stage 0, default bucket 5e8 (one bucket)", run_engine(cfg, batches, args.warmup, 500_000_000)),
        ("engine stage 0, 2M-element buckets", run_engine(cfg, batches, args.warmup, 2_000_000)),
        ("engine stage 0, 500k-element buckets", run_engine(cfg, batches, args.warmup, 500_000)),
        ("naive per-parameter all-reduce", run_naive(cfg, batches, args.warmup)),
    ]
    if comm.get_rank() == 0:
        _write_results(args.model, cfg, rows, args.steps)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
