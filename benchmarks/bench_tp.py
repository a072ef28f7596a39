"""Tensor x data parallelism: step time and per-rank model-state bytes for DP 4, TP 2 x DP 2 and TP 4 on
the M model (examples/gpt.py, AutoTP-sharded with engine.tp_model_init), ZeRO stage 2, fp32.

    ZERO_ENGINE_CACHE=/tmp/zcache_bench .venv/bin/python benchmarks/bench_tp.py [--model M] [--world-size 4]
                                                                           [--steps 4] [--stage 2]

Every layout runs in its own fresh ranks: this parent starts `zrun --nproc_per_node N benchmarks/bench_tp.py
--tp T --out DIR` once per layout, each rank writes DIR/rank<r>.json, and the parent writes
benchmarks/results/tp_<model>.md (table, machine) and tp_<model>.png (plot, if matplotlib is there).

Each layout trains the same global batch per step (MICRO sequences per data-parallel rank, so the
data-parallel ranks read MICRO x DP sequences), and the time is the median step after a warm-up step.
Model-state bytes are `engine.memory_report()`; the parameter bytes are split into the tensor-parallel
slices and the replicated parameters (embeddings, layer norms, head, row-parallel biases), so the 1/t
share is visible. fp32: the parameter-byte ratios do not depend on the dtype, and fp32 keeps the
timings clear of bf16's CPU kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # measure the engine of this checkout, whichever one the venv has installed
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch
from gpt import GPT
from gpt_workload import MICRO, MODELS
from machine import machine_facts

MIB = 2**20
STATE_KEYS = ("params", "master", "gradients", "optimizer_state")
BUCKET = 2_000_000


def _config(stage: int, tp: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "tensor_parallel": {"autotp_size": tp},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
    }


# ------------------------------------------------------------------------------------------ one rank
def run_rank(args: argparse.Namespace) -> None:
    import engine
    from engine import comm
    from engine.parallel.layers import is_tensor_parallel

    comm.init_distributed()
    cfg = MODELS[args.model]
    torch.manual_seed(0)
    model = GPT(cfg)
    eng, _, _, _ = engine.initialize(
        model=model, model_parameters=model.parameters(), config=_config(args.stage, args.tp)
    )  # AutoTP shards the model here
    g = torch.Generator().manual_seed(1000 + eng.parallel.dp_rank)  # TP ranks of one DP position: same data
    data = [
        (
            torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=g),
        )
        for _ in range(args.steps + 1)
    ]
    times = []
    for x, y in data:
        comm.barrier()
        t0 = time.perf_counter()
        eng.backward(eng(x, y))
        eng.step()
        times.append(time.perf_counter() - t0)
    params = list(eng.module.parameters())
    split = sum(p.numel() for p in params if is_tensor_parallel(p))
    replicated = sum(p.numel() for p in params if not is_tensor_parallel(p))
    report = dict(eng.memory_report())
    sent = eng.comm_stats()["last_step"]["bytes_sent"]
    out = {
        "rank": comm.get_rank(),
        "tp": eng.mp_world_size,
        "dp": eng.dp_world_size,
        "step_s": times[1:],
        "split_numel": split,
        "replicated_numel": replicated,
        "report": report,
        "last_step_sent": sent,
        "dense_numel": sum(p.numel() for p in GPT(cfg).parameters()),
    }
    eng.destroy()
    with open(os.path.join(args.out, f"rank{comm.get_rank()}.json"), "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------------------------------ the parent
def _launch(args: argparse.Namespace, tp: int, out: str) -> list[dict[str, Any]]:
    zrun = os.path.join(os.path.dirname(sys.executable), "zrun")
    cmd = [
        zrun,
        "--nproc_per_node",
        str(args.world_size),
        os.path.abspath(__file__),
        "--tp",
        str(tp),
        "--out",
        out,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--stage",
        str(args.stage),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.endswith(".json")]


def _row(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = ranks[0]
    per_rank_states = max(sum(r["report"][k] for k in STATE_KEYS) for r in ranks)
    return {
        "tp": r0["tp"],
        "dp": r0["dp"],
        "step_s": statistics.median(max(r["step_s"][i] for r in ranks) for i in range(len(r0["step_s"]))),
        "params": max(r["report"]["params"] for r in ranks),
        "states": per_rank_states,
        "split": r0["split_numel"],
        "replicated": r0["replicated_numel"],
        "dense": r0["dense_numel"],
        "dp_bytes": sum(v for k, v in r0["last_step_sent"].items() if not k.startswith("tp.")),
        "tp_bytes": sum(v for k, v in r0["last_step_sent"].items() if k.startswith("tp.")),
    }


def _write(rows: list[dict[str, Any]], args: argparse.Namespace, load_before: tuple[float, ...]) -> str:
    base = rows[0]
    lines = [
        f"# Tensor x data parallelism, {args.model} model, ZeRO stage {args.stage}, fp32, {args.world_size} ranks",
        "",
        (
            f"Generated by `benchmarks/bench_tp.py --model {args.model} --world-size {args.world_size} "
            f"--steps {args.steps} --stage {args.stage}`. Every data-parallel rank trains {MICRO} sequences per step, "
            "so a layout's global batch is that times its DP size: compare step times per sequence. Model states "
            "are params + fp32 master (none in fp32) + gradients + Adam state; ZeRO partitions the last three over "
            "the DP group, so a larger TP (smaller DP) holds fewer parameter bytes but divides gradients and Adam "
            "state by a smaller DP size (the paper combines both for that reason)."
        ),
        "",
        (
            "| layout | step (s) | s per sequence | params / rank (MiB) | vs DP-only | model states / rank (MiB) "
            "| vs DP-only | TP-split elements / rank | replicated elements / rank | DP bytes / step (MiB) "
            "| TP bytes / step (MiB) |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        per_seq = r["step_s"] / (MICRO * r["dp"])
        lines.append(
            f"| TP {r['tp']} x DP {r['dp']} | {r['step_s']:.2f} | {per_seq:.3f} | {r['params'] / MIB:.1f} "
            f"| {r['params'] / base['params']:.3f} | {r['states'] / MIB:.1f} | {r['states'] / base['states']:.3f} "
            f"| {r['split']:,} | {r['replicated']:,} | {r['dp_bytes'] / MIB:.1f} | {r['tp_bytes'] / MIB:.1f} |"
        )
    lines += [
        "",
        (
            "Parameter bytes per rank at TP t, predicted: (TP-split elements of the dense model / t + replicated "
            "elements) x 4 bytes; the AutoTP-split share of this model is "
            f"{rows[-1]['split'] * rows[-1]['tp'] / base['dense']:.1%} (the blocks' Linear layers); the embeddings, "
            "the head and the norms stay whole on every rank, as DeepSpeed's AutoTP training leaves them."
        ),
        "",
    ]
    for r in rows:
        predicted = (r["split"] + r["replicated"]) * 4
        lines.append(
            f"- TP {r['tp']}: params {r['params']:,} bytes, predicted (split {r['split']:,} + replicated "
            f"{r['replicated']:,}) x 4 = {predicted:,} (ratio {r['params'] / predicted:.4f}; any difference is "
            "the flat layout's padding)"
        )
    lines += [
        "",
        "Machine:",
        *machine_facts(ROOT, load_before, args.world_size),
        (
            f"- {args.world_size} ranks on this machine's cores: with fewer cores than ranks they share them, so "
            "step times measure the layouts' total work, not a cluster's speed-up"
        ),
    ]
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [f"TP{r['tp']}xDP{r['dp']}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [r["params"] / MIB for r in rows], label="params")
    a.bar(
        names,
        [(r["states"] - r["params"]) / MIB for r in rows],
        bottom=[r["params"] / MIB for r in rows],
        label="master, gradients, optimizer state",
    )
    a.set_ylabel("MiB per rank")
    a.set_title("model states per rank")
    a.legend()
    b.bar(names, [r["step_s"] / (MICRO * r["dp"]) for r in rows])
    b.set_ylabel("seconds per sequence")
    b.set_title("step time per sequence")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="M", choices=sorted(MODELS))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--tp", type=int, default=None, help="(internal) run one rank of this layout")
    parser.add_argument("--out", default=None, help="(internal) where a rank writes its result")
    args = parser.parse_args()
    if args.tp is not None:
        run_rank(args)
        return
    load_before = os.getloadavg()
    layouts = [t for t in (1, 2, 4) if args.world_size % t == 0]
    rows = []
    for tp in layouts:
        out = tempfile.mkdtemp(prefix=f"bench_tp{tp}_")
        try:
            rows.append(_row(_launch(args, tp, out)))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        print(f"TP {tp}: {rows[-1]['step_s']:.2f} s/step, params {rows[-1]['params'] / MIB:.1f} MiB/rank", flush=True)
    results = os.path.join(ROOT, "benchmarks", "results")
    path = os.path.join(results, f"tp_{args.model}.md")
    with open(path, "w") as f:
        f.write(_write(rows, args, load_before))
    plotted = _plot(rows, os.path.join(results, f"tp_{args.model}.png"))
    with open(path) as f:
        print(f.read() + ("" if plotted else "(matplotlib missing: no plot)"))


if __name__ == "__main__":
    main()
