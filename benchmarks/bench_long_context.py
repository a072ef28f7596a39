"""How long a sequence fits: DeepSpeed-Ulysses sequence parallelism (SP) and ALST's tiled compute, the
engine against DeepSpeed 0.19.8 and PyTorch FSDP2, under one per-rank memory cap, side by side on this machine
(CPU, gloo).

    .venv/bin/python benchmarks/bench_long_context.py [--cap-gib 0.95] [--rows 1,2,3,4,5,6] [--max-seq 49152]
        [--deepspeed-path DIR | --deepspeed-python PY (default $DEEPSPEED_PYTHON)] [--layers 2 --hidden 256 ...]

Workload: a Llama built from transformers' LlamaConfig (sdpa attention, untied head, a real vocabulary of
32000 so the logits matter; otherwise small so that it trains on 2 cores: --layers/--hidden/--intermediate/
--heads/--kv-heads), micro batch 1, one random sequence per step, AdamW, bf16 where the CPU has avx512_bf16
or AMX (else fp32), ZeRO stage 2 for every engine and DeepSpeed row.

Rows (--rows):
 1. engine, 1 rank, no SP, plain: the whole logits and the cross entropy of the whole sequence;
 2. engine, 1 rank, no SP, with the tricks: TiledMLP in every LlamaMLP (tiles of `hidden` tokens),
    TiledFusedLogitsLoss (lm_head + loss per tile of --loss-tile tokens, computed from the model's hidden
    states: the logits never exist whole) and activation checkpointing of every decoder layer;
 3. engine, SP 2 on 2 ranks, plain (UlyssesSPAttentionHF.register_with_transformers -> mpu, each rank its
    slice of the sequence, engine.sequence.sequence_parallel_loss);
 4. engine, SP 2, with the tricks of row 2;
 5. DeepSpeed 0.19.8 ALST, SP 2, the same tricks with its own classes (deepspeed.runtime.sequence_parallel.
    ulysses_sp); run by the interpreter of --deepspeed-python / $DEEPSPEED_PYTHON, or by this one with
    --deepspeed-path first on PYTHONPATH; skipped, with the reason, when neither is given or it fails to start;
 6. FSDP2 (fully_shard on every decoder layer and the root, 2 ranks, no SP, plain): it shards the model
    states, but every rank trains a whole sequence of its own and holds all of its activations.

Each attempt is one fresh process group: `python -m launcher.zrun --nproc_per_node N
benchmarks/long_context_worker.py ...` (DeepSpeed: `python -m torch.distributed.run`), every rank capping
its own memory with RLIMIT_DATA before it imports torch (--cap-gib; Linux >= 4.7 counts anonymous mmaps, so
every tensor), with OMP_NUM_THREADS = cores // ranks and MALLOC_MMAP_THRESHOLD_ = 1 MiB (glibc returns freed
blocks to the kernel instead of keeping them in its heaps, where they would count against the cap). An
attempt fits when 2 training steps (forward, backward, optimizer step) complete. Each row's longest
sequence: doubling from --start (halving instead when the start fails) up to --max-seq (the last step to
--max-seq itself), then --bisect bisection steps between the last fit and the first failure (at multiples
of --quantum); the resolution is what is left between the two.

Tokens/s: every row again at one common length that every row fits (the shortest of the rows' longest
fits, or --common-seq), --timed-steps timed steps after a warm-up step, the slowest rank per step, the
median step. Tokens per step: the sequence (SP and 1-rank rows); FSDP2 trains one per rank.

Writes benchmarks/results/long_context.md, .json and .png (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_facts

WORKER = os.path.join(ROOT, "benchmarks", "long_context_worker.py")
GIB = 2**30
FAIL = "LONGCTX-FAIL:"
HIDDEN = ("--deepspeed-path", "--deepspeed-python", "--keep-logs")
MEMORY_WORDS = ("Cannot allocate memory", "can't allocate memory", "MemoryError", "bad_alloc", "out of memory")


@dataclass(frozen=True)
class Row:
    number: int
    label: str
    system: str  # engine, deepspeed, fsdp2
    ranks: int
    sp: int
    tricks: bool


ROWS = [
    Row(1, "engine, 1 rank, no SP, plain", "engine", 1, 1, False),
    Row(2, "engine, 1 rank, no SP, tiled MLP + tiled loss + checkpointing", "engine", 1, 1, True),
    Row(3, "engine, SP 2 (2 ranks), plain", "engine", 2, 2, False),
    Row(4, "engine, SP 2 (2 ranks), tiled MLP + tiled loss + checkpointing", "engine", 2, 2, True),
    Row(5, "DeepSpeed 0.19.8 ALST, SP 2 (2 ranks), the same tricks", "deepspeed", 2, 2, True),
    Row(6, "FSDP2, 2 ranks, no SP (a whole sequence per rank), plain", "fsdp2", 2, 1, False),
]


@dataclass
class Attempt:
    row: int
    seq: int
    steps: int
    ok: bool = False
    reason: str = ""  # why it failed: "memory: ...", "time", an error line
    seconds: float = 0.0
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def peak_rss(self) -> int:
        """The largest rank's peak RSS, bytes."""
        return max((r["max_rss"] for r in self.ranks), default=0)

    @property
    def ready_rss(self) -> int:
        """The largest rank's RSS before the first step (model, states, the system set up), bytes."""
        return max((r["rss_ready"] for r in self.ranks), default=0)

    def step_s(self) -> list[float]:
        """Each step's seconds, slowest rank."""
        return [max(r["times"][i] for r in self.ranks) for i in range(self.steps)] if self.ranks else []


# ------------------------------------------------------------------------------------------ one attempt
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_args(row: Row, seq: int, steps: int, args: argparse.Namespace, out: str) -> list[str]:
    cmd = [WORKER, "--system", row.system, "--sp", str(row.sp), "--seq", str(seq), "--steps", str(steps)]
    cmd += ["--cap-gib", str(args.cap_gib), "--stage", str(args.stage), "--dtype", args.dtype, "--out", out]
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "loss_tile"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return cmd + (["--tricks"] if row.tricks else [])


def command(row: Row, seq: int, steps: int, args: argparse.Namespace, out: str) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line and environment of one attempt."""
    cores = len(os.sched_getaffinity(0))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // row.ranks)), PYTHONUNBUFFERED="1")
    env.update(MALLOC_MMAP_THRESHOLD_=str(1 << 20), DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    port = str(free_port())
    if row.system == "deepspeed":
        python = args.deepspeed_python or sys.executable
        if args.deepspeed_path:
            env["PYTHONPATH"] = os.pathsep.join([args.deepspeed_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        launcher = [python, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1"]
    else:
        launcher = [sys.executable, "-m", "launcher.zrun"]
    launcher += ["--nproc_per_node", str(row.ranks), "--master_port", port]
    return launcher + worker_args(row, seq, steps, args, out), env


def failure_reason(log: str, code: int | None) -> str:
    lines = log.splitlines()
    marked = [line.split(FAIL, 1)[1].strip() for line in lines if FAIL in line]
    text = marked[0] if marked else next((x.strip() for x in reversed(lines) if "Error" in x), f"exit status {code}")
    kind = "memory" if any(word in text for word in MEMORY_WORDS) else "error"
    return f"{kind}: {text[:240]}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher (zrun and torch.distributed.run both end their ranks on it), SIGKILL its group
    after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def attempt(row: Row, seq: int, steps: int, args: argparse.Namespace) -> Attempt:
    result = Attempt(row.number, seq, steps)
    with tempfile.TemporaryDirectory(prefix=f"long_context_{row.number}_") as out:
        cmd, env = command(row, seq, steps, args, out)
        log_path = os.path.join(out, "log.txt")
        t0 = time.perf_counter()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                proc.wait(timeout=args.attempt_timeout)
            except subprocess.TimeoutExpired:
                stop(proc)
                result.reason = f"time: over --attempt-timeout {args.attempt_timeout:.0f} s"
        result.seconds = time.perf_counter() - t0
        files = [os.path.join(out, f"rank{r}.json") for r in range(row.ranks)]
        if not result.reason and proc.returncode == 0 and all(os.path.exists(p) for p in files):
            result.ok = True
            for path in files:
                with open(path) as f:
                    result.ranks.append(json.load(f))
        elif not result.reason:
            with open(log_path, errors="replace") as f:
                log_text = f.read()
            result.reason = failure_reason(log_text, proc.returncode)
            if args.keep_logs:
                kept = os.path.join(args.keep_logs, f"row{row.number}_{seq}.log")
                os.makedirs(args.keep_logs, exist_ok=True)
                with open(kept, "w") as f:
                    f.write(log_text)
    peak = f", peak RSS {result.peak_rss / GIB:.2f} GiB/rank, steps {result.step_s()}" if result.ok else ""
    status = "fits" if result.ok else f"FAILED ({result.reason[:160]})"
    print(f"[long_context] row {row.number} seq {seq}: {status} in {result.seconds:.0f} s{peak}", flush=True)
    return result


# ------------------------------------------------------------------------------------------ the search
def round_to(value: float, quantum: int) -> int:
    return max(quantum, round(value / quantum) * quantum)


def search(row: Row, args: argparse.Namespace) -> dict[str, Any]:
    """Doubling (or halving, when --start fails) up to --max-seq, then bisection; a failure that is not the
    cap's (an error, the time limit) stops it."""
    tried: list[Attempt] = []

    def fits(seq: int) -> bool:
        tried.append(attempt(row, seq, 2, args))
        return tried[-1].ok

    fit: int | None = None
    fail: int | None = None
    seq = args.start
    if fits(seq):
        fit = seq
        while fit < args.max_seq:  # doubling; the last step goes to --max-seq itself when doubling passes it
            longer = min(fit * 2, args.max_seq)
            if not fits(longer):
                fail = longer
                break
            fit = longer
    else:
        fail = seq
        while fail // 2 >= args.min_seq and tried[-1].reason.startswith("memory"):
            if fits(fail // 2):
                fit = fail // 2
                break
            fail //= 2
    for _ in range(args.bisect if fit is not None and fail is not None else 0):
        if not tried[-1].ok and not tried[-1].reason.startswith("memory"):
            break  # an error, not the cap: bisecting would not measure memory
        mid = round_to((fit + fail) / 2, args.quantum)  # type: ignore[operator]
        if mid <= fit or mid >= fail:  # type: ignore[operator]
            break
        if fits(mid):
            fit = mid
        else:
            fail = mid
    failed = next((a for a in tried if a.seq == fail and not a.ok), None)
    return {
        "row": row.number,
        "longest_fit": fit,
        "first_fail": fail,
        "fail_reason": failed.reason if failed else "",
        "ceiling": fail is None and fit is not None,
        "attempts": tried,
    }


def best(result: dict[str, Any]) -> Attempt | None:
    """The attempt at the row's longest fit."""
    return next((a for a in result["attempts"] if a.ok and a.seq == result["longest_fit"]), None)


def growth_per_1k(result: dict[str, Any]) -> float | None:
    """Peak RSS growth of the largest rank per 1024 more tokens (whole sequence), between the row's two
    longest fits: what each token costs above the fixed part."""
    fits = sorted((a for a in result["attempts"] if a.ok), key=lambda a: a.seq)
    if len(fits) < 2:
        return None
    a, b = fits[-2], fits[-1]
    return (b.peak_rss - a.peak_rss) / (b.seq - a.seq) * 1024


# ------------------------------------------------------------------------------------------ tokens/s
def timed(row: Row, seq: int, args: argparse.Namespace) -> dict[str, Any]:
    a = attempt(row, seq, 1 + args.timed_steps, args)
    out: dict[str, Any] = {"row": row.number, "seq": seq, "ok": a.ok, "reason": a.reason, "attempt": a}
    if a.ok:
        step = statistics.median(a.step_s()[1:])
        tokens = seq * (row.ranks if row.system == "fsdp2" else 1)
        out.update(step_s=step, tokens_per_step=tokens, tokens_per_s=tokens / step, peak_rss=a.peak_rss)
    return out


def deepspeed_status(args: argparse.Namespace) -> str:
    """Empty when DeepSpeed's row can run; else why not. A 2-rank smoke run without a cap (it also builds
    DeepSpeed's CPU communication op once, outside the capped attempts)."""
    if not (args.deepspeed_python or args.deepspeed_path):
        return "DeepSpeed not given: set DEEPSPEED_PYTHON or pass --deepspeed-python / --deepspeed-path"
    smoke = argparse.Namespace(**{**vars(args), "cap_gib": 0.0})
    a = attempt(ROWS[4], args.quantum, 1, smoke)
    if not a.ok:
        return f"DeepSpeed failed to train a {args.quantum}-token smoke run without a cap: {a.reason}"
    versions = a.ranks[0]["versions"]
    if versions.get("deepspeed_is_compat") != "False":
        return "the given interpreter imports this repository's compat/deepspeed, not DeepSpeed"
    args.deepspeed_versions = versions
    return ""


# ------------------------------------------------------------------------------------------ the goals
def ratio_goal(text: str, a: dict[str, Any] | None, b: dict[str, Any] | None, k: float) -> dict[str, Any]:
    """Whether row a's longest fit is >= k x row b's, read from the searches: the measured ratio, and whether
    the answer survives the resolution (a's true limit is >= its longest fit, b's is below its first failure)."""
    goal: dict[str, Any] = {"goal": text, "met": None}
    if a is None or b is None:
        return goal | {"verdict": "not measured (row not run)"}
    fa, fb = a["longest_fit"], b["longest_fit"]
    if fa is None or fb is None:
        none = [r["row"] for r in (a, b) if r["longest_fit"] is None]
        return goal | {"verdict": f"undetermined: row(s) {none} fitted no length tried"}
    ratio = fa / fb
    goal.update(ratio=ratio, met=ratio >= k)
    bound = "≥ " if a["ceiling"] else ""
    measured = f"{fa:,} / {fb:,} = {bound}{ratio:.2f}x (goal {k:g}x)"
    if k == 1 and a["ceiling"] and b["ceiling"]:
        goal["met"] = None
        return goal | {"verdict": f"not discriminated: both trained --max-seq ({fa:,}); {measured}"}
    if b["first_fail"] is not None and fa >= k * b["first_fail"]:
        return goal | {"verdict": f"met, {measured}; also in the worst case of the resolution"}
    if a["first_fail"] is not None and a["first_fail"] <= k * fb:
        return goal | {"verdict": f"not met, {measured}; also in the best case of the resolution"}
    if a["ceiling"] and not goal["met"]:
        goal["met"] = None
        return goal | {"verdict": f"undetermined: row {a['row']} trained --max-seq, {measured}"}
    word = "met" if goal["met"] else "not met"
    return goal | {"verdict": f"{word} by the longest fits, {measured}; within the resolution it could go either way"}


def speed_goal(speeds: dict[int, dict[str, Any]]) -> dict[str, Any]:
    goal: dict[str, Any] = {"goal": "tokens/s at the common length: row 4 >= row 5 (DeepSpeed)", "met": None}
    a, b = speeds.get(4), speeds.get(5)
    if not (a and b and a["ok"] and b["ok"]):
        return goal | {"verdict": "not measured (row 4 or 5 did not run at the common length)"}
    ratio = a["tokens_per_s"] / b["tokens_per_s"]
    goal.update(ratio=ratio, met=ratio >= 1)
    verdict = f"{'met' if ratio >= 1 else 'not met'}: {a['tokens_per_s']:.0f} vs {b['tokens_per_s']:.0f} tokens/s"
    return goal | {"verdict": f"{verdict} ({ratio:.2f}x) at {a['seq']:,} tokens"}


def long_speed_goal(results: dict[int, dict[str, Any]], shortest: int = 4096) -> dict[str, Any]:
    """Row 4's tokens/s against row 5's at every length >= `shortest` both trained in the search (each attempt's
    second step: one sample per length)."""
    goal: dict[str, Any] = {"goal": f"(also) tokens/s, row 4 vs row 5, every length >= {shortest:,} both trained"}
    if 4 not in results or 5 not in results:
        return goal | {"met": None, "verdict": "not measured"}
    done = [{a.seq: a for a in results[n]["attempts"] if a.ok} for n in (4, 5)]
    lengths = sorted(seq for seq in set(done[0]) & set(done[1]) if seq >= shortest)
    if not lengths:
        return goal | {"met": None, "verdict": "not measured"}
    ratios = {seq: done[1][seq].step_s()[-1] / done[0][seq].step_s()[-1] for seq in lengths}  # row 4 over row 5
    faster = sum(r >= 1 for r in ratios.values())
    met = True if faster == len(lengths) else False if faster == 0 else None
    each = ", ".join(f"{seq:,}: {r:.2f}x" for seq, r in ratios.items())
    word = {True: "met", False: "not met", None: "mixed"}[met]
    verdict = f"{word}: the engine is faster at {faster} of {len(lengths)} lengths (engine / DeepSpeed: {each})"
    return goal | {"met": met, "ratios": ratios, "verdict": verdict + "; one step per length"}


def goals(results: dict[int, dict[str, Any]], speeds: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    r = results.get
    return [
        ratio_goal("row 4 (engine SP 2 + tricks) >= 1.9x row 2 (engine, 1 rank + tricks)", r(4), r(2), 1.9),
        ratio_goal("row 4 >= 8x row 1 (engine, 1 rank, plain)", r(4), r(1), 8),
        ratio_goal("row 4 >= row 5 (DeepSpeed ALST, SP 2)", r(4), r(5), 1),
        speed_goal(speeds),
        long_speed_goal(results),
    ]


# ------------------------------------------------------------------------------------------ the report
def gib(x: float | None) -> str:
    return "-" if not x else f"{x / GIB:.2f}"


def shown_command() -> str:
    """This run's command line, folders of this machine (DeepSpeed's location, --keep-logs) shown as DIR."""
    out, hide = [], False
    for word in sys.argv[1:]:
        name = word.split("=", 1)[0]
        if hide:
            out.append("DIR")
        elif name in HIDDEN and "=" in word:
            out.append(f"{name}=DIR")
        else:
            out.append(word)
        hide = word in HIDDEN
    return " ".join(["benchmarks/bench_long_context.py", *out])


def setup_lines(args: argparse.Namespace) -> list[str]:
    heads = f"{args.heads} heads of {args.hidden // args.heads}, {args.kv_heads} key/value heads"
    return [
        f"Generated by `{shown_command()}`.",
        "",
        (
            f"Model: transformers' LlamaConfig, {args.layers} layers, hidden {args.hidden}, intermediate "
            f"{args.intermediate}, {heads}, vocabulary {args.vocab} (untied head), sdpa attention; micro batch 1, "
            f"AdamW, {args.dtype}{' (this CPU has avx512_bf16 / AMX)' if args.dtype == 'bf16' else ''}, ZeRO stage "
            f"{args.stage} on every engine and DeepSpeed row. Tricks: TiledMLP (tiles of {args.hidden} tokens), "
            f"TiledFusedLogitsLoss (tiles of {args.loss_tile} tokens, from the hidden states) and activation "
            "checkpointing of every decoder layer (transformers', non-reentrant)."
        ),
        "",
        (
            f"Cap: RLIMIT_DATA = {args.cap_gib:g} GiB in every rank, set before torch is imported (anonymous mmaps "
            "count: every tensor). An attempt fits when 2 training steps complete. Search: doubling from "
            f"{args.start:,} tokens (halving when that fails, down to {args.min_seq:,}) up to --max-seq "
            f"{args.max_seq:,}, then {args.bisect} bisection step(s) at multiples of {args.quantum} tokens. "
            "Every attempt is a fresh process group (`python -m launcher.zrun`; DeepSpeed: `python -m "
            "torch.distributed.run`), OMP_NUM_THREADS = cores // ranks, MALLOC_MMAP_THRESHOLD_ = 1 MiB."
        ),
        "",
    ]


def fits_table(results: dict[int, dict[str, Any]], skipped: dict[int, str]) -> list[str]:
    lines = [
        (
            "| # | system | longest that trained (tokens) | first that failed | resolution | peak RSS / rank at the "
            "longest (GiB) | RSS / rank before step 1 (GiB) | RSS growth per 1K tokens (MiB) | attempts (wall s) |"
        ),
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in ROWS:
        if row.number in skipped:
            lines.append(f"| {row.number} | {row.label} | skipped: {skipped[row.number]} | | | | | | |")
            continue
        if row.number not in results:
            continue
        r = results[row.number]
        a = best(r)
        fit = f"{r['longest_fit']:,}" if r["longest_fit"] else f"none (< {r['first_fail']:,})"
        fail = "none up to --max-seq" if r["first_fail"] is None else f"{r['first_fail']:,}"
        if r["fail_reason"]:
            fail += f" ({r['fail_reason'].split(':', 1)[0]})"
        resolution = (
            "-" if r["first_fail"] is None or r["longest_fit"] is None else f"{r['first_fail'] - r['longest_fit']:,}"
        )
        growth = growth_per_1k(r)
        tries = ", ".join(f"{x.seq:,}{'' if x.ok else ' x'} ({x.seconds:.0f})" for x in r["attempts"])
        lines.append(
            f"| {row.number} | {row.label} | {'≥ ' if r['ceiling'] else ''}{fit} | {fail} | {resolution} "
            f"| {gib(a.peak_rss if a else 0)} | {gib(a.ready_rss if a else 0)} "
            f"| {'-' if growth is None else f'{growth / 2**20:.1f}'} | {tries} |"
        )
    return lines


def speed_table(speeds: dict[int, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    if not speeds:
        return ["No tokens/s: no length every row fits."]
    seq = next(iter(speeds.values()))["seq"]
    lines = [
        (
            f"Tokens/s at {seq:,} tokens (every row fits it): {args.timed_steps} timed step(s) after a warm-up step, "
            "the slowest rank per step, the median step."
        ),
        "",
        "| # | system | ranks x threads | tokens / step | step (s) | tokens/s | peak RSS / rank (GiB) |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    cores = len(os.sched_getaffinity(0))
    for row in ROWS:
        s = speeds.get(row.number)
        if s is None:
            continue
        who = f"{row.ranks} x {max(1, cores // row.ranks)}"
        if not s["ok"]:
            lines.append(f"| {row.number} | {row.label} | {who} | failed: {s['reason'][:120]} | | | |")
            continue
        lines.append(
            f"| {row.number} | {row.label} | {who} | {s['tokens_per_step']:,} | {s['step_s']:.2f} "
            f"| {s['tokens_per_s']:.0f} | {gib(s['peak_rss'])} |"
        )
    return lines


def longest_common(results: dict[int, dict[str, Any]]) -> tuple[int, list[Attempt]] | None:
    """The longest length rows 4 and 5 both trained in the search, and those two attempts."""
    if 4 not in results or 5 not in results:
        return None
    done = [{a.seq: a for a in results[n]["attempts"] if a.ok} for n in (4, 5)]
    common = max(set(done[0]) & set(done[1]), default=None)
    return None if common is None else (common, [done[0][common], done[1][common]])


def step_table(results: dict[int, dict[str, Any]]) -> list[str]:
    """Every search attempt's second step (after its first): seconds per length and row."""
    rows = [r for r in ROWS if r.number in results]
    by_row = {r.number: {a.seq: a for a in results[r.number]["attempts"]} for r in rows}
    lengths = sorted({seq for tried in by_row.values() for seq in tried})
    lines = [
        (
            "Step time (s) of every search attempt's second step (one step after its first, the slowest rank; a "
            "single sample each, so noisier than the tokens/s table; x: did not fit), and its tokens/s:"
        ),
        "",
        "| tokens | " + " | ".join(f"row {r.number}" for r in rows) + " |",
        "| ---: | " + " | ".join("---:" for _ in rows) + " |",
    ]
    for seq in lengths:
        cells = []
        for r in rows:
            a = by_row[r.number].get(seq)
            tokens = seq * (r.ranks if r.system == "fsdp2" else 1)
            cells.append(
                "" if a is None else "x" if not a.ok else f"{a.step_s()[-1]:.2f} ({tokens / a.step_s()[-1]:.0f}/s)"
            )
        lines.append(f"| {seq:,} | " + " | ".join(cells) + " |")
    return lines


def notes(results: dict[int, dict[str, Any]], args: argparse.Namespace, plotted: bool) -> list[str]:
    ds = getattr(args, "deepspeed_versions", None)
    lines = [
        "Notes:",
        "",
        (
            "- The cap is small because the model is: the fixed part of a rank (interpreter, torch, transformers, "
            "the model states, the system's buffers; 'RSS before step 1' plus the optimizer state and gradients "
            "the first step adds) takes most of it, so what separates the rows is what each token costs above it "
            "(the growth column, measured between a row's two longest fits; RLIMIT_DATA counts a little more "
            "than RSS: writable mappings not yet touched)."
        ),
        (
            "- Row 6, FSDP2: fully_shard shards parameters, gradients and optimizer state over the 2 ranks, but "
            "without sequence parallelism each rank trains a whole sequence of its own (data parallelism) and "
            "holds every activation of it: its limit is one rank's whole-sequence activations, as row 1's, with "
            "smaller model states. Its tokens/s counts both ranks' sequences."
        ),
        (
            "- Rows 3-5 split one sequence over 2 ranks: every rank holds half the tokens' activations; attention "
            "trades the sequence split for a split of the heads (all-to-all) and sees the whole sequence."
        ),
    ]
    if ds:
        lines.append(
            f"- Row 5 ran DeepSpeed {ds.get('deepspeed')} with torch {ds.get('torch')} and transformers "
            f"{ds.get('transformers')} (the engine rows: this venv's). DeepSpeed's TiledFusedLogitsLoss "
            "backpropagates during the forward, the engine's recomputes each tile in the backward (a deliberate "
            "difference, engine/sequence/tiled.py): one more lm_head and cross-entropy forward per token, which "
            "shows in the step times of long sequences. On CPU DeepSpeed also sets up its shared-memory "
            "communication op (its default). Both get reduce/allgather buckets of 2M elements: DeepSpeed's "
            "default (5e8 elements, a 1 GB bf16 buffer at stage 2) alone is more than the cap."
        )
    ceiling = [str(n) for n, r in sorted(results.items()) if r["ceiling"]]
    if ceiling:
        lines.append(
            f"- Row(s) {', '.join(ceiling)} trained --max-seq ({args.max_seq:,}) without failing: a lower bound, "
            "kept so for the run's time (a step of a sequence twice as long takes about 2.5x as long here)."
        )
    found = longest_common(results)
    if found:
        seq, (a, b) = found
        lines.append(
            f"- Rows 4 and 5 at {seq:,} tokens, the longest both trained: peak RSS / rank {gib(a.peak_rss)} GiB "
            f"(engine) and {gib(b.peak_rss)} GiB (DeepSpeed)."
        )
    near = [str(n) for n, r in sorted(results.items()) if best(r) and best(r).peak_rss > (args.cap_gib - 0.05) * GIB]
    if near:
        lines.append(
            f"- Row(s) {', '.join(near)}: the longest fit peaked within 0.05 GiB of the cap (RLIMIT_DATA counts a "
            "little more than RSS): a length this close to the limit can fit in one run and fail in another."
        )
    if plotted:
        lines.append(
            f"- The plot, {args.name}.png: the longest fits, tokens/s at the common length, and tokens/s by length "
            "of rows 2, 4 and 5 from the search attempts' second steps."
        )
    else:
        lines.append("- No plot: matplotlib is not installed in this interpreter (table only).")
    return lines


def write_report(
    results: dict[int, dict[str, Any]],
    speeds: dict[int, dict[str, Any]],
    skipped: dict[int, str],
    args: argparse.Namespace,
    machine: list[str],
    plotted: bool,
) -> str:
    title = f"# How long a sequence fits: Ulysses SP and ALST's tiles, {args.cap_gib:g} GiB per rank"
    lines = [title, "", *setup_lines(args), *fits_table(results, skipped), "", *step_table(results), ""]
    lines += [*speed_table(speeds, args), "", "Goals:", ""]
    lines += [f"- {g['goal']}: {g['verdict']}" for g in goals(results, speeds)]
    lines += ["", "Failures (each row's first failing length and its rank's error):", ""]
    failed = [
        f"- row {n} at {r['first_fail']:,}: {r['fail_reason']}" for n, r in sorted(results.items()) if r["fail_reason"]
    ]
    lines += failed or ["- none"]
    lines += ["", *notes(results, args, plotted), "", "Machine:"]
    lines += machine
    return "\n".join(lines) + "\n"


def plot(results: dict[int, dict[str, Any]], speeds: dict[int, dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in ROWS if r.number in results and results[r.number]["longest_fit"]]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    fits = [results[r.number]["longest_fit"] for r in rows]
    a.barh([f"row {r.number}" for r in rows], fits)
    for i, r in enumerate(rows):
        mark = "≥ " if results[r.number]["ceiling"] else ""
        a.text(fits[i], i, f" {mark}{fits[i]:,}", va="center")
    a.set_xscale("log", base=2)
    a.set_xlim(right=max(fits) * 8)
    a.set_xlabel("longest sequence that trained (tokens; ≥: the search's last length)")
    a.set_title("longest sequence under the cap")
    done = [r for r in ROWS if r.number in speeds and speeds[r.number]["ok"]]
    b.barh([f"row {r.number}" for r in done], [speeds[r.number]["tokens_per_s"] for r in done])
    seq = next(iter(speeds.values()))["seq"] if speeds else 0
    b.set_xlabel("tokens/s")
    b.set_title(f"tokens/s at {seq:,} tokens")
    for n in (2, 4, 5):
        ok = sorted((a_.seq, a_.step_s()[-1]) for a_ in results.get(n, {"attempts": []})["attempts"] if a_.ok)
        if ok:
            c.plot([x for x, _ in ok], [x / t for x, t in ok], marker="o", label=f"row {n}")
    c.set_xscale("log", base=2)
    c.set_xlabel("tokens")
    c.set_ylabel("tokens/s")
    c.set_title("tokens/s of the search attempts' second step")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def as_json(value: Any) -> Any:
    if isinstance(value, Attempt):
        return asdict(value) | {"peak_rss": value.peak_rss, "step_s": value.step_s()}
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------ main
def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-gib", type=float, default=0.95, help="RLIMIT_DATA of every rank, GiB")
    p.add_argument("--rows", default="1,2,3,4,5,6", help="which rows, by number")
    p.add_argument("--start", type=int, default=1024, help="the search's first length")
    p.add_argument("--min-seq", type=int, default=256, help="halving stops here")
    p.add_argument("--max-seq", type=int, default=49152, help="the search's last length (a row fitting it: '>=')")
    p.add_argument("--bisect", type=int, default=1, help="bisection steps after the doubling")
    p.add_argument("--quantum", type=int, default=256, help="bisection lengths are multiples of this")
    p.add_argument("--timed-steps", type=int, default=3, help="tokens/s: timed steps after one warm-up step")
    p.add_argument("--common-seq", type=int, default=0, help="tokens/s length (0: the shortest longest fit)")
    p.add_argument("--attempt-timeout", type=float, default=600.0, help="seconds before an attempt is ended")
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage of the engine and DeepSpeed rows")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 with avx512_bf16/AMX")
    for name, default in (("layers", 2), ("hidden", 256), ("intermediate", 688), ("heads", 4), ("kv-heads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--loss-tile", type=int, default=512, help="tokens per tile of the tiled logits loss")
    p.add_argument(
        "--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON", ""), help="default: $DEEPSPEED_PYTHON"
    )
    p.add_argument("--deepspeed-path", default="", help="a folder holding deepspeed, put first on PYTHONPATH")
    p.add_argument("--keep-logs", default="", help="a folder for the logs of failed attempts")
    p.add_argument("--name", default="long_context", help="results file name under benchmarks/results/")
    args = p.parse_args()
    if args.dtype == "auto":
        args.dtype = "bf16" if cpu_has_bf16() else "fp32"
    return args


def main() -> None:
    args = parse()
    load_before = os.getloadavg()
    chosen = [r for r in ROWS if str(r.number) in args.rows.split(",")]
    skipped: dict[int, str] = {}
    if any(r.system == "deepspeed" for r in chosen):
        why = deepspeed_status(args)
        if why:
            skipped[5] = why
            print(f"[long_context] row 5 skipped: {why}", flush=True)
    t0 = time.perf_counter()
    results = {r.number: search(r, args) for r in chosen if r.number not in skipped}
    fits = [r["longest_fit"] for r in results.values() if r["longest_fit"]]
    common = args.common_seq or (min(fits) if fits else 0)
    speeds = {r.number: timed(r, common, args) for r in chosen if r.number in results and common}
    print(f"[long_context] done in {time.perf_counter() - t0:.0f} s", flush=True)
    base = os.path.join(ROOT, "benchmarks", "results", args.name)
    plotted = plot(results, speeds, base + ".png")
    machine = machine_facts(ROOT, load_before, 2)
    report = write_report(results, speeds, skipped, args, machine, plotted)
    with open(base + ".md", "w") as f:
        f.write(report)
    config = {k: v for k, v in vars(args).items() if k not in ("deepspeed_python", "deepspeed_path", "keep_logs")}
    data = {
        "command": shown_command(),
        "config": config,
        "rows": [asdict(r) for r in ROWS],
        "skipped": skipped,
        "search": results,
        "tokens_per_s": speeds,
        "goals": goals(results, speeds),
        "wall_s": time.perf_counter() - t0,
        "machine": machine,
    }
    with open(base + ".json", "w") as f:
        json.dump(as_json(data), f, indent=1)
    print(report + ("" if plotted else "(matplotlib missing: no plot)"))


if __name__ == "__main__":
    main()
