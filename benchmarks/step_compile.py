"""bench_step.py --compile: the same step, eager and compiled with torch.compile (inductor), in one run.

Per precision: the engine at stages 0-3 (`engine.compile()`), PyTorch FSDP2 (each block compiled, then
fully_shard: torchtitan's recipe) and DeepSpeed's stages 0-3 (its `engine.compile()`), each eager and
compiled. Steady-state step time (the median of the timed steps, after the warm-up) and the first step (the
compile happens there) are reported apart. Writes benchmarks/results/step_compile_<model>.md and .png.

Goals (issue 50): compiled engine <= 0.85x the eager engine at every stage; no slower than FSDP2 compiled
or DeepSpeed compiled at the same stage.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

GOAL = 0.85


def cpu_has_bf16() -> bool:
    """bf16 timings only where the CPU computes bf16 natively (avx512_bf16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _median(r: Any) -> float | None:
    return statistics.median(r.times) if r.times and not r.error else None


def _find(results: list[Any], name: str) -> Any | None:
    return next((r for r in results if r.name == name), None)


def _cell(v: float | None, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if v is not None else "n/a"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(results: list[Any]) -> tuple[list[str], list[str]]:
    """(markdown lines, goal lines)."""
    lines = [
        (
            "| system | stage | precision | eager median s | compiled median s | compiled / eager | "
            "first step eager s | first step compiled s |"
        ),
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    goals: list[str] = []
    for prec in ("fp32", "bf16"):
        for system, stages in (("engine", (0, 1, 2, 3)), ("PyTorch FSDP2", (None,)), ("DeepSpeed", (0, 1, 2, 3))):
            for stage in stages:
                base = f"{system} stage {stage} {prec}" if stage is not None else f"{system} {prec}"
                eager, compiled = _find(results, base), _find(results, base + " compiled")
                if eager is None and compiled is None:
                    continue
                e, c = _median(eager) if eager else None, _median(compiled) if compiled else None
                r = _ratio(c, e)
                lines.append(
                    f"| {system} | {stage if stage is not None else '-'} | {prec} | {_cell(e)} | {_cell(c)} | "
                    f"{_cell(r, 2)} | {_cell(eager.first_step if eager else None, 2)} | "
                    f"{_cell(compiled.first_step if compiled else None, 2)} |"
                )
                if system != "engine":
                    continue
                met = r is not None and r <= GOAL
                goals.append(
                    f"- engine stage {stage} {prec}: compiled / eager {_cell(r, 2)} (goal <= {GOAL}): "
                    f"{'met' if met else 'not met'}"
                )
                for peer in (f"DeepSpeed stage {stage} {prec} compiled", f"PyTorch FSDP2 {prec} compiled"):
                    other = _find(results, peer)
                    if other is None:
                        continue
                    if peer.startswith("PyTorch") and stage != 3:
                        continue  # FSDP2 shards like stage 3: that is its peer
                    pr = _ratio(c, _median(other))
                    goals.append(
                        f"  - against {peer}: engine / peer {_cell(pr, 2)} (goal <= 1): "
                        f"{'met' if pr is not None and pr <= 1 else 'not met' if pr is not None else 'n/a'}"
                    )
    return lines, goals


def write(args: Any, results: list[Any], header: list[str], machine: list[str], out_dir: str) -> str:
    lines, goals = table(results)
    text = [
        *header,
        "",
        (
            "Steady state: the median of the timed steps after the warm-up (the compile is in the first step, "
            "reported apart, with torch's compile caches off: every compile is paid in full). compiled / eager "
            "below 1: compiling made the step faster."
        ),
        "",
        *lines,
        "",
        "Goals:",
        "",
        *goals,
        "",
        "Machine:",
        "",
        *machine,
    ]
    path = os.path.join(out_dir, f"step_compile_{args.model}.md")
    with open(path, "w") as f:
        f.write("\n".join(text) + "\n")
    print("\n".join(text), flush=True)
    _plot(args, results, out_dir)
    return path


def _plot(args: Any, results: list[Any], out_dir: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    precs = [p for p in ("fp32", "bf16") if any(r.precision == p for r in results)]
    fig, axes = plt.subplots(1, len(precs), figsize=(7 * len(precs), 4.5), squeeze=False)
    for ax, prec in zip(axes[0], precs):
        names = sorted(
            {r.name.removesuffix(" compiled").removesuffix(f" {prec}") for r in results if r.precision == prec}
        )
        ordered = [n for n in names if n.startswith("engine")] + [n for n in names if not n.startswith("engine")]
        eager, compiled = [], []
        for n in ordered:
            base = f"{n} {prec}"
            e, c = _find(results, base), _find(results, base + " compiled")
            eager.append((_median(e) if e else None) or 0.0)
            compiled.append((_median(c) if c else None) or 0.0)
        ys = range(len(ordered))
        ax.barh([y - 0.2 for y in ys], eager, height=0.4, color="#bbbbbb", label="eager")
        ax.barh([y + 0.2 for y in ys], compiled, height=0.4, color="#4c72b0", label="torch.compile (inductor)")
        ax.set_yticks(list(ys), ordered, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("median step time (s), lower is better")
        ax.set_title(prec, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"Eager and compiled step, model {args.model}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"step_compile_{args.model}.png"), dpi=110)
