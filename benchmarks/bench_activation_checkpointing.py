"""ZeRO-R activation checkpointing: activation memory and step time of the main job's model without
checkpointing, with every block checkpointed, and with the checkpoints partitioned over the
tensor-parallel group (P_a), at TP 1 and TP 2, plus the contiguous arena (M_D) against per-tensor
allocation. ZeRO stage 2, fp32.

    ZERO_ENGINE_CACHE=/tmp/zcache_bench .venv/bin/python benchmarks/bench_activation_checkpointing.py \
        [--model main|S|M] [--micro 16] [--steps 5]

Every variant runs in 2 fresh ranks (`zrun --nproc_per_node 2 ... --variant V --out DIR`): TP 1 is DP 2, TP 2
is one tensor-parallel pair; the parent writes benchmarks/results/activation_checkpointing_<model>.md
(table, machine) and .png.

What a rank measures on each timed step (medians over the steps after one warm-up step):
- activation bytes held between forward and backward, tracked exactly at the end of the forward:
  the storages autograd saved for backward (a pass-through saved_tensors_hooks around the forward,
  parameters excluded, each storage counted once) plus the bytes the checkpoints keep
  (engine.checkpointing.stats());
- peak live bytes during forward + backward: every variant also runs once with
  MALLOC_MMAP_THRESHOLD_=65536, so glibc maps each allocation above 64 KiB on its own and unmaps it
  when it is freed, and the peak RSS above the RSS before the forward (VmHWM, reset through
  /proc/self/clear_refs) is the peak of what was allocated, as max_memory_allocated is on a GPU;
- with glibc's default malloc, as a user's run has it: the RSS the process grew by from the end of
  initialize to the end of the last step (memory the allocator took and kept for the steps, arena
  included) and its peak over that: where per-tensor checkpoints would fragment the heap, this is
  where it shows;
- forward + backward time, and the whole step's (default malloc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from gpt import GPT, GPTConfig
from gpt_workload import MODELS
from machine import machine_facts

MIB = 2**20
MAIN = GPTConfig()
"""examples/train_gpt.py's model: the defaults of examples/gpt.py."""

VARIANTS: dict[str, dict[str, Any]] = {
    "TP1 none": {"tp": 1, "checkpoint": False},
    "TP1 checkpoint": {"tp": 1, "checkpoint": True},
    "TP2 none": {"tp": 2, "checkpoint": False},
    "TP2 checkpoint": {"tp": 2, "checkpoint": True},
    "TP2 checkpoint + partitioned": {"tp": 2, "checkpoint": True, "section": {"partition_activations": True}},
    "TP2 partitioned + contiguous": {
        "tp": 2,
        "checkpoint": True,
        "section": {
            "partition_activations": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": "layers",
        },
    },
}


def _model_config(name: str) -> GPTConfig:
    return MAIN if name == "main" else MODELS[name]


def _config(variant: dict[str, Any], micro: int, layers: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "tensor_parallel": {"autotp_size": variant["tp"]},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000},
    }
    if "section" in variant:
        config["activation_checkpointing"] = {k: layers if v == "layers" else v for k, v in variant["section"].items()}
    return config


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"{field}:\s+(\d+)", f.read())
    assert match, field
    return int(match.group(1))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


class SavedBytes:
    """Storages autograd saves for backward during a forward (parameters excluded, each counted once)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


# ------------------------------------------------------------------------------------------ one rank
def run_rank(args: argparse.Namespace) -> None:
    import engine
    from engine import checkpointing, comm

    comm.init_distributed()
    variant = VARIANTS[args.variant]
    cfg = _model_config(args.model)
    torch.manual_seed(0)
    model = GPT(cfg)
    if variant["checkpoint"]:
        model.checkpoint_blocks = checkpointing.checkpoint
    eng, _, _, _ = engine.initialize(
        model=model, model_parameters=model.parameters(), config=_config(variant, args.micro, cfg.n_layers)
    )
    g = torch.Generator().manual_seed(1000 + eng.parallel.dp_rank)
    data = [
        (
            torch.randint(0, cfg.vocab_size, (args.micro, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (args.micro, cfg.seq_len), generator=g),
        )
        for _ in range(args.steps + 1)
    ]
    rows = []
    rss_start = _rss_kib("VmRSS")
    peak_over_run = 0
    for x, y in data:
        comm.barrier()
        saved = SavedBytes(eng.module)
        checkpointing.reset_peak()
        rss_before = _rss_kib("VmRSS")
        _reset_peak_rss()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = eng(x, y)
        kept = checkpointing.stats()
        eng.backward(loss)
        t1 = time.perf_counter()
        peak = _rss_kib("VmHWM")
        eng.step()
        t2 = time.perf_counter()
        peak_over_run = max(peak_over_run, _rss_kib("VmHWM"))
        rows.append(
            {
                "saved": sum(saved.storages.values()),
                "kept": kept.live_bytes,
                "kept_whole": kept.whole_bytes,
                "checkpoints": kept.live_checkpoints,
                "peak_rss": (peak - rss_before) * 1024,
                "fwd_bwd_s": t1 - t0,
                "step_s": t2 - t0,
            }
        )
        del loss
    out = {
        "rank": comm.get_rank(),
        "variant": args.variant,
        "steps": rows[1:],
        "grown_rss": (_rss_kib("VmRSS") - rss_start) * 1024,
        "peak_grown_rss": (peak_over_run - rss_start) * 1024,
        "partitions": checkpointing.current().partitions,
        "arena": checkpointing.arena_stats(),
    }
    eng.destroy()
    with open(os.path.join(args.out, f"rank{comm.get_rank()}.json"), "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------------------------------ the parent
EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Each allocation above 64 KiB mapped and unmapped on its own: RSS follows the bytes allocated."""


def _launch(args: argparse.Namespace, variant: str, env: dict[str, str]) -> list[dict[str, Any]]:
    out = tempfile.mkdtemp(prefix="bench_ac_")
    try:
        zrun = os.path.join(os.path.dirname(sys.executable), "zrun")
        cmd = [
            zrun,
            "--nproc_per_node",
            "2",
            os.path.abspath(__file__),
            "--variant",
            variant,
            "--out",
            out,
            "--model",
            args.model,
            "--steps",
            str(args.steps),
            "--micro",
            str(args.micro),
        ]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, **env})
        return [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.endswith(".json")]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _row(exact: list[dict[str, Any]], default: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes: rank 0's medians (the ranks of a variant hold the same); times: the slower rank per step."""

    def median(ranks: list[dict[str, Any]], key: str) -> float:
        return statistics.median(s[key] for s in ranks[0]["steps"])

    def slowest(key: str) -> float:
        return statistics.median(max(r["steps"][i][key] for r in default) for i in range(len(default[0]["steps"])))

    # The arena is allocated once, at the first checkpoint of the warm-up step, and stays: the timed steps'
    # peaks do not see it, so it is added to them.
    arena = exact[0]["arena"]["capacity"] if exact[0]["arena"] else 0
    return {
        "variant": default[0]["variant"],
        "saved": median(default, "saved"),
        "kept": median(default, "kept"),
        "kept_whole": median(default, "kept_whole"),
        "checkpoints": median(default, "checkpoints"),
        "peak_allocated": median(exact, "peak_rss") + arena,
        "grown_rss": default[0]["grown_rss"],
        "peak_grown_rss": default[0]["peak_grown_rss"],
        "fwd_bwd_s": slowest("fwd_bwd_s"),
        "step_s": slowest("step_s"),
        "arena": default[0]["arena"],
    }


def _write(
    rows: dict[str, dict[str, Any]], args: argparse.Namespace, cfg: GPTConfig, load_before: tuple[float, ...]
) -> str:
    block_input = args.micro * cfg.seq_len * cfg.d_model * 4
    lines = [
        f"# Activation checkpointing (ZeRO-R), {args.model} model, ZeRO stage 2, fp32, 2 ranks",
        "",
        (
            f"Generated by `benchmarks/bench_activation_checkpointing.py --model {args.model} --micro {args.micro} "
            f"--steps {args.steps}`. Model: d_model {cfg.d_model}, {cfg.n_layers} blocks, sequence {cfg.seq_len}, "
            f"vocabulary {cfg.vocab_size}; {args.micro} sequences per rank per step; TP 1 runs DP 2, TP 2 one "
            f"tensor-parallel pair (AutoTP). A block's input is {block_input / MIB:.2f} MiB. Checkpointing "
            "checkpoints every block (engine.checkpointing.checkpoint, as the main job's "
            "--activation-checkpointing)."
        ),
        "",
        (
            "Activation bytes: what autograd saved for backward plus what the checkpoints keep, tracked at the end "
            "of the forward, per rank. Peak allocated: the peak of the bytes allocated during forward + backward "
            "above those before it (RSS with every allocation above 64 KiB mapped on its own), plus the contiguous "
            "arena's capacity, which is allocated once at the first checkpoint and held. RSS grown: what the "
            f"process took from the end of initialize to the end of its {args.steps + 1} steps with glibc's default "
            "malloc (the arena included), and its peak: model-state allocations at the first step are in both."
        ),
        "",
        (
            "| variant | saved by autograd (MiB) | kept by checkpoints (MiB) | activation bytes (MiB) | vs no "
            "checkpointing | peak allocated in fwd+bwd (MiB) | vs no checkpointing | RSS grown / peak (MiB) "
            "| forward+backward (s) | vs no checkpointing | step (s) |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        base = rows[f"TP{name[2]} none"]
        act, base_act = r["saved"] + r["kept"], base["saved"] + base["kept"]
        lines.append(
            f"| {name} | {r['saved'] / MIB:.2f} | {r['kept'] / MIB:.2f} | {act / MIB:.2f} | {act / base_act:.3f} "
            f"| {r['peak_allocated'] / MIB:.1f} | {r['peak_allocated'] / base['peak_allocated']:.3f} "
            f"| {r['grown_rss'] / MIB:.1f} / {r['peak_grown_rss'] / MIB:.1f} | {r['fwd_bwd_s']:.3f} "
            f"| {r['fwd_bwd_s'] / base['fwd_bwd_s']:.2f} | {r['step_s']:.3f} |"
        )
    whole, part = rows["TP2 checkpoint"], rows["TP2 checkpoint + partitioned"]
    contiguous = rows["TP2 partitioned + contiguous"]
    lines += [
        "",
        "Findings:",
        (
            f"- Partitioned checkpoints at TP 2 keep {part['kept'] / whole['kept']:.3f} of the bytes of whole ones "
            f"({part['kept'] / MIB:.2f} vs {whole['kept'] / MIB:.2f} MiB for {int(part['checkpoints'])} checkpoints; "
            f"{cfg.n_layers} block inputs of {block_input / MIB:.2f} MiB whole)."
        ),
        (
            f"- Recompute overhead: forward + backward takes {rows['TP1 checkpoint']['fwd_bwd_s'] / rows['TP1 none']['fwd_bwd_s']:.2f}x "
            f"at TP 1 and {whole['fwd_bwd_s'] / rows['TP2 none']['fwd_bwd_s']:.2f}x at TP 2 the time without "
            "checkpointing (one more forward of every block: about +33% when the backward costs twice the "
            f"forward); partitioned, with an all-gather per block before its recompute: "
            f"{part['fwd_bwd_s'] / rows['TP2 none']['fwd_bwd_s']:.2f}x."
        ),
        (
            f"- Contiguous arena (M_D) against per-tensor allocation, both partitioned at TP 2: peak allocated "
            f"{contiguous['peak_allocated'] / MIB:.1f} vs {part['peak_allocated'] / MIB:.1f} MiB; RSS grown over the run "
            f"{contiguous['grown_rss'] / MIB:.1f} vs {part['grown_rss'] / MIB:.1f} MiB (peak {contiguous['peak_grown_rss'] / MIB:.1f} "
            f"vs {part['peak_grown_rss'] / MIB:.1f}); forward+backward {contiguous['fwd_bwd_s']:.3f} vs "
            f"{part['fwd_bwd_s']:.3f} s. Arena after the run: {contiguous['arena']}."
        ),
    ]
    lines += ["", "Machine:", *machine_facts(ROOT, load_before, 2)]
    return "\n".join(lines) + "\n"


def _plot(rows: dict[str, dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(rows)
    labels = [
        n.replace(" + ", "\n+ ").replace(" checkpoint", "\ncheckpoint").replace(" partitioned +", "\npartitioned +")
        for n in names
    ]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    saved = [rows[n]["saved"] / MIB for n in names]
    kept = [rows[n]["kept"] / MIB for n in names]
    a.bar(labels, saved, label="saved by autograd")
    a.bar(labels, kept, bottom=saved, label="kept by checkpoints")
    a.plot(labels, [rows[n]["peak_allocated"] / MIB for n in names], "ko", label="peak allocated in fwd+bwd")
    a.set_ylabel("MiB per rank")
    a.set_title("activation memory between forward and backward")
    a.legend(fontsize=8)
    a.tick_params(axis="x", labelsize=7)
    b.bar(labels, [rows[n]["fwd_bwd_s"] for n in names])
    b.set_ylabel("seconds")
    b.set_title("forward + backward per step")
    b.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="main", choices=["main", *sorted(MODELS)])
    parser.add_argument("--micro", type=int, default=16, help="sequences per rank per step (the main job's 16)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    parser.add_argument("--variant", default=None, help="(internal) run one rank of this variant")
    parser.add_argument("--out", default=None, help="(internal) where a rank writes its result")
    args = parser.parse_args()
    if args.variant is not None:
        run_rank(args)
        return
    load_before = os.getloadavg()
    rows = {}
    for name in VARIANTS:
        rows[name] = _row(_launch(args, name, EXACT_MALLOC), _launch(args, name, {}))
        r = rows[name]
        print(
            f"{name}: activations {(r['saved'] + r['kept']) / MIB:.2f} MiB (kept {r['kept'] / MIB:.2f}), "
            f"peak allocated +{r['peak_allocated'] / MIB:.1f} MiB, fwd+bwd {r['fwd_bwd_s']:.3f} s",
            flush=True,
        )
    results = os.path.join(ROOT, "benchmarks", "results")
    path = os.path.join(results, f"activation_checkpointing_{args.model}.md")
    with open(path, "w") as f:
        f.write(_write(rows, args, _model_config(args.model), load_before))
    plotted = _plot(rows, os.path.join(results, f"activation_checkpointing_{args.model}.png"))
    with open(path) as f:
        print(f.read() + ("" if plotted else "(matplotlib missing: no plot)"))


if __name__ == "__main__":
    main()
