"""Step time, memory and communication of ZeRO stages 0-3 (fp32 and bf16) against PyTorch DDP and FSDP2, in one run.

    zrun --nproc_per_node 2 benchmarks/bench_step.py --model S [--steps 20] [--warmup 3] [--bucket 2e7]
                                                        [--variants "ddp,deepspeed bf16"]

Every variant trains the same GPT (examples/gpt.py) on the same random batches with AdamW (lr 1e-4) and
clipping 1.0, one after the other in the same processes, so the ratios compare like with like:
PyTorch DDP fp32 and bf16, engine stages 0, 1, 2 in fp32 and bf16 (overlap_comm, buckets of --bucket
elements), engine stage 3 with prefetch (two blocks ahead) and without, both re-gathering each block for
its backward as FSDP2 does, and "kept" (DeepSpeed's defaults: prefetch 5e7 elements, reuse distance 1e9),
PyTorch FSDP2 (fully_shard on each block, then the root), and DeepSpeed's stages 0-3 when
`import deepspeed` works (skipped with a note otherwise). A table compares engine stage 3 with FSDP2.
A variant that raises is reported as failed in the table (traceback on stderr) and the run goes on;
--fail-fast re-raises instead. --variants runs only some variants (comma-separated filters; a variant
runs when every word of one filter starts a word of its name, case-insensitive, e.g. "ddp,deepspeed stage 2";
"stage 3" then does not match "fp32", "fsdp" matches "FSDP2").
Rank 0 writes benchmarks/results/step_<model>.md (tables, settings, machine) and step_<model>.png (plot,
if matplotlib is there), and prints the tables.

DeepSpeed is not a dependency of this project: run it from a separate venv that has torch, deepspeed and
this package (`pip install -e .`), with DS_ACCELERATOR=cpu (set here when unset), e.g.
    DS_ACCELERATOR=cpu DSVENV/bin/zrun --nproc_per_node 2 benchmarks/bench_step.py --model S
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import step_compile
from gpt import GPT, GPTConfig
from gpt_workload import MICRO, MODELS
from gpt_workload import batches as make_batches
from machine import machine_facts

import engine
from engine import comm

LR = 1e-4
CLIP = 1.0
MIB = 2**20
PREFETCH = 50_000_000  # stage3_prefetch_bucket_size (elements) of the stage 3 rows with prefetch: the default
Step = Callable[[torch.Tensor, torch.Tensor], None]
OP_ABBREV = {"all_reduce": "ar", "reduce_scatter": "rs", "all_gather": "ag", "broadcast": "bc"}


@dataclass
class Result:
    name: str
    precision: str  # "fp32" or "bf16"
    kind: str  # "ddp", "engine", "fsdp" or "deepspeed"
    times: list[float] = field(default_factory=list)
    rss_after: list[float] = field(default_factory=list)  # MiB per rank
    peak_rss: list[float] = field(default_factory=list)  # MiB per rank, empty when VmHWM cannot be reset
    memory: list[dict[str, int]] = field(default_factory=list)  # per rank: params, master, gradients, ...
    # (stage 3 adds gathered / peak_gathered; FSDP2 has no buckets)
    comm_per_step: dict[str, float] = field(default_factory=dict)  # rank 0's bytes per timed step, per op
    comm_note: str = ""
    detail: str = ""  # DeepSpeed: the optimizer wrapper and the optimizer inside it
    error: str = ""
    compiled: bool = False  # --compile: the model compiled with torch.compile (inductor)
    first_step: float = 0.0  # seconds of the first (untimed) step: with torch.compile, mostly the compile


# ---------------------------------------------------------------------------------------------- helpers
def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs). True if it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") <= _proc_status_kib("VmRSS") + 1024  # allow pages touched meanwhile


def _comm_snapshot() -> dict[str, int]:
    return dict(engine.comm_stats()["bytes_sent"])


def _time_steps(
    step: Callable[[torch.Tensor, torch.Tensor], None],
    batches: list,
    warmup: int,
    on_timed_start: Callable[[], None] | None = None,
    res: Result | None = None,
) -> list[float]:
    """The timed steps' seconds (after `warmup` untimed ones); the first step's go to res.first_step."""
    times = []
    for i, (x, y) in enumerate(batches):
        if i == warmup and on_timed_start is not None:
            on_timed_start()
        comm.barrier()  # every variant's step starts together on all ranks
        t0 = time.perf_counter()
        step(x, y)
        if i == 0 and res is not None:
            res.first_step = time.perf_counter() - t0
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


# ---------------------------------------------------------------------------------------------- variants
def run_ddp(res: Result, cfg: GPTConfig, batches: list, warmup: int) -> None:
    """DDP as its users run it: fp32, or the whole model in bf16 with torch AdamW straight on the bf16
    parameters (no fp32 master copy), DDP's default 25 MB buckets."""
    from torch.nn.parallel import DistributedDataParallel

    base = _model(cfg)
    if res.precision == "bf16":
        base = base.to(torch.bfloat16)
    model = DistributedDataParallel(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()

    res.times = _time_steps(step, batches, warmup)

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    params = list(model.parameters())
    pbytes = sum(nbytes(p) for p in params)
    state = sum(
        nbytes(v) for p in params for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.numel() > 1
    )
    # gradients exist from backward to zero_grad (set_to_none); the reducer keeps its own flat bucket
    # copy of every gradient (gradient_as_bucket_view=False, the default): both computed, not read.
    res.memory = [{"params": pbytes, "master": 0, "gradients": pbytes, "optimizer_state": state, "buckets": pbytes}]
    n = comm.get_world_size()
    res.comm_per_step = {"all_reduce": 2.0 * pbytes * (n - 1) / n}
    res.comm_note = "computed"


def _block_numel(cfg: GPTConfig) -> int:
    """Elements of one transformer block of the model (a stage-3 unit)."""
    return sum(p.numel() for p in _model(cfg).blocks[0].parameters())


def _engine_config(stage: int, precision: str, bucket: int, prefetch: int | None = None) -> dict[str, Any]:
    """prefetch: stage 3's stage3_prefetch_bucket_size in elements (0 = no prefetch); None leaves it out."""
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "overlap_comm": True,
        },
    }
    if prefetch is not None:
        conf["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch
    return conf


@contextlib.contextmanager
def engine_session(
    res: Result,
    cfg: GPTConfig,
    stage: int,
    bucket: int,
    prefetch: int | None = None,
    reuse: int | None = None,
) -> Iterator[Step]:
    """The engine built (compiled with res.compiled), its step yielded, its memory report read and the
    engine destroyed after. reuse: stage 3's stage3_max_reuse_distance (0: every block gathered again for
    its backward, as FSDP2's reshard_after_forward; None: the default 1e9, each unit gathered once per
    step here)."""
    model = _model(cfg)
    conf = _engine_config(stage, res.precision, bucket, prefetch)
    if reuse is not None:
        conf["zero_optimization"]["stage3_max_reuse_distance"] = reuse
    eng, _, _, _ = engine.initialize(model=model, config=conf)
    if res.compiled:
        eng.compile(backend="inductor")
    try:

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            eng.backward(eng(x, y))
            eng.step()

        yield step
        res.memory = [dict(eng.memory_report())]
    finally:
        eng.destroy()


def run_engine(
    res: Result,
    cfg: GPTConfig,
    batches: list,
    warmup: int,
    stage: int,
    bucket: int,
    prefetch: int | None = None,
    reuse: int | None = None,
) -> None:
    with engine_session(res, cfg, stage, bucket, prefetch, reuse) as step:
        before: dict[str, int] = {}
        res.times = _time_steps(step, batches, warmup, lambda: before.update(_comm_snapshot()), res)
        after = _comm_snapshot()
        steps = max(len(res.times), 1)
        res.comm_per_step = {
            op: (after[op] - before.get(op, 0)) / steps for op in after if after[op] != before.get(op, 0)
        }


@contextlib.contextmanager
def deepspeed_session(
    res: Result, cfg: GPTConfig, stage: int, bucket: int, prefetch: int | None = None
) -> Iterator[Step]:
    import deepspeed

    # The engine's config as it is (AdamW lr 1e-4, clipping 1.0, the same zero_optimization knobs, bf16);
    # torch_adam: torch.optim.AdamW as the engine uses, not DeepSpeed's compiled CPU/fused Adam.
    conf = _engine_config(stage, res.precision, bucket, prefetch)
    conf["optimizer"]["params"]["torch_adam"] = True
    conf["zero_force_ds_cpu_optimizer"] = False
    model = _model(cfg)
    eng, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    inner = getattr(opt, "optimizer", opt)
    res.detail = type(opt).__name__ + (f"({type(inner).__module__}.{type(inner).__name__})" if inner is not opt else "")
    if res.compiled:
        eng.compile(backend="inductor")
    try:

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            eng.backward(eng(x, y))
            eng.step()

        yield step
        res.comm_note = "not counted"
    finally:
        eng.destroy()


def run_deepspeed(
    res: Result, cfg: GPTConfig, batches: list, warmup: int, stage: int, bucket: int, prefetch: int | None = None
) -> None:
    with deepspeed_session(res, cfg, stage, bucket, prefetch) as step:
        res.times = _time_steps(step, batches, warmup, res=res)


@contextlib.contextmanager
def fsdp_session(res: Result, cfg: GPTConfig, batches: list) -> Iterator[Step]:
    """PyTorch FSDP2: fully_shard on each block, then on the root (which keeps the embeddings, the final
    norm and the head, as the engine's root unit), on a 1-D CPU mesh over the default (gloo) group.
    fp32: no mixed precision. bf16: the fp32 model with MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=bf16), so the fp32 sharded parameters are the master weights (as the engine's fp32
    master shards) and forward/backward compute in bf16. torch AdamW (foreach) on the sharded
    parameters, torch.nn.utils.clip_grad_norm_ on the DTensor gradients (global norm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    model = _model(cfg)
    mesh = init_device_mesh("cpu", (comm.get_world_size(),))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if res.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        if res.compiled:  # FSDP2's recipe (torchtitan's): each block compiled, then sharded
            block.compile(backend="inductor")
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=True)
    last_x = batches[-1][0]
    grad_bytes = [0]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        if x is last_x:  # the sharded gradients, read once (last step), before zero_grad frees them
            grad_bytes[0] = sum(nbytes(p.grad) for p in params if p.grad is not None)
        opt.zero_grad()

    yield step
    # The local shards (fp32; in bf16 also the master: the bf16 copies exist only while gathered, as
    # FSDP2's all-gather output) and the optimizer state on them; FSDP2's communication buffers are
    # transient and not measured (buckets n/a).
    state = sum(
        nbytes(v) for p in params for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and local(v).numel() > 1
    )
    res.memory = [
        {"params": sum(nbytes(p) for p in params), "master": 0, "gradients": grad_bytes[0], "optimizer_state": state}
    ]
    res.comm_note = "not counted"


def run_fsdp(res: Result, cfg: GPTConfig, batches: list, warmup: int) -> None:
    with fsdp_session(res, cfg, batches) as step:
        res.times = _time_steps(step, batches, warmup, res=res)


def run_pair(
    eager: Result,
    compiled: Result,
    session: Callable[[Result], contextlib.AbstractContextManager[Step]],
    batches: list,
    warmup: int,
) -> None:
    """--compile: the eager and the compiled variant alive together, their steps interleaved (which goes
    first alternates), so that both meet the machine in the same state: on a shared VM the speed drifts
    by tens of percent over minutes, which separate runs would put into the ratio."""
    try:
        with session(eager) as eager_step, session(compiled) as compiled_step:
            for i, (x, y) in enumerate(batches):
                order = [(eager, eager_step), (compiled, compiled_step)]
                for res, step in order if i % 2 == 0 else order[::-1]:
                    comm.barrier()
                    t0 = time.perf_counter()
                    step(x, y)
                    took = time.perf_counter() - t0
                    if i == 0:
                        res.first_step = took
                    if i >= warmup:
                        res.times.append(took)
    except Exception as exc:
        compiled.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        raise


# ---------------------------------------------------------------------------------------------- driver
def _run_variant(res: Result, fn: Callable[[], None], fail_fast: bool, can_reset_hwm: bool) -> None:
    gc.collect()
    comm.barrier()
    reset_ok = can_reset_hwm and _reset_peak_rss()
    try:
        fn()
    except Exception as exc:  # reported in the table, the run goes on
        if fail_fast:
            raise
        res.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        print(
            f"[rank {comm.get_rank()}] variant {res.name!r} failed:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
    rss = _proc_status_kib("VmRSS") / 1024
    hwm = _proc_status_kib("VmHWM") / 1024 if reset_ok else -1.0
    gc.collect()
    # Both ranks exchange what they got (same collective on both, failed or not).
    mine = {"rss": rss, "hwm": hwm, "memory": res.memory[0] if res.memory else None, "error": res.error}
    everyone: list[Any] = [None] * comm.get_world_size()
    dist.all_gather_object(everyone, mine)
    res.rss_after = [e["rss"] for e in everyone]
    res.peak_rss = [e["hwm"] for e in everyone] if all(e["hwm"] >= 0 for e in everyone) else []
    res.memory = [e["memory"] for e in everyone] if all(e["memory"] for e in everyone) else []
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"]]
    res.error = "; ".join(errors)
    if comm.get_rank() == 0:
        status = f"FAILED ({res.error})" if res.error else f"median {statistics.median(res.times):.3f} s"
        print(f"{res.name}: {status}", flush=True)


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f}"


def _per_rank(values: list[float]) -> str:
    return " / ".join(f"{v:.0f}" for v in values) if values else "n/a"


def _model_states(mem: dict[str, int]) -> int:
    return mem["params"] + mem["master"] + mem["gradients"] + mem["optimizer_state"]


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e4 else f"{nbytes:.0f} B"


def _comm_cell(res: Result) -> tuple[str, str]:
    if not res.comm_per_step:
        return ("n/a", res.comm_note or "n/a")
    total = sum(res.comm_per_step.values())
    split = " + ".join(
        f"{OP_ABBREV.get(op, op)} {_mb(b)}" for op, b in sorted(res.comm_per_step.items(), key=lambda kv: -kv[1])
    )
    if res.comm_note:
        split += f" ({res.comm_note})"
    return (f"{total / 1e6:.2f}", split)


def _median(results: list[Result], name: str) -> tuple[Result | None, float | None]:
    r = next((r for r in results if r.name == name), None)
    return r, (statistics.median(r.times) if r is not None and r.times and not r.error else None)


def _stage3_vs_fsdp(results: list[Result]) -> list[str]:
    """The issue's goal, per precision: engine stage 3 (prefetch) step time no worse than FSDP2's, memory
    per rank no higher. Ratios engine / FSDP2: below 1 = the engine is faster / holds less."""
    rows = []
    for prec in ("fp32", "bf16"):
        eng, e_med = _median(results, f"engine stage 3 {prec}")
        _, off_med = _median(results, f"engine stage 3 no prefetch {prec}")
        fsdp, f_med = _median(results, f"PyTorch FSDP2 {prec}")
        if fsdp is None or (eng is None and off_med is None):
            continue

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.3f}" if a is not None and b else "n/a"

        def sec(v: float | None) -> str:
            return f"{v:.3f}" if v is not None else "n/a"

        e_states = max(_model_states(m) for m in eng.memory) if eng is not None and eng.memory else None
        f_states = max(_model_states(m) for m in fsdp.memory) if fsdp.memory else None
        e_peak = max(eng.peak_rss) if eng is not None and eng.peak_rss else None
        f_peak = max(fsdp.peak_rss) if fsdp.peak_rss else None
        rows.append(
            f"| {prec} | {sec(e_med)} | {sec(off_med)} | {sec(f_med)} | {ratio(e_med, f_med)} | "
            f"{ratio(off_med, f_med)} | {_mib(e_states) if e_states is not None else 'n/a'} | "
            f"{_mib(f_states) if f_states is not None else 'n/a'} | {ratio(e_states, f_states)} | "
            f"{f'{e_peak:.0f}' if e_peak is not None else 'n/a'} / {f'{f_peak:.0f}' if f_peak is not None else 'n/a'} |"
        )
    if not rows:
        return []
    return [
        "",
        (
            "Stage 3 vs FSDP2 (goal: engine stage 3 step time no worse than FSDP2's, memory per rank no "
            "higher; ratios engine / FSDP2 at the same precision, below 1 = the engine is faster / holds less; "
            "model states = the most over ranks, peak RSS = the most over ranks, same caveats as above):"
        ),
        "",
        (
            "| precision | engine stage 3 median s | engine stage 3 no prefetch median s | FSDP2 median s | "
            "step time ratio | no prefetch: step time ratio | engine model states MiB/rank | "
            "FSDP2 model states MiB/rank | model states ratio | peak RSS MiB engine / FSDP2 |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


def _write_results(args: argparse.Namespace, cfg: GPTConfig, results: list[Result], notes: list[str]) -> None:
    out_dir = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    ws = comm.get_world_size()
    base = {r.precision: statistics.median(r.times) for r in results if r.kind == "ddp" and r.times and not r.error}
    has_peak = any(r.peak_rss for r in results)
    lines = [
        (
            f"# Step time, memory and traffic per step, model {args.model} ({n_params / 1e6:.1f}M params), "
            f"{ws} ranks, {torch.get_num_threads()} thread(s) per rank, gloo, CPU"
        ),
        "",
        (
            f"Median of {args.steps} timed steps after {args.warmup} warm-up steps (forward + backward + clip + "
            f"AdamW step; barrier before each step), micro batch {MICRO} x {cfg.seq_len} tokens per rank. "
            "Ratio: median / the median of DDP at the same precision in the same run."
        ),
        "",
        (
            "| variant | median s | min s | p90 s | ratio to DDP | RSS after steps MiB (r0 / r1) | "
            + ("peak RSS in variant MiB (r0 / r1) | " if has_peak else "")
            + "model states MiB/rank | buckets MiB | comm MB/step | comm split per step |"
        ),
        "| --- | --- | --- | --- | --- | --- | " + ("--- | " if has_peak else "") + "--- | --- | --- | --- |",
    ]
    for r in results:
        if r.error or not r.times:
            med = low = p90 = ratio = "failed" if r.error else "n/a"
        else:
            m = statistics.median(r.times)
            med, low, p90 = f"{m:.3f}", f"{min(r.times):.3f}", f"{sorted(r.times)[int(0.9 * (len(r.times) - 1))]:.3f}"
            ratio = f"{m / base[r.precision]:.3f}" if r.precision in base else "n/a"
        states = " / ".join(_mib(_model_states(m)) for m in r.memory) if r.memory else "n/a"
        if r.memory and len({_model_states(m) for m in r.memory}) == 1:
            states = _mib(_model_states(r.memory[0]))
        buckets = _mib(r.memory[0]["buckets"]) if r.memory and "buckets" in r.memory[0] else "n/a"
        if r.kind == "ddp" and r.memory:
            buckets += " (computed)"
        total, split = _comm_cell(r) if not r.error else ("n/a", "n/a")
        row = [r.name, med, low, p90, ratio, _per_rank(r.rss_after)]
        if has_peak:
            row.append(_per_rank(r.peak_rss))
        row += [states, buckets, total, split]
        lines.append("| " + " | ".join(row) + " |")
    if any(r.memory for r in results):
        lines += [
            "",
            "Model states per rank (rank 0), MiB:",
            "",
            "| variant | params | master | gradients | optimizer state | sum | buckets | peak gathered |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    for r in results:
        if r.memory:
            m = r.memory[0]
            buckets = _mib(m["buckets"]) if "buckets" in m else "n/a"
            gathered = _mib(m["peak_gathered"]) if r.kind == "engine" and "peak_gathered" in m else "n/a"
            lines.append(
                f"| {r.name} | {_mib(m['params'])} | {_mib(m['master'])} | {_mib(m['gradients'])} | "
                f"{_mib(m['optimizer_state'])} | {_mib(_model_states(m))} | {buckets} | {gathered} |"
            )
    lines += _stage3_vs_fsdp(results)
    failed = [r for r in results if r.error]
    if failed:
        lines += ["", "Failed variants (tracebacks on stderr):", ""]
        lines += [f"- {r.name}: {r.error}" for r in failed]
    peak_note = (
        "Peak RSS in variant: VmHWM after resetting it to the current RSS (`/proc/self/clear_refs` = 5) "
        "just before the variant; same caveat about memory kept from earlier variants."
        if has_peak
        else "Peak RSS per variant is not shown: VmHWM could not be reset here (ru_maxrss is per process)."
    )
    notes = [
        (
            "DDP bf16 = the model in bf16 (`model.to(torch.bfloat16)`) with torch AdamW (foreach) directly "
            'on the bf16 parameters, no fp32 master copy, as the reference measurement\'s "DDP bf16"; the '
            "engine's bf16 keeps fp32 master shards, so its optimizer does more work and holds more state."
        ),
        (
            "RSS after steps: VmRSS of each rank right after the variant's last step, before it is freed. "
            "It includes whatever earlier variants left that the allocator kept (variants run in sequence in "
            "the same processes), so compare rows with care."
        ),
        peak_note,
        (
            "Model states: `engine.memory_report()` params + master + gradients + optimizer_state (tensors "
            "in the optimizer state with more than one element); buckets (communication buffers) shown "
            "apart. For DDP they are computed from the parameters and the optimizer state: gradients count "
            "as full-size (they live from backward to zero_grad), and buckets = the reducer's flat copy of "
            "the gradients (gradient_as_bucket_view=False, DDP's default)."
        ),
        (
            "comm MB/step (1 MB = 1e6 bytes): bytes this rank sends per timed step by ring-algorithm volume, "
            "from the difference of `engine.comm_stats()` over the timed steps (rank 0); ar = all_reduce, "
            "rs = reduce_scatter, ag = all_gather. For DDP computed: 2 (N-1)/N x gradient bytes."
        ),
        (
            "examples/gpt.py does not tie the output head to the token embedding, so model S/M here have "
            "more parameters than the reference doc's S (5.3M) / M (29.5M); compare ratios, not seconds."
        ),
        *notes,
    ]
    if any(r.kind == "engine" and r.memory and "peak_gathered" in r.memory[0] for r in results):
        notes.append(
            "Engine stage 3: model states are the shards only (params = this rank's shard of the "
            "parameters in the compute dtype; in bf16 master = the fp32 shard); peak gathered = "
            '`memory_report()["peak_gathered"]`, the most bytes of gathered (full) units held at '
            "once during the variant (warm-up included), not part of the sum; buckets = its gradient "
            'buckets. "no prefetch" sets stage3_prefetch_bucket_size 0: each unit is gathered on '
            "demand, so the difference to the row with prefetch is the overlap of the all-gathers."
        )
    if any(r.kind == "fsdp" for r in results):
        notes.append(
            "FSDP2: model states from the local shards (`DTensor.to_local()`): params = the fp32 "
            "sharded parameters (in bf16 also the master: MixedPrecisionPolicy casts them to bf16 "
            "only in the all-gather, so master = 0 is not missing state), gradients = the sharded "
            "gradients read after the last step's optimizer step, optimizer state = AdamW's sharded "
            "exp_avg / exp_avg_sq; its gathered parameters and communication buffers are transient "
            "and not measured (buckets n/a), its traffic is not counted (it calls torch.distributed "
            "directly, not through engine.comm)."
        )
    if any(r.kind == "deepspeed" for r in results):
        notes.append(
            "DeepSpeed rows: step times and RSS only; model states, buckets and traffic are not "
            "measured for them (n/a)."
        )
    lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    lines += [
        "",
        "Settings:",
        "",
        f"- model {args.model}: {cfg}",
        (
            f"- world size {ws}, backend gloo, {torch.get_num_threads()} intra-op thread(s) per rank; "
            f"{args.steps} timed + {args.warmup} warm-up steps per variant, the same random batches for all"
        ),
        f"- AdamW lr {LR}, weight_decay 0, gradient clipping {CLIP}, micro batch {MICRO}, gradient accumulation 1",
        (
            f"- engine: zero_optimization {{stage s, reduce_bucket_size {args.bucket}, allgather_bucket_size "
            f'{args.bucket}, overlap_comm true}}; bf16 variants add "bf16": {{"enabled": true}}; stage 3 adds '
            'stage3_prefetch_bucket_size of two blocks (prefetch) or 0 ("no prefetch") and '
            "stage3_max_reuse_distance 0 (each block gathered again for its backward, as FSDP2's "
            f'reshard_after_forward); "kept" leaves both at DeepSpeed\'s defaults ({PREFETCH} and 1e9: every unit '
            "prefetched as far as it goes and kept from its forward to its backward, so gathered once per step), "
            "stage3_max_live_parameters left at its default (1e9)"
        ),
        (
            "- DDP: torch.nn.parallel.DistributedDataParallel with the default bucket_cap_mb (25 MB), "
            "torch.optim.AdamW(foreach=True), torch.nn.utils.clip_grad_norm_"
        ),
    ]
    if any(r.kind == "fsdp" for r in results):
        lines.append(
            "- FSDP2: torch.distributed.fsdp.fully_shard on each model.blocks[i], then on the model (default "
            "reshard_after_forward: blocks resharded after forward, the root kept), mesh "
            'init_device_mesh("cpu", (world size,)); fp32: default MixedPrecisionPolicy(); bf16: the fp32 model '
            "with MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16); "
            "torch.optim.AdamW(foreach=True), torch.nn.utils.clip_grad_norm_ on the DTensor gradients"
        )
    ds_rows = [r for r in results if r.kind == "deepspeed"]
    if ds_rows:
        lines.append(
            f"- DeepSpeed {args.ds_version} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', '')}), in the process "
            'group the benchmark made (gloo): the engine\'s config above plus "torch_adam": true in the AdamW '
            "params (torch.optim.AdamW, not DeepSpeed's compiled Adam); optimizer wrappers it chose: "
            + "; ".join(f"{r.name.removeprefix('DeepSpeed ')} {r.detail or 'n/a'}" for r in ds_rows)
        )
    lines += ["", "Machine:", ""] + machine_facts(str(ROOT), args.load_before, comm.get_world_size())
    path = os.path.join(out_dir, f"step_{args.model}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    _plot(args, results, out_dir, path)


def _plot(args: argparse.Namespace, results: list[Result], out_dir: str, md_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {md_path}; matplotlib not installed: table only (pip install matplotlib for the plot)")
        return
    from matplotlib.patches import Patch

    groups = [p for p in ("fp32", "bf16") if any(r.precision == p for r in results)]
    fig, axes = plt.subplots(
        1,
        len(groups),
        figsize=(6 * len(groups), 0.45 * max(sum(r.precision == p for r in results) for p in groups) + 2.0),
        squeeze=False,
    )
    for ax, prec in zip(axes[0], groups):
        rows = [r for r in results if r.precision == prec]
        names = [r.name.replace(f" {prec}", "") for r in rows]
        meds = [statistics.median(r.times) if r.times and not r.error else 0.0 for r in rows]
        colors = [{"ddp": "#dd8452", "deepspeed": "#55a868", "fsdp": "#8172b3"}.get(r.kind, "#4c72b0") for r in rows]
        bars = ax.barh(names, meds, color=colors, hatch=None)
        for bar, r, m in zip(bars, rows, meds):
            if r.kind == "ddp":
                bar.set_hatch("//")
                ax.axvline(m, color="#dd8452", linestyle="--", linewidth=1)
            label = "failed" if r.error else f"{m:.3f}"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
        ax.set_title(prec, fontsize=10)
        ax.set_xlabel("median step time (s), lower is better")
        ax.invert_yaxis()
        ax.set_xlim(0, max(meds + [1e-3]) * 1.25)
    handles = [
        Patch(facecolor="#dd8452", hatch="//", label="PyTorch DDP (baseline)"),
        Patch(facecolor="#4c72b0", label="engine"),
    ]
    if any(r.kind == "fsdp" for r in results):
        handles.append(Patch(facecolor="#8172b3", label="PyTorch FSDP2"))
    if any(r.kind == "deepspeed" for r in results):
        handles.append(Patch(facecolor="#55a868", label="DeepSpeed"))
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle(
        f"Step time per variant, model {args.model}, {comm.get_world_size()} ranks (gloo, CPU, "
        f"{torch.get_num_threads()} thread/rank)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    png = os.path.join(out_dir, f"step_{args.model}.png")
    fig.savefig(png, dpi=110)
    print(f"wrote {md_path} and {png}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="S")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--bucket", type=float, default=2e7, help="reduce/allgather bucket size in elements")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--timeout", type=float, default=600, help="collective timeout (s): a hang becomes an error")
    parser.add_argument("--fail-fast", action="store_true", help="re-raise a variant's exception instead of going on")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="eager against torch.compile (inductor): the engine's stages 0-3, FSDP2 and DeepSpeed's stages, each "
        "both ways (benchmarks/step_compile.py); writes step_compile_<model>.md",
    )
    parser.add_argument(
        "--variants",
        default="",
        help="comma-separated filters: run only the variants whose name has, for every word of "
        "one filter, a word starting with it (case-insensitive), e.g. 'ddp,deepspeed bf16', "
        "'stage 3,fsdp'; default: all",
    )
    args = parser.parse_args()
    args.bucket = int(args.bucket)
    args.load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    engine.init_distributed(timeout=datetime.timedelta(seconds=args.timeout))  # the engines must not tear it down
    cfg = MODELS[args.model]
    batches = make_batches(cfg, args.steps + args.warmup)
    can_reset_hwm = _reset_peak_rss()
    notes: list[str] = []
    args.ds_version = ""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # CPU tensors and gloo, whatever the machine has
    try:
        import deepspeed

        args.ds_version = deepspeed.__version__
        has_ds = True
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
        has_ds = False
        notes.append(
            f"DeepSpeed skipped: `import deepspeed` failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); the reference doc has its timings."
        )
    has_ds = all(_gather(has_ds))  # both ranks must take the same path

    plan: list[tuple[Result, Callable[[Result], None]]] = []
    for prec in ("fp32", "bf16"):
        plan.append((Result(f"PyTorch DDP {prec}", prec, "ddp"), lambda r: run_ddp(r, cfg, batches, args.warmup)))
        for stage in (0, 1, 2):
            plan.append(
                (
                    Result(f"engine stage {stage} {prec}", prec, "engine"),
                    lambda r, s=stage: run_engine(r, cfg, batches, args.warmup, s, args.bucket),
                )
            )
        # FSDP2 prefetches the next block; "prefetch" here allows two blocks ahead, "kept" is DeepSpeed's defaults.
        two_blocks = 2 * _block_numel(cfg)
        for label, prefetch, reuse in (("", two_blocks, 0), ("no prefetch ", 0, 0), ("kept ", PREFETCH, None)):
            plan.append(
                (
                    Result(f"engine stage 3 {label}{prec}", prec, "engine"),
                    lambda r, pf=prefetch, ru=reuse: run_engine(r, cfg, batches, args.warmup, 3, args.bucket, pf, ru),
                )
            )
        plan.append((Result(f"PyTorch FSDP2 {prec}", prec, "fsdp"), lambda r: run_fsdp(r, cfg, batches, args.warmup)))
        if has_ds:
            for stage in (0, 1, 2, 3):
                plan.append(
                    (
                        Result(f"DeepSpeed stage {stage} {prec}", prec, "deepspeed"),
                        lambda r, s=stage: run_deepspeed(
                            r, cfg, batches, args.warmup, s, args.bucket, PREFETCH if s == 3 else None
                        ),
                    )
                )
    if args.compile:
        from torch._inductor import config as inductor_config

        # Every system's first step pays its whole compile: no graph or kernel from an earlier variant (or run).
        inductor_config.force_disable_caches = True
        plan = _compile_plan(args, cfg, batches, has_ds)
    filters = [f.lower().split() for f in args.variants.split(",") if f.strip()]
    if filters:

        def selected(name: str) -> bool:
            words = name.lower().split()
            return any(all(any(n.startswith(w) for n in words) for w in f) for f in filters)

        plan = [(res, fn) for res, fn in plan if selected(res.name)]
        if not plan:
            parser.error(f"--variants {args.variants!r} matches no variant")
    results = []
    for res, fn in plan:
        _run_variant(res, lambda: fn(res), args.fail_fast, can_reset_hwm)  # noqa: B023 - called right away
        results.append(res)
    if comm.get_rank() == 0:
        if args.compile:
            _write_compile_results(args, cfg, results, notes)
        else:
            _write_results(args, cfg, results, notes)
    comm.barrier()
    comm.destroy_process_group()


def _compile_plan(
    args: argparse.Namespace, cfg: GPTConfig, batches: list, has_ds: bool
) -> list[tuple[Result, Callable[[Result], None]]]:
    """--compile: each system eager and compiled, as interleaved pairs (run_pair); bf16 only where the CPU
    computes it natively. The compiled Result of a pair is filled by its eager one's run."""
    precisions = ("fp32", "bf16") if step_compile.cpu_has_bf16() else ("fp32",)
    two_blocks = 2 * _block_numel(cfg)
    sessions: list[tuple[str, str, Callable[[Result], Any]]] = []
    for stage in (0, 1, 2, 3):
        prefetch, reuse = (two_blocks, 0) if stage == 3 else (None, None)
        sessions.append(
            (
                f"engine stage {stage}",
                "engine",
                lambda r, s=stage, pf=prefetch, ru=reuse: engine_session(r, cfg, s, args.bucket, pf, ru),
            )
        )
    sessions.append(("PyTorch FSDP2", "fsdp", lambda r: fsdp_session(r, cfg, batches)))
    if has_ds:
        for stage in (0, 1, 2, 3):
            sessions.append(
                (
                    f"DeepSpeed stage {stage}",
                    "deepspeed",
                    lambda r, s=stage: deepspeed_session(r, cfg, s, args.bucket, PREFETCH if s == 3 else None),
                )
            )
    plan: list[tuple[Result, Callable[[Result], None]]] = []
    for prec in precisions:
        for name, kind, session in sessions:
            eager = Result(f"{name} {prec}", prec, kind)
            compiled = Result(f"{name} {prec} compiled", prec, kind, compiled=True)
            plan.append((eager, lambda r, c=compiled, ss=session: run_pair(r, c, ss, batches, args.warmup)))
            plan.append((compiled, lambda r: None))
    return plan


def _write_compile_results(args: argparse.Namespace, cfg: GPTConfig, results: list[Result], notes: list[str]) -> None:
    out_dir = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    header = [
        (
            f"# Eager and compiled step (torch.compile, inductor), model {args.model} ({n_params / 1e6:.1f}M params), "
            f"{comm.get_world_size()} ranks, {torch.get_num_threads()} thread(s) per rank, gloo, CPU"
        ),
        "",
        (
            f"Generated by `zrun --nproc_per_node {comm.get_world_size()} benchmarks/bench_step.py --model "
            f"{args.model} --compile --steps {args.steps} --warmup {args.warmup}`. Every variant trains the same GPT "
            "on the same batches (AdamW, clipping 1.0), one after another in the same processes. Engine stage 3 "
            "re-gathers each block for its backward with two blocks of prefetch (as the step table's stage 3 row); "
            f"DeepSpeed's stage 3 uses its defaults (prefetch {PREFETCH:.0e} elements). DeepSpeed "
            f"{args.ds_version or 'not run'}."
        ),
        *[f"- {n}" for n in notes],
    ]
    failed = [f"- {r.name}: {r.error}" for r in results if r.error]
    if failed:
        header += ["", "Failed variants:", "", *failed]
    step_compile.write(
        args, results, header, machine_facts(str(ROOT), args.load_before, comm.get_world_size()), out_dir
    )


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * comm.get_world_size()
    dist.all_gather_object(out, value)
    return out


if __name__ == "__main__":
    main()
