"""The same Hugging Face Trainer script and DeepSpeed config on the engine (through the `deepspeed`
compatibility package) and on the real DeepSpeed: step time, peak RSS per rank and the loss curve.

    python benchmarks/bench_hf.py [--stages 1,2,3] [--precisions fp32,bf16] [--repeats 2] [--steps 30] [--warmup 3]
                                  [--deepspeed_python PYTHON]

Every run is examples/hf_trainer.py at 2 ranks (gloo, CPU, OMP_NUM_THREADS=1) from the same saved initial
model (`--save_init_to` once, then `--init_from` in every run; a stage-3 run loads it partitioned), with
the configs HF users write (configs/hf/zero2.json, zero3.json: optimizer, schedule and batch sizes "auto").
Engine: this interpreter, `python -m launcher.zrun`, compat/deepspeed pip-installed into a temporary folder
on PYTHONPATH (as tests/hf_clients.py does; this environment is untouched). DeepSpeed: torchrun from
--deepspeed_python's environment with DS_ACCELERATOR=cpu and no PYTHONPATH, so `import deepspeed` there is
the real one; it defaults to $DEEPSPEED_PYTHON, the interpreter of a venv with the real DeepSpeed, since
where such a venv lives is the machine's business, not the repository's. When no interpreter is given, or
it is missing or cannot import deepspeed, only the engine is measured and the report says so.

Step time: rank 0's wall time from one optimizer step's end to the next (a Trainer callback, the
example's --metrics_file), median over the steps after --warmup; peak RSS: ru_maxrss of each rank at exit
(model load, training, evaluation and save). Each configuration runs --repeats times, engine and
DeepSpeed interleaved (the order alternating per repeat) so both see the same machine noise; the table
shows the median over repeats. Results: benchmarks/results/hf.md and hf.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import in_repo, machine_facts

from launcher.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer.py")
COMPAT = os.path.join(ROOT, "compat", "deepspeed")
DS_PYTHON_ENV = "DEEPSPEED_PYTHON"
SYSTEMS = ("engine", "deepspeed")
PRECISIONS = ("fp32", "bf16")
WORLD = 2
COLORS = {"engine": "#4c72b0", "deepspeed": "#55a868"}
NAMES = {"engine": "engine", "deepspeed": "DeepSpeed"}
DIFF_FLOOR = 1e-9  # loss differences below this (0 included) are drawn at it on the log axis


@dataclass(frozen=True)
class Case:
    stage: int
    precision: str  # "fp32" or "bf16"
    system: str  # "engine" or "deepspeed"

    def label(self) -> str:
        return f"stage {self.stage} {self.precision} {'engine' if self.system == 'engine' else 'DeepSpeed'}"


@dataclass
class Run:
    """One launch of the example: what its report and metrics files held, or why it failed."""

    step_times: list[float] = field(default_factory=list)  # s, rank 0, every optimizer step
    peak_rss: list[float] = field(default_factory=list)  # MiB, one per rank
    losses: list[float] = field(default_factory=list)  # logged training loss per step
    eval_loss: float | None = None
    wall_s: float = 0.0  # the whole launch: start-up, load, training, evaluation, save
    error: str = ""


# ---------------------------------------------------------------------------------------------- setup
def install_compat(target: str) -> None:
    """compat/deepspeed as a real distribution named deepspeed, into `target` only."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        target,
        COMPAT,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pip could not install {COMPAT}:\n{done.stdout}\n{done.stderr}")


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def engine_env(compat_dir: str) -> dict[str, str]:
    return {**base_env(), "PYTHONPATH": os.pathsep.join([compat_dir, ROOT])}


def deepspeed_env() -> dict[str, str]:
    return {**base_env(), "DS_ACCELERATOR": "cpu"}  # CPU tensors and gloo; never the compat package


VERSIONS = (
    "import deepspeed, transformers, accelerate, torch; "
    "print(deepspeed.__version__, transformers.__version__, accelerate.__version__, torch.__version__)"
)


def versions(python: str, env: dict[str, str]) -> tuple[list[str], str]:
    """([deepspeed, transformers, accelerate, torch] versions as `python` imports them under `env`, "")
    or ([], why not)."""
    if not os.path.exists(python):
        return [], f"{python} does not exist"
    try:
        done = subprocess.run(
            [python, "-c", VERSIONS],
            env=env,
            cwd=tempfile.gettempdir(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return [], f"{python} could not be run ({type(exc).__name__}: {exc})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [], f"`import deepspeed, transformers, accelerate` failed in {python} ({last})"
    return done.stdout.split()[:4], ""


def write_configs(tmp: str) -> dict[int, str]:
    """Stage -> config path. Stage 2 is configs/hf/zero2.json as it is; stage 1 the same with stage 1.
    Stage 3 is configs/hf/zero3.json without "train_batch_size", for both systems: with it, the real
    DeepSpeed stops in transformers' zero.Init under --use_cpu (Accelerate has initialised
    torch.distributed but not deepspeed.comm yet, so DeepSpeedConfig counts world size 1 and asserts
    train_batch_size 16 != 8 * 1 * 1); DeepSpeed derives the same 16 from the micro batch without it."""
    with open(os.path.join(ROOT, "configs", "hf", "zero2.json")) as f:
        zero2 = json.load(f)
    with open(os.path.join(ROOT, "configs", "hf", "zero3.json")) as f:
        zero3 = json.load(f)
    zero1 = json.loads(json.dumps(zero2))
    zero1["zero_optimization"]["stage"] = 1
    del zero3["train_batch_size"]
    paths = {}
    for stage, conf in ((1, zero1), (3, zero3)):
        paths[stage] = os.path.join(tmp, f"zero{stage}.json")
        with open(paths[stage], "w") as f:
            json.dump(conf, f, indent=2)
    paths[2] = os.path.join(ROOT, "configs", "hf", "zero2.json")
    return paths


def model_args(args: argparse.Namespace) -> list[str]:
    return [
        "--n_layer",
        str(args.n_layer),
        "--n_embd",
        str(args.n_embd),
        "--n_head",
        str(args.n_head),
        "--seq_len",
        str(args.seq_len),
        "--dropout",
        "0",
        "--seed",
        str(args.seed),
    ]


def save_init(args: argparse.Namespace, tmp: str, compat_dir: str) -> str:
    """The initial weights every run loads: built once, one process, no --deepspeed."""
    init = os.path.join(tmp, "init")
    cmd = [
        sys.executable,
        EXAMPLE,
        "--output_dir",
        os.path.join(tmp, "init_out"),
        "--save_init_to",
        init,
        *model_args(args),
    ]
    done = subprocess.run(
        cmd, cwd=ROOT, env=engine_env(compat_dir), capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"saving the initial model failed:\n{done.stderr[-4000:]}")
    return init


# ---------------------------------------------------------------------------------------------- one run
def run_case(
    case: Case, rep: int, args: argparse.Namespace, tmp: str, init: str, configs: dict[int, str], compat_dir: str
) -> Run:
    tag = f"s{case.stage}_{case.precision}_{case.system}_{rep}"
    report, metrics = os.path.join(tmp, f"{tag}.report.json"), os.path.join(tmp, f"{tag}.metrics")
    script_args = [
        "--output_dir",
        os.path.join(tmp, f"{tag}.out"),
        "--init_from",
        init,
        *model_args(args),
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        str(args.batch),
        "--max_steps",
        str(args.steps),
        "--deepspeed",
        configs[case.stage],
        "--report_file",
        report,
        "--metrics_file",
        metrics,
    ]
    if case.precision == "bf16":
        script_args += ["--bf16", "true"]
    port = str(free_port())
    if case.system == "engine":
        cmd = [
            sys.executable,
            "-m",
            "launcher.zrun",
            "--nproc_per_node",
            str(WORLD),
            "--master_port",
            port,
            EXAMPLE,
            *script_args,
        ]
        env = engine_env(compat_dir)
    else:
        cmd = [
            args.deepspeed_python,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(WORLD),
            "--master_port",
            port,
            EXAMPLE,
            *script_args,
        ]
        env = deepspeed_env()
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return Run(wall_s=time.perf_counter() - t0, error=f"timed out after {args.timeout:.0f} s")
    run = Run(wall_s=time.perf_counter() - t0)
    if done.returncode != 0:
        with open(os.path.join(tmp, f"{tag}.log"), "w") as f:
            f.write(done.stdout + done.stderr)
        run.error = _first_error(done.stdout + done.stderr, done.returncode)
        print(f"{case.label()} failed:\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
        return run
    with open(report) as f:
        history = json.load(f)["log_history"]
    run.losses = [h["loss"] for h in history if "loss" in h]
    run.eval_loss = next((h["eval_loss"] for h in reversed(history) if "eval_loss" in h), None)
    ranks = []
    for r in range(WORLD):
        with open(f"{metrics}.rank{r}.json") as f:
            ranks.append(json.load(f))
    run.step_times = ranks[0]["step_times"]
    run.peak_rss = [m["peak_rss_mib"] for m in ranks]
    return run


def _first_error(output: str, code: int) -> str:
    """The exception line a rank printed (the last 'Error:' line), else the exit status."""
    lines = [ln.strip() for ln in output.splitlines() if "Error:" in ln or "Error(" in ln]
    return (lines[-1][:240] if lines else f"exit status {code}").replace("|", "/")


# ---------------------------------------------------------------------------------------------- summary
def timed_median(run: Run, warmup: int) -> float:
    return statistics.median(run.step_times[warmup:])


@dataclass
class Summary:
    """One (stage, precision, system) over its repeats."""

    medians: list[float]  # per successful repeat, s
    step_s: float | None  # median of `medians`
    peak_rss: float | None  # MiB: the most over ranks, median over repeats
    losses: list[float]  # the first successful repeat's curve
    eval_loss: float | None
    repeat_spread: float  # max |loss difference| between repeats (0: deterministic)
    errors: list[str]


def summarise(runs: list[Run], warmup: int) -> Summary:
    ok = [r for r in runs if not r.error and len(r.step_times) > warmup]
    medians = [timed_median(r, warmup) for r in ok]
    spread = max((max_abs_diff(ok[0].losses, r.losses) for r in ok[1:]), default=0.0)
    return Summary(
        medians,
        statistics.median(medians) if medians else None,
        statistics.median(max(r.peak_rss) for r in ok) if ok else None,
        ok[0].losses if ok else [],
        ok[0].eval_loss if ok else None,
        spread,
        [r.error for r in runs if r.error],
    )


def max_abs_diff(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    return max((abs(x - y) for x, y in zip(a[:n], b[:n])), default=float("nan"))


# ---------------------------------------------------------------------------------------------- report
def write_report(args: argparse.Namespace, results: dict[Case, Summary], notes: list[str], ds_version: str) -> str:
    command = " ".join(
        [
            os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable,
            "benchmarks/bench_hf.py",
            *map(shlex.quote, sys.argv[1:]),
        ]
    )
    cases = sorted(results, key=lambda c: (c.stage, PRECISIONS.index(c.precision), SYSTEMS.index(c.system)))
    lines = [
        (
            "# HF Trainer: the engine (compat `deepspeed` package) vs DeepSpeed "
            f"{ds_version or '(not measured)'}, {WORLD} ranks, CPU"
        ),
        "",
        f"Command: `{command}`",
        "",
        "Machine:",
        "",
        *machine_facts(ROOT, args.load_before, WORLD),
        "",
        (
            f"GPT-2 from a config ({args.n_layer} layers, width {args.n_embd}, {args.n_head} heads, "
            f"{args.seq_len + 1} tokens of bytes per window), micro batch {args.batch} per rank, {args.steps} "
            f"optimizer steps; step time = rank 0's median over steps {args.warmup + 1}-{args.steps} (the first "
            f"{args.warmup} are warm-up), median over {args.repeats} repeats (per-repeat medians in the last "
            "column). Ratio: the engine's median / DeepSpeed's at the same stage and precision. Peak RSS: "
            "ru_maxrss at exit, the most over ranks. Loss difference: the largest |engine - DeepSpeed| over "
            "the logged per-step training losses."
        ),
        "",
        (
            "| stage | system | median step s | ratio to DeepSpeed | peak RSS MiB/rank (max) | final loss | "
            "eval loss | max \\|loss diff\\| vs DeepSpeed | per-repeat medians s |"
        ),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for case in cases:
        s = results[case]
        ds = results.get(Case(case.stage, case.precision, "deepspeed"))
        ds_ok = ds is not None and ds.step_s is not None
        if s.step_s is None:
            why = "; ".join(sorted(set(s.errors))) or "no timed steps"
            cells = [f"{case.stage} {case.precision}", NAMES[case.system], f"failed: {why}"] + [""] * 6
            lines.append("| " + " | ".join(cells) + " |")
            continue
        ratio = f"{s.step_s / ds.step_s:.3f}" if ds_ok and case.system == "engine" else ""
        if case.system == "deepspeed":
            ratio = "1"
        diff = f"{max_abs_diff(s.losses, ds.losses):.2e}" if ds_ok and case.system == "engine" else ""
        lines.append(
            f"| {case.stage} {case.precision} | {NAMES[case.system]} | {s.step_s:.3f} | {ratio} | "
            f"{s.peak_rss:.0f} | {s.losses[-1]:.6f} | {s.eval_loss:.6f} | {diff} | "
            f"{', '.join(f'{m:.3f}' for m in s.medians)} |"
        )
    spreads = {c.label(): results[c].repeat_spread for c in cases if results[c].repeat_spread > 0}
    notes = [
        *notes,
        (
            "Repeats of each configuration logged "
            + (
                "identical losses."
                if not spreads
                else "different losses: " + ", ".join(f"{k} {v:.2e}" for k, v in spreads.items()) + "."
            )
        ),
        (
            'Optimizer: the configs\' {"type": "AdamW"}. The engine builds torch.optim.AdamW(foreach=True); '
            "DeepSpeed without offload builds its compiled FusedAdam (on DS_ACCELERATOR=cpu the C++ fused_adam "
            'op). Both take WarmupLR with HF\'s "auto" values (lr 5e-5).'
        ),
        (
            "Step time is end to end as Trainer runs it: forward, backward, the step, logging every step "
            "(a loss .item() and the gradient norm) and fetching the next batch; barriers are not added."
        ),
        (
            "Peak RSS is the whole process's: Python, torch, transformers (and for DeepSpeed its own imports), "
            "the model load, training, evaluation and the final save_model."
        ),
    ]
    lines += ["", "Notes:", "", *[f"- {n}" for n in notes]]
    path = os.path.join(args.out_dir, "hf.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return path


def plot(args: argparse.Namespace, results: dict[Case, Summary]) -> str | None:
    """One loss panel per stage (rows) and precision (columns), the step times in a bar chart below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    stages = sorted({c.stage for c in results})
    precs = [p for p in PRECISIONS if any(c.precision == p for c in results)]
    fig = plt.figure(figsize=(5.5 * len(precs), 2.8 * len(stages) + 3.4))
    grid = fig.add_gridspec(len(stages) + 1, len(precs))
    for i, stage in enumerate(stages):
        for j, prec in enumerate(precs):
            _plot_losses(fig.add_subplot(grid[i, j]), results, stage, prec)
    _plot_step_times(
        fig.add_subplot(grid[len(stages), :]),
        results,
        [(st, pr) for st in stages for pr in precs if Case(st, pr, "engine") in results],
    )
    fig.suptitle(f"HF Trainer, {WORLD} ranks, CPU: engine (compat deepspeed) vs DeepSpeed", fontsize=11)
    fig.tight_layout()
    path = os.path.join(args.out_dir, "hf.png")
    fig.savefig(path, dpi=110)
    return path


def _plot_losses(ax: Any, results: dict[Case, Summary], stage: int, prec: str) -> None:
    for system, style in (("engine", "-"), ("deepspeed", "--")):
        s = results.get(Case(stage, prec, system))
        if s is not None and s.losses:
            ax.plot(range(1, len(s.losses) + 1), s.losses, style, color=COLORS[system], label=NAMES[system])
    ax.set_title(f"stage {stage} {prec}: training loss", fontsize=9)
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.legend(fontsize=8, loc="upper right")
    eng, ds = results.get(Case(stage, prec, "engine")), results.get(Case(stage, prec, "deepspeed"))
    if eng is None or ds is None or not eng.losses or not ds.losses:
        return
    # The curves overlap at this scale: their difference per step on a log axis beside them.
    n = min(len(eng.losses), len(ds.losses))
    diffs = [max(abs(a - b), DIFF_FLOOR) for a, b in zip(eng.losses[:n], ds.losses[:n])]
    twin = ax.twinx()
    twin.semilogy(range(1, n + 1), diffs, ":", color="#777777", marker=".", markersize=3)
    twin.set_ylim(DIFF_FLOOR / 2, 1e-2)
    twin.set_ylabel(f"|engine - DeepSpeed| (dotted;\n0 drawn at {DIFF_FLOOR:g})", fontsize=7, color="#555555")


def _plot_step_times(ax: Any, results: dict[Case, Summary], groups: list[tuple[int, str]]) -> None:
    width = 0.38
    for k, system in enumerate(SYSTEMS):
        summaries = [results.get(Case(st, pr, system)) for st, pr in groups]
        vals = [s.step_s if s is not None and s.step_s is not None else 0.0 for s in summaries]
        xs = [i + (k - 0.5) * width for i in range(len(groups))]
        bars = ax.bar(xs, vals, width, color=COLORS[system], label=NAMES[system])
        for bar, s, v in zip(bars, summaries, vals):
            label = "not run" if s is None else ("failed" if s.step_s is None else f"{v:.3f}")
            ax.text(bar.get_x() + bar.get_width() / 2, v, label, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"stage {st} {pr}" for st, pr in groups], fontsize=8)
    ax.set_ylabel("median step time (s)\nlower is better", fontsize=8)
    ax.set_title("step time (median over repeats of the median over timed steps)", fontsize=9)
    ax.set_ylim(0, max([results[c].step_s or 0.0 for c in results] + [1e-3]) * 1.25)  # room for the labels
    ax.legend(fontsize=8, loc="upper left")


# ---------------------------------------------------------------------------------------------- driver
def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages (1, 2, 3)")
    p.add_argument(
        "--precisions",
        default="fp32,bf16",
        help="comma-separated: fp32, bf16 (bf16 is dropped, with a note, where the CPU has neither "
        "avx512_bf16 nor amx_bf16)",
    )
    p.add_argument("--repeats", type=int, default=2, help="launches per configuration and system, interleaved")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per launch")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the step time")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument(
        "--deepspeed_python",
        default=os.environ.get(DS_PYTHON_ENV, ""),
        help="the interpreter of a venv with the real DeepSpeed, transformers and accelerate "
        f"(default: ${DS_PYTHON_ENV}, else ''; '' = engine only)",
    )
    p.add_argument("--out_dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args()
    args.stage_list = [int(s) for s in args.stages.split(",") if s.strip()]
    args.precision_list = [s.strip() for s in args.precisions.split(",") if s.strip()]
    if not set(args.stage_list) <= {1, 2, 3} or not set(args.precision_list) <= {"fp32", "bf16"}:
        p.error("--stages takes 1, 2, 3 and --precisions fp32, bf16")
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    return args


def main() -> None:
    args = parse_args()
    args.load_before = os.getloadavg()
    notes: list[str] = []
    flags = cpu_flags()
    if "bf16" in args.precision_list and not flags & {"avx512_bf16", "amx_bf16"}:
        args.precision_list.remove("bf16")
        notes.append("bf16 not timed: this CPU has neither avx512_bf16 nor amx_bf16 (bf16 would be emulated).")
    elif "bf16" in args.precision_list:
        notes.append(
            'bf16 rows: Trainer\'s --bf16 true (the configs\' "bf16": {"enabled": "auto"} becomes '
            "true; both systems keep fp32 master weights); this CPU has avx512_bf16"
            + (" and AMX." if "amx_bf16" in flags else ", no AMX.")
            + " bf16 losses differ by bf16 rounding, not fp32 noise."
        )
    ds, why = (
        versions(args.deepspeed_python, deepspeed_env())
        if args.deepspeed_python
        else ([], f"not asked (no --deepspeed_python, no ${DS_PYTHON_ENV})")
    )
    if ds and "zeroengine" in ds[0]:
        ds, why = [], f"{args.deepspeed_python} imports the engine's compat package ({ds[0]}), not DeepSpeed"
    ds_version = ds[0] if ds else ""
    systems = SYSTEMS if ds else ("engine",)
    if not ds:
        notes.append(f"DeepSpeed was not measured: {why}. Engine rows only; no ratios or loss differences.")
        print(notes[-1], file=sys.stderr, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    runs: dict[Case, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        compat_dir = os.path.join(tmp, "compat")
        install_compat(compat_dir)
        eng, _ = versions(sys.executable, engine_env(compat_dir))
        if eng:
            notes.append(
                f"Engine side: {in_repo(sys.executable)}, `deepspeed` = compat {eng[0]}, transformers {eng[1]}, "
                f"accelerate {eng[2]}, torch {eng[3]}, launched with `python -m launcher.zrun`."
            )
        if ds:
            notes.append(
                f"DeepSpeed side: its own venv (--deepspeed_python), deepspeed {ds[0]}, transformers {ds[1]}, "
                f"accelerate {ds[2]}, torch {ds[3]}, launched with `python -m torch.distributed.run`, "
                "DS_ACCELERATOR=cpu."
            )
        if 3 in args.stage_list:
            notes.append(
                'Stage 3 runs configs/hf/zero3.json without its "train_batch_size": "auto" on both '
                "systems. As it is, the real DeepSpeed stops before training: transformers enters "
                "deepspeed.zero.Init to load the model, Accelerate (under --use_cpu) has initialised "
                "torch.distributed but not deepspeed.comm, so DeepSpeedConfig counts world size 1 and "
                "asserts `train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * "
                "world_size 16 != 8 * 1 * 1`. Without the key both derive 16 from the micro batch."
            )
        if 1 in args.stage_list:
            notes.append('Stage 1: configs/hf/zero2.json with "stage": 1.')
        init = save_init(args, tmp, compat_dir)
        configs = write_configs(tmp)
        for rep in range(args.repeats):
            order = systems if rep % 2 == 0 else tuple(reversed(systems))  # who goes first alternates
            for stage in args.stage_list:
                for prec in args.precision_list:
                    for system in order:
                        case = Case(stage, prec, system)
                        run = run_case(case, rep, args, tmp, init, configs, compat_dir)
                        runs.setdefault(case, []).append(run)
                        status = (
                            f"FAILED ({run.error})"
                            if run.error
                            else f"median step {timed_median(run, args.warmup):.3f} s, final loss {run.losses[-1]:.6f}"
                        )
                        print(
                            f"[repeat {rep + 1}/{args.repeats}] {case.label()}: {status} (launch {run.wall_s:.0f} s)",
                            flush=True,
                        )
    results = {case: summarise(rs, args.warmup) for case, rs in runs.items()}
    md = write_report(args, results, notes, ds_version)
    png = plot(args, results)
    print(f"wrote {md}" + (f" and {png}" if png else "; matplotlib not installed: no plot"))


if __name__ == "__main__":
    main()
