"""The flops profiler's report in DeepSpeed's layout (`print_model_profile`): the number formats
(`number_to_string` and the rest, DeepSpeed's names), the summary, the top modules per depth and the
module tree. It prints `ModuleProfile`s; flops_profiler.py counts them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

DEFAULT_PRECISION = 2
_LINE = "{:<70}  {:<8}"  # DeepSpeed's summary layout: label padded to 70, then the value


# ------------------------------------------------------------------------------------ numbers
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""), (1e-3, "m"), (1e-6, "u"))


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """`1234567` -> "1.23 M" (DeepSpeed's format: value rounded to `precision`, a space, the prefix)."""
    if units is None:
        magnitude, units = next(((m, p) for m, p in _PREFIXES if abs(num) >= m), _PREFIXES[-1])
        if num == 0:
            magnitude, units = 1.0, ""
    else:
        magnitude = {p: m for m, p in _PREFIXES}.get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """ "1.5 B" for billions of parameters (DeepSpeed's), "512" without a prefix."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


@dataclass(frozen=True)
class ModuleProfile:
    """One module's figures for the profiled forward(s); ignored modules report 0 flops and latency."""

    params: int
    """Elements of its parameters, full size under ZeRO-3 (`ds_numel`)."""
    flops: int
    macs: int
    latency: float
    """Seconds in its forward, summed over its calls between start_profile and stop_profile."""
    ignored: bool = False


# ------------------------------------------------------------------------------- the report
def report_text(
    model: nn.Module,
    profiles: Mapping[nn.Module, ModuleProfile],
    summary: list[str],
    profile_step: int,
    module_depth: int,
    top_modules: int,
    detailed: bool,
) -> str:
    """The whole report (see FlopsProfiler.print_model_profile), `summary` from summary_lines."""
    total = profiles[model]
    lines = [
        "",
        "-------------------------- Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        *_NOTATIONS,
        "",
        *summary,
    ]
    lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
    lines += _aggregated_lines(model, profiles, module_depth, top_modules)
    if detailed:
        lines += [
            "",
            "------------------------------ Detailed Profile per GPU ------------------------------",
            *_DETAILED_HEADER,
        ]
        lines += _tree_lines(model, profiles, total, module_depth)
    lines.append("------------------------------------------------------------------------------")
    return "\n".join(lines) + "\n"


def write_report(text: str, output_file: str | None) -> None:
    """To `output_file` (overwritten, as DeepSpeed's), or to stdout without one."""
    if output_file:
        os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
        with open(output_file, "w") as f:
            f.write(text)
    else:
        print(text, end="")


def summary_lines(
    total: ModuleProfile, timings: Mapping[str, float], engine: Any, recompute_fwd_factor: float
) -> list[str]:
    """The summary: the model's totals and rates; the parallel sizes with `engine`, the backward, step
    and iteration lines with timings "bwd" and "step" (see FlopsProfiler.timings)."""
    mp_size = engine.mp_world_size if engine is not None else 1
    out = []
    if engine is not None:
        out += [
            _LINE.format("world size: ", engine.world_size),
            _LINE.format("data parallel size: ", engine.dp_world_size),
            _LINE.format("model parallel size: ", mp_size),
            _LINE.format("batch size per GPU: ", engine.train_micro_batch_size_per_gpu()),
        ]
    fwd = timings.get("fwd", total.latency)
    out += [
        _LINE.format("params per GPU: ", params_to_string(total.params)),
        _LINE.format("params of model = params per GPU * mp_size: ", params_to_string(total.params * mp_size)),
        _LINE.format("fwd MACs per GPU: ", macs_to_string(total.macs)),
        _LINE.format("fwd flops per GPU: ", number_to_string(total.flops)),
        _LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(total.flops * mp_size)),
        _LINE.format("fwd latency: ", duration_to_string(fwd)),
        _LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(_rate(total.flops, fwd))),
    ]
    if "bwd" not in timings or "step" not in timings:
        return out
    bwd, step = timings["bwd"], timings["step"]
    factor = 2 + recompute_fwd_factor  # the backward is twice the forward, plus any recomputation
    iteration = fwd + bwd + step
    out += [
        _LINE.format("bwd latency: ", duration_to_string(bwd)),
        _LINE.format(
            f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
            flops_to_string(_rate(factor * total.flops, bwd)),
        ),
        _LINE.format(
            f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
            flops_to_string(_rate((factor + 1) * total.flops, fwd + bwd)),
        ),
        _LINE.format("step latency: ", duration_to_string(step)),
        _LINE.format("iter latency: ", duration_to_string(iteration)),
        _LINE.format(
            f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
            flops_to_string(_rate((factor + 1) * total.flops, iteration)),
        ),
    ]
    if engine is not None:
        # Samples of the data-parallel group (DeepSpeed multiplies by world_size, which counts a
        # tensor-parallel group's shared batch once per rank).
        samples = engine.train_micro_batch_size_per_gpu() * engine.dp_world_size
        out.append(_LINE.format("samples/second: ", round(_rate(samples, iteration), DEFAULT_PRECISION)))
    return out


_NOTATIONS = [
    "Notations:",
    "data parallel size (dp_size), model parallel size(mp_size),",
    "number of parameters (params), number of multiply-accumulate operations(MACs),",
    "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
    "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
    "step (weights update latency), iter latency (sum of fwd, bwd and step latency),",
    "per GPU (per rank: one process, on a GPU or on CPU threads)",
]
_DETAILED_HEADER = [
    "Each module profile is listed after its name in the following order: ",
    (
        "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total "
        "fwd latency, fwd FLOPS"
    ),
    "",
    (
        "Note: 1. A module's figures include its functional calls (e.g. attention) that are not submodules: "
        "they make up the difference between a parent's MACs (or latency) and the sum of its submodules'."
    ),
    ("2. Flops count matmul-like ops only (torch.utils.flop_counter); attention is counted in full even when causal."),
    (
        "3. The model's own latency is measured at its forward; the fwd latency above can come from the "
        "engine's timer instead."
    ),
    "",
]


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _percent(part: float, whole: float) -> float:
    return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0


def _aggregated_lines(
    model: nn.Module, profiles: Mapping[nn.Module, ModuleProfile], module_depth: int, top_modules: int
) -> list[str]:
    """Per depth, the `top_modules` module classes by params, MACs and fwd latency (summed over the
    modules of a class at that depth, as DeepSpeed's)."""
    by_depth: list[dict[str, list[float]]] = []

    def walk(module: nn.Module, depth: int) -> None:
        if depth == len(by_depth):
            by_depth.append({})
        sums = by_depth[depth].setdefault(type(module).__name__, [0, 0, 0.0])
        profile = profiles[module]
        sums[0] += profile.params
        sums[1] += profile.macs
        sums[2] += profile.latency
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    last = len(by_depth) - 1 if module_depth < 0 else min(module_depth, len(by_depth) - 1)
    out = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):

        def top(index: int, fmt: Callable[[float], str], d: int = depth) -> dict[str, str]:
            ranked = sorted(by_depth[d].items(), key=lambda item: item[1][index], reverse=True)
            return {name: fmt(sums[index]) for name, sums in ranked[:top_modules]}

        out += [
            f"depth {depth}:",
            f"    params      - {top(0, params_to_string)}",
            f"    MACs        - {top(1, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return out


def _tree_lines(
    model: nn.Module, profiles: Mapping[nn.Module, ModuleProfile], total: ModuleProfile, module_depth: int
) -> list[str]:
    """The model's repr (nn.Module's layout) with each module's profile first in its parentheses."""

    def describe(module: nn.Module) -> str:
        p = profiles[module]
        items = [f"{params_to_string(p.params)} = {_percent(p.params, total.params):g}% Params"]
        if p.ignored:
            items.append("not profiled (ignore_list)")
        else:
            items += [
                f"{macs_to_string(p.macs)} = {_percent(p.macs, total.macs):g}% MACs",
                f"{duration_to_string(p.latency)} = {_percent(p.latency, total.latency):g}% latency",
                flops_to_string(round(_rate(p.flops, p.latency), DEFAULT_PRECISION)),
            ]
        if module.extra_repr():
            items.append(module.extra_repr())
        return ", ".join(items)

    def render(module: nn.Module, depth: int) -> list[str]:
        children = list(module.named_children()) if module_depth < 0 or depth < module_depth else []
        head = f"{type(module).__name__}("
        if not children:
            return [f"{head}{describe(module)})"]
        lines = [head, f"  {describe(module)}"]
        for name, child in children:
            child_lines = render(child, depth + 1)
            lines.append(f"  ({name}): {child_lines[0]}")
            lines += [f"  {line}" for line in child_lines[1:]]
        return [*lines, ")"]

    return render(model, 0)
