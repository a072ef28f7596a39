"""Model-state bytes and peak RSS per rank, bf16: engine ZeRO stages 0-3 against PyTorch DDP and FSDP2.

    ZERO_ENGINE_CACHE=/tmp/zcache_bench .venv/bin/python benchmarks/bench_memory.py [--model M] [--world-size 2]
                                                                               [--steps 3] [--variants ddp,engine-3]

Peak RSS is a per-process high-water mark, so every variant runs in its own fresh ranks: this parent
starts `zrun --nproc_per_node N benchmarks/bench_memory.py --variant X --out DIR` once per variant,
each rank writes DIR/rank<r>.json, and the parent writes benchmarks/results/memory_<model>.md (tables,
what each baseline holds, machine) and memory_<model>.png (plot, if matplotlib is there).

Each rank records RSS before the model is built (interpreter, torch, the engine package, the process
group and the batches), `ru_maxrss` after building the model, after wrapping it (engine.initialize /
DDP / fully_shard and the optimizer), after the first step and after the last, and the model-state
bytes: `memory_report()` for the engine, the tensors themselves (each storage once) for DDP and FSDP2.

Variants (all train the same GPT, examples/gpt.py, on the same random batches, AdamW lr 1e-4, clipping 1.0):
  ddp          baseline: the fp32 model under torch.autocast(cpu, bf16), DDP, torch AdamW on the fp32 params
  ddp-bf16     the model cast to bf16, DDP, torch AdamW straight on the bf16 params (no fp32 master)
  fsdp2        fully_shard per block then the root, MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16)
  engine-S     engine.initialize with "bf16": {"enabled": true}, zero_optimization.stage S (0-3), buckets of
               BUCKET elements, other settings at their defaults
  deepspeed-S  deepspeed.initialize with the same config (only when `deepspeed` is importable)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # measure the engine of this checkout, whichever one the venv has installed
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch
from gpt import GPT, GPTConfig
from gpt_workload import MICRO, MODELS
from gpt_workload import batches as make_batches
from machine import machine_facts

LR = 1e-4
CLIP = 1.0
MIB = 2**20
STATE_KEYS = ("params", "master", "gradients", "optimizer_state")
"""memory_report() categories that are model states; its other byte counts are buffers."""
BASELINE = "ddp"
VARIANTS = [
    "ddp",
    "ddp-bf16",
    "fsdp2",
    "engine-0",
    "engine-1",
    "engine-2",
    "engine-3",
    "deepspeed-0",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
]
LABELS = {
    "ddp": "PyTorch DDP, fp32 model + autocast bf16 (baseline)",
    "ddp-bf16": "PyTorch DDP, bf16 model, AdamW on bf16",
    "fsdp2": "PyTorch FSDP2, bf16 mixed precision",
    **{f"engine-{s}": f"engine stage {s} bf16" for s in range(4)},
    **{f"deepspeed-{s}": f"DeepSpeed stage {s} bf16" for s in range(4)},
}


# ------------------------------------------------------------------------------------------ one rank
def _vmrss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors` (DTensors: their local shard), each storage once."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _torch_states(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> dict[str, int]:
    """Model states of a torch baseline, read after the last step (gradients live until the next
    zero_grad); optimizer state = its tensors with more than one element (AdamW's step counter is not)."""
    state = [v for p in params for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.numel() > 1]
    return {
        "params": _storage_bytes(list(params)),
        "master": 0,
        "gradients": _storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_state": _storage_bytes(state),
    }


@dataclass
class Trainer:
    """One variant, wrapped and ready: `step` trains on a batch, `states` reads the model-state bytes
    (plus buffer byte counts) after the steps, `close` releases it."""

    step: Callable[[torch.Tensor, torch.Tensor], None]
    states: Callable[[], dict[str, int]]
    close: Callable[[], None] = lambda: None
    note: str = ""


def _torch_trainer(
    model: torch.nn.Module, params: list[torch.nn.Parameter], autocast: bool, buckets: Callable[[], int] | None
) -> Trainer:
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)  # at the start, so the last step's gradients can be counted
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()

    def states() -> dict[str, int]:
        report = _torch_states(params, opt)
        if buckets is not None:
            report["buckets"] = buckets()
        return report

    return Trainer(step, states)


def _ddp(model: GPT, bf16_model: bool) -> Trainer:
    """DDP with its defaults (25 MB buckets, gradient_as_bucket_view=False: the reducer keeps a flat
    copy of every gradient, the size of the gradients; computed here, DDP does not expose it)."""
    from torch.nn.parallel import DistributedDataParallel

    if bf16_model:
        model = model.to(torch.bfloat16)
    ddp = DistributedDataParallel(model)
    params = list(ddp.parameters())
    return _torch_trainer(
        ddp, params, autocast=not bf16_model, buckets=lambda: sum(p.numel() * p.element_size() for p in params)
    )


def _fsdp2(model: GPT) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return _torch_trainer(model, list(model.parameters()), autocast=False, buckets=None)


BUCKET = 2_000_000
"""reduce/allgather_bucket_size in elements, given to the engine and to the estimator alike (unset, the
engine sizes buckets from the measured link, and the layout's padding would differ by a few bytes)."""


def _engine_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
    }


def _engine(model: GPT, stage: int) -> Trainer:
    import engine

    eng, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(), config=_engine_config(stage))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        eng.backward(eng(x, y))
        eng.step()

    return Trainer(step, lambda: dict(eng.memory_report()), eng.destroy)


def _deepspeed(model: GPT, stage: int) -> Trainer:
    import deepspeed

    conf = _engine_config(stage)
    conf["optimizer"]["params"]["torch_adam"] = True  # torch.optim.AdamW, as the engine uses
    conf["zero_force_ds_cpu_optimizer"] = False
    eng, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        eng.backward(eng(x, y))
        eng.step()

    inner = getattr(opt, "optimizer", opt)
    return Trainer(step, dict, eng.destroy, note=f"{type(opt).__name__}({type(inner).__name__})")


def _wrap(variant: str, model: GPT) -> Trainer:
    if variant in ("ddp", "ddp-bf16"):
        return _ddp(model, bf16_model=variant == "ddp-bf16")
    if variant == "fsdp2":
        return _fsdp2(model)
    kind, stage = variant.rsplit("-", 1)
    return _engine(model, int(stage)) if kind == "engine" else _deepspeed(model, int(stage))


def run_rank(args: argparse.Namespace) -> None:
    """One rank of one variant, in a fresh process started by zrun."""
    import engine
    from engine import comm

    torch.set_num_threads(args.threads)
    if args.variant.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine.init_distributed(timeout=datetime.timedelta(seconds=args.timeout))
    cfg = MODELS[args.model]
    data = make_batches(cfg, args.steps)
    rank, ws = comm.get_rank(), comm.get_world_size()
    rec: dict[str, Any] = {"rank": rank, "world_size": ws, "rss_before": _vmrss_kib(), "maxrss_before": _maxrss_kib()}

    torch.manual_seed(0)
    model = GPT(cfg)
    rec["maxrss_built"] = _maxrss_kib()
    rec["psi"] = sum(p.numel() for p in model.parameters() if p.requires_grad)  # each shared parameter once
    if args.variant.startswith("engine"):
        estimate: Any = engine.estimate_memory  # a lazy module attribute (engine/__init__.py's __getattr__)
        rec["estimate"] = estimate(
            model, stage=int(args.variant[-1]), world_size=ws, dtype="bf16", bucket_size=BUCKET
        ).total
    trainer = _wrap(args.variant, model)
    del model  # the wrapper holds what it keeps
    rec["maxrss_wrapped"] = _maxrss_kib()
    times = []
    for i, (x, y) in enumerate(data):
        comm.barrier()
        t0 = time.perf_counter()
        trainer.step(x, y)
        times.append(time.perf_counter() - t0)
        if i == 0:
            rec["maxrss_step1"] = _maxrss_kib()
    rec.update(
        maxrss_after=_maxrss_kib(), rss_after=_vmrss_kib(), times=times, memory=trainer.states(), note=trainer.note
    )
    trainer.close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    comm.barrier()
    comm.destroy_process_group()


# ------------------------------------------------------------------------------------------ parent
@dataclass
class Row:
    variant: str
    ranks: list[dict[str, Any]]  # one record per rank (run_rank's), empty when the variant failed or was skipped
    error: str = ""

    @property
    def kind(self) -> str:
        return self.variant.split("-")[0]

    def most(self, key: str) -> float:
        """The largest value over ranks, KiB -> MiB for the RSS fields."""
        return max(r[key] for r in self.ranks) / 1024

    def states(self) -> list[int]:
        return [sum(r["memory"][k] for k in STATE_KEYS) for r in self.ranks if r["memory"]]

    def buffers(self) -> list[int]:
        """Constant (allocated once, kept) buffers per rank: gradient buckets, or the stage-3 arena that
        the buckets then live in; gathered units are transient and shown apart."""
        out = []
        for r in self.ranks:
            m = r["memory"]
            if "buckets" in m:
                out.append(m["arena"] if m.get("arena") else m["buckets"])
        return out


def _zrun() -> list[str]:
    exe = shutil.which("zrun", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "launcher.zrun"]


def _launch(variant: str, args: argparse.Namespace) -> Row:
    out = tempfile.mkdtemp(prefix=f"bench_memory_{variant}_")
    cmd = [
        *_zrun(),
        "--nproc_per_node",
        str(args.world_size),
        os.path.abspath(__file__),
        "--variant",
        variant,
        "--out",
        out,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--timeout",
        str(args.timeout),
    ]
    print(f"[bench_memory] {variant}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout + 120, check=False)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, err = -1, f"timed out after {exc.timeout:.0f} s"
    files = [os.path.join(out, f"rank{r}.json") for r in range(args.world_size)]
    if rc != 0 or not all(os.path.exists(p) for p in files):
        sys.stderr.write(err[-4000:])
        tail = [line for line in err.strip().splitlines() if line.strip()][-1:] or [f"exit status {rc}"]
        return Row(variant, [], error=tail[0][:200])
    ranks = []
    for p in files:
        with open(p) as f:
            ranks.append(json.load(f))
    shutil.rmtree(out, ignore_errors=True)
    print(
        f"[bench_memory] {variant}: done in {time.perf_counter() - t0:.0f} s, peak RSS "
        f"{max(r['maxrss_after'] for r in ranks) / 1024:.0f} MiB",
        flush=True,
    )
    return Row(variant, ranks)


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def _ranks_cell(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    if not values:
        return "n/a"
    return fmt(values[0]) if len(set(values)) == 1 else " / ".join(fmt(v) for v in values)


def _main_table(rows: list[Row], psi: int) -> list[str]:
    base = next((r for r in rows if r.variant == BASELINE and r.ranks), None)
    lines = [
        (
            "| variant | model states MiB/rank | model states / Psi (B per param per rank) | constant buffers MiB | "
            "peak RSS MiB | peak RSS - pre-model RSS MiB | peak RSS / DDP's |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if not r.ranks:
            lines.append(f"| {LABELS[r.variant]} | {r.error} | | | | | |")
            continue
        states, bufs = r.states(), r.buffers()
        ratio = f"{r.most('maxrss_after') / base.most('maxrss_after'):.3f}" if base else "n/a"
        lines.append(
            " | ".join(
                [
                    f"| {LABELS[r.variant]}",
                    _ranks_cell(states, _mib),
                    _ranks_cell(states, lambda v: f"{v / psi:.2f}"),
                    _ranks_cell(bufs, _mib) + (" (computed)" if r.variant.startswith("ddp") else ""),
                    _ranks_cell([x["maxrss_after"] / 1024 for x in r.ranks], lambda v: f"{v:.0f}"),
                    _ranks_cell([(x["maxrss_after"] - x["rss_before"]) / 1024 for x in r.ranks], lambda v: f"{v:.0f}"),
                    ratio + " |",
                ]
            )
        )
    return lines


def _breakdown(rows: list[Row]) -> list[str]:
    lines = [
        "| variant | params | master | gradients | optimizer state | sum | buckets | arena | peak gathered |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if not r.ranks or not r.ranks[0]["memory"]:
            continue
        m = r.ranks[0]["memory"]

        def cell(key: str, m: dict[str, int] = m) -> str:
            return _mib(m[key]) if key in m else "n/a"

        lines.append(
            f"| {LABELS[r.variant]} | "
            + " | ".join(cell(k) for k in STATE_KEYS)
            + f" | {_mib(sum(m[k] for k in STATE_KEYS))} | {cell('buckets')} | {cell('arena')} | "
            f"{cell('peak_gathered')} |"
        )
    return lines


def _estimates(rows: list[Row], ws: int) -> list[str]:
    lines = [
        (
            "| variant | Psi | measured model states B/rank | estimate_memory(...).total B | measured / estimate | "
            "measured x N / Psi | estimate x N / Psi | constant buffers B |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.kind != "engine" or not r.ranks:
            continue
        psi, est, meas = r.ranks[0]["psi"], r.ranks[0]["estimate"], max(r.states())
        lines.append(
            f"| {LABELS[r.variant]} | {psi:,} | {meas:,} | {est:,} | {meas / est:.3f} | "
            f"{meas * ws / psi:.2f} | {est * ws / psi:.2f} | {max(r.buffers()):,} |"
        )
    return lines


def _phases(rows: list[Row]) -> list[str]:
    lines = [
        (
            "| variant | pre-model RSS | after building the model | after wrapping | after step 1 | "
            "after the last step | RSS after the steps | step s (median, rank 0) |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if not r.ranks:
            continue
        keys = ("rss_before", "maxrss_built", "maxrss_wrapped", "maxrss_step1", "maxrss_after", "rss_after")
        times = sorted(r.ranks[0]["times"])
        lines.append(
            f"| {LABELS[r.variant]} | "
            + " | ".join(f"{r.most(k):.0f}" for k in keys)
            + f" | {times[len(times) // 2]:.2f} |"
        )
    return lines


def _goals(rows: list[Row], ws: int) -> list[str]:
    by = {r.variant: r for r in rows if r.ranks}
    s3, ddp = by.get("engine-3"), by.get(BASELINE)
    if s3 is None:
        return ["- engine stage 3 did not run: no goal figures."]
    psi = s3.ranks[0]["psi"]
    states, bufs = max(s3.states()), max(s3.buffers())
    bound = 16 * psi / ws + bufs
    m = s3.ranks[0]["memory"]
    split = " + ".join(f"{k} {m[k] * ws / psi:.2f}" for k in STATE_KEYS)
    out = [
        (
            f"- Model states at stage 3 <= 16 Psi/N + constant buffers: measured {_mib(states)} MiB/rank = "
            f"{states * ws / psi:.2f} Psi/N bytes ({split}), plus {_mib(bufs)} MiB of constant buffers, against "
            f"16 Psi/N = {_mib(16 * psi / ws)} MiB (+ the buffers: {_mib(bound)} MiB): "
            + ("met" if states + bufs <= bound else "not met")
            + f"; the estimator's bf16 figure is 14 Psi/N = {_mib(14 * psi / ws)} MiB (fp32 master 4 + bf16 "
            "gradients 2 + Adam 8; no bf16 parameter shard is kept)."
        )
    ]
    if ddp is not None:
        e, d = s3.most("maxrss_after"), ddp.most("maxrss_after")
        out.append(
            f"- Peak RSS at stage 3 <= DDP's: {e:.0f} MiB against {d:.0f} MiB (ratio {e / d:.3f}): "
            + ("met" if e <= d else "not met")
            + " (the larger rank of each)."
        )
    return out


def _write(args: argparse.Namespace, cfg: GPTConfig, rows: list[Row], ds_note: str) -> str:
    ws = args.world_size
    psi = next((r.ranks[0]["psi"] for r in rows if r.ranks), sum(p.numel() for p in GPT(cfg).parameters()))
    command = (
        f"ZERO_ENGINE_CACHE=/tmp/zcache_bench .venv/bin/python benchmarks/bench_memory.py --model {args.model} "
        f"--world-size {ws} --steps {args.steps}" + (f" --variants {args.variants}" if args.variants else "")
    )
    lines = [
        (
            f"# Model-state bytes and peak RSS per rank, bf16, model {args.model} ({psi / 1e6:.1f}M params), "
            f"{ws} ranks, gloo, CPU"
        ),
        "",
        f"Re-run: `{command}`",
        "",
        (
            f"Each variant ran in fresh processes ({ws} ranks, {args.threads} thread each) for {args.steps} training "
            f"steps (forward, backward, clip {CLIP}, AdamW lr {LR}) on micro batches of {MICRO} x {cfg.seq_len} tokens. "
            f"Psi = {psi:,} trainable parameters. Peak RSS: `ru_maxrss` after the last step (the process's "
            "high-water mark over its whole life: model build, wrapping, every step); pre-model RSS: VmRSS after "
            "importing torch and the engine, making the process group and the batches, before the model is built. "
            "Ratio: peak RSS / the DDP baseline's, larger rank of each. Where the ranks differ the cell shows r0 / r1."
        ),
        "",
        *_main_table(rows, psi),
        "",
        "Goals of the issue, with the measured figures:",
        "",
        *_goals(rows, ws),
        "",
        (
            'Engine rows against `engine.estimate_memory(model, stage, world_size=N, dtype="bf16", '
            "bucket_size=2e6).total` "
            "(the estimator counts model states only):"
        ),
        "",
        *_estimates(rows, ws),
        "",
        "Model states by category, rank 0, MiB (engine: `memory_report()`; torch baselines: from the tensors):",
        "",
        *_breakdown(rows),
        "",
        (
            "Where the peak comes from: the larger rank's `ru_maxrss` (MiB) after each phase, and VmRSS at the "
            "start and end:"
        ),
        "",
        *_phases(rows),
        "",
        "What each variant holds:",
        "",
        (
            '- DDP (the baseline): the fp32 model, `torch.autocast("cpu", dtype=torch.bfloat16)` around the '
            "forward, torch AdamW (foreach) on the fp32 parameters. It is the bf16 training torch users run and "
            "the one that does the same arithmetic as the engine's bf16: fp32 weights that the optimizer updates "
            "(the engine's fp32 master), fp32 Adam moments, bf16 matmuls. Model states 16 Psi: fp32 params 4 + "
            "fp32 gradients 4 + Adam 8. Constant buffers: the reducer's flat gradient buckets (fp32, Psi x 4 bytes, "
            "gradient_as_bucket_view=False is DDP's default), computed, since DDP does not expose them. Autocast's "
            "bf16 weight copies (2 Psi) live from the forward to the backward and are in the peak RSS, not the "
            "model states."
        ),
        (
            "- DDP, bf16 model (for reference, not the baseline): `model.to(torch.bfloat16)` and torch AdamW on the "
            'bf16 parameters, as bench_step.py\'s "DDP bf16": no fp32 copy anywhere, bf16 moments, so 8 Psi '
            "(params 2 + gradients 2 + Adam 4) plus bf16 buckets 2 Psi. It holds half of what the engine must "
            "hold for the same numerics (updates smaller than a bf16 ulp are lost), so it is a floor, not a fair "
            "comparison."
        ),
        (
            "- FSDP2: the fp32 model, `fully_shard` on each block then the root, on a 1-D CPU mesh, "
            "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`: the fp32 sharded parameters are the master "
            "weights (bf16 copies exist only as all-gather output while a block is in use), gradients are fp32 "
            "shards, torch AdamW (foreach) on the shards: 16 Psi/N. Counted from the local shards "
            "(`DTensor.to_local()`); its communication buffers are transient (no constant buffers)."
        ),
        (
            '- Engine: `engine.initialize(model=GPT(cfg), config={"bf16": {"enabled": true}, "zero_optimization": '
            '{"stage": S, "reduce_bucket_size": 2e6, "allgather_bucket_size": 2e6}}, AdamW lr 1e-4, weight_decay 0, '
            "gradient_clipping 1.0, micro batch 8)`, every other setting at its default (gradients in bf16, "
            "DeepSpeed's default grad_accum_dtype). Model states = `memory_report()` params + master + gradients + optimizer_state "
            "(tensors with at least one dimension); constant buffers = its `buckets` (at stage 3 the `arena` instead "
            "when one is configured, the buckets live in it); `peak_gathered` (stage 3's most gathered unit bytes "
            "at once) is transient and in neither."
        ),
        f"- {ds_note}",
        "",
        "Notes:",
        "",
        (
            "- Every variant builds the full fp32 model on every rank first (4 Psi, no meta-device / zero.Init "
            "construction) and casts or shards it afterwards, so that transient is in every peak; the phase "
            "table shows which phase set each peak."
        ),
        (
            "- Peak RSS beyond model states and buffers: the pre-model interpreter + torch + engine, activations "
            f"and their gradients (micro batch {MICRO} x {cfg.seq_len} tokens, the {cfg.vocab_size}-wide logits and "
            "cross-entropy being the largest), gathered stage-3 units, autocast's weight copies, and memory the "
            "allocator keeps after it is freed."
        ),
        (
            "- Peak RSS moves by a few tens of MiB between runs of the same code (allocator, timing of the "
            "communication threads): differences of that size between rows are noise. The optimizer state is "
            "allocated in the first step, so the peak is normally reached by the second or third."
        ),
        "- MiB = 2^20 bytes; model states / Psi in bytes per parameter per rank (x N for units of Psi/N).",
        "",
        "Settings:",
        "",
        f"- model {args.model}: {cfg}",
        f"- world size {ws}, backend gloo, {args.threads} intra-op thread(s) per rank, {args.steps} steps per variant",
        "",
        "Machine:",
        "",
        *machine_facts(ROOT, args.load_before, ws),
    ]
    path = os.path.join(ROOT, "benchmarks", "results", f"memory_{args.model}.md")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return path


def _plot(args: argparse.Namespace, rows: list[Row], md_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print(f"wrote {md_path}; matplotlib not installed: table only")
        return
    done = [r for r in rows if r.ranks]
    names = [LABELS[r.variant].replace(" (baseline)", "\n(baseline)") for r in done]
    colors = [{"ddp": "#dd8452", "fsdp2": "#8172b3", "deepspeed": "#55a868"}.get(r.kind, "#4c72b0") for r in done]
    fig, (ax_s, ax_r) = plt.subplots(1, 2, figsize=(13, 0.5 * len(done) + 2.2), sharey=True)
    states = [max(r.states()) / MIB if r.states() else 0.0 for r in done]
    bufs = [max(r.buffers()) / MIB if r.buffers() else 0.0 for r in done]
    ax_s.barh(names, states, color=colors)
    ax_s.barh(names, bufs, left=states, color=colors, alpha=0.35)
    for i, (s, b) in enumerate(zip(states, bufs)):
        ax_s.text(s + b, i, f" {s:.0f} + {b:.0f}", va="center", fontsize=8)
    ax_s.set_xlabel("MiB per rank (larger rank): model states + constant buffers")
    before = [r.most("rss_before") for r in done]
    peak = [r.most("maxrss_after") for r in done]
    ax_r.barh(names, before, color="#cccccc")
    ax_r.barh(names, [p - b for p, b in zip(peak, before)], left=before, color=colors)
    base = next((r.most("maxrss_after") for r in done if r.variant == BASELINE), None)
    if base is not None:
        ax_r.axvline(base, color="#dd8452", linestyle="--", linewidth=1)
    for i, p in enumerate(peak):
        ax_r.text(p, i, f" {p:.0f}" + (f" ({p / base:.2f}x)" if base else ""), va="center", fontsize=8)
    ax_r.set_xlabel("peak RSS MiB per rank (larger rank), dashed: DDP baseline")
    for ax in (ax_s, ax_r):
        ax.set_xlim(0, ax.get_xlim()[1] * 1.2)
    ax_s.invert_yaxis()
    kinds = [
        ("ddp", "#dd8452", "PyTorch DDP"),
        ("fsdp2", "#8172b3", "PyTorch FSDP2"),
        ("engine", "#4c72b0", "engine"),
        ("deepspeed", "#55a868", "DeepSpeed"),
    ]
    handles = [Patch(facecolor=c, label=n) for k, c, n in kinds if any(r.kind == k for r in done)]
    handles += [
        Patch(facecolor="#888888", alpha=0.35, label="constant buffers (left)"),
        Patch(facecolor="#cccccc", label="pre-model RSS (right)"),
    ]
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle(
        f"bf16 memory per rank, model {args.model}, {args.world_size} ranks (gloo, CPU), lower is better", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    png = md_path[:-3] + ".png"
    fig.savefig(png, dpi=110)
    print(f"wrote {md_path} and {png}")


def run_all(args: argparse.Namespace) -> None:
    args.load_before = os.getloadavg()
    plan = [v for v in args.variants.split(",") if v] if args.variants else list(VARIANTS)
    unknown = [v for v in plan if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    has_ds = importlib.util.find_spec("deepspeed") is not None
    ds_note = (
        "DeepSpeed: installed, rows above (RSS only: its model states are not read); the engine's config "
        'plus "torch_adam": true'
        if has_ds
        else 'DeepSpeed: not installed here (`importlib.util.find_spec("deepspeed")` is None), no rows; '
        "run this from a venv that has it to add them."
    )
    rows = []
    for v in plan:
        if v.startswith("deepspeed") and not has_ds:
            if args.variants:
                rows.append(Row(v, [], error="not installed"))
            continue
        rows.append(_launch(v, args))
    if not any(r.ranks for r in rows):
        raise SystemExit("every variant failed (see stderr above)")
    md = _write(args, MODELS[args.model], rows, ds_note)
    _plot(args, rows, md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="M")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per variant")
    parser.add_argument("--steps", type=int, default=3, help="training steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant (collective timeout too)")
    parser.add_argument("--variants", default="", help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set by the parent: run one rank of it
    parser.add_argument("--out", help=argparse.SUPPRESS)  # the folder the ranks write their JSON to
    args = parser.parse_args()
    if args.variant:
        run_rank(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
