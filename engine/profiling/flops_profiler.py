"""DeepSpeed's flops profiler (`deepspeed.profiling.flops_profiler`), counted by PyTorch's own
`torch.utils.flop_counter.FlopCounterMode` instead of monkey-patched functionals.

    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(batch)
    prof.stop_profile()
    prof.print_model_profile(profile_step=step)
    prof.end_profile()

What is counted differs from DeepSpeed's profiler in three ways, all of them FlopCounterMode's:
- Only matmul-like ops count (mm, addmm, bmm, baddbmm, convolutions, attention kernels). Norms,
  activations, softmax and elementwise ops count 0, where DeepSpeed adds their element counts. Every
  counted formula is 2 flops per multiply-accumulate, so MACs = flops / 2 exactly.
- `a @ b`, `torch.matmul` and `F.scaled_dot_product_attention` count wherever they are called;
  DeepSpeed's patching misses those it has no wrapper for.
- Attention counts the full score matrix even when causal (torch's formula says so: "we aren't
  accounting for causal attention here"), like DeepSpeed's.

# [Note: per-module figures from FlopCounterMode's module hierarchy]
FlopCounterMode charges an op to every module whose forward is running (`get_flop_counts()`, keyed
by the names its ModuleTracker gives: the outermost module's class name, then dotted child names).
So a module's count includes its children's, and the functional ops of its own forward. We learn the
tracker's name of each module from our own forward hooks (module hooks run after the global ones the
tracker uses: in the pre-hook the tracker has added the name, in the post-hook it has removed it), so
a model wrapped in another module, or a module shared under two names, still maps to its own count.
A container that is never called (nn.ModuleList) gets the sum of its children, as in DeepSpeed.
Latency is measured the same way, from forward pre/post hooks, cumulative over calls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.hooks import RemovableHandle

DEFAULT_PRECISION = 2
_LINE = "{:<70}  {:<8}"  # DeepSpeed's summary layout: label padded to 70, then the value
_aten = torch.ops.aten


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
    """"1.5 B" for billions of parameters (DeepSpeed's), "512" without a prefix."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


# ------------------------------------------------------------------------------- counting
def _counter_mapping() -> dict[Any, Any]:
    """torch's attention formulas for the CPU flash-attention kernel, which torch 2.13's registry
    lacks: F.scaled_dot_product_attention on CPU dispatches to it and would count 0 flops
    (pytorch/pytorch#195460, fixed upstream by #195801). Added only where the registry has no entry."""
    mapping: dict[Any, Any] = {}
    forward = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None and forward not in flop_counter.flop_registry:
        mapping[forward] = _cpu_attention_flops
    if backward is not None and backward not in flop_counter.flop_registry:
        mapping[backward] = _cpu_attention_backward_flops
    return mapping


def _cpu_attention_flops(query_shape: Sequence[int], key_shape: Sequence[int], value_shape: Sequence[int],
                         *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape))


def _cpu_attention_backward_flops(grad_out_shape: Sequence[int], query_shape: Sequence[int],
                                  key_shape: Sequence[int], value_shape: Sequence[int],
                                  *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


_counter_warmed = False


def _warm_up_counter() -> None:
    """Pay FlopCounterMode's one-time cost (its first dispatched op imports torch._dynamo, ~1 s)
    outside the timed forward, where it would be charged to the first module."""
    global _counter_warmed
    if not _counter_warmed:
        with FlopCounterMode(display=False):
            torch.ones(1) + 1
        _counter_warmed = True


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


def _param_count(module: nn.Module) -> int:
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


class FlopsProfiler:
    """Profiles the forward pass of `model`: flops, MACs, latency and parameters per module, printed
    in DeepSpeed's layout. `ds_engine` (optional) supplies the world/data/model-parallel sizes and the
    micro-batch size for the summary; `recompute_fwd_factor` is the extra forwards per step that
    activation recomputation adds to the backward (0.0: none, 1.0: all of it)."""

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.timings: dict[str, float] = {}
        """Seconds the engine measured for this step, filled before print_model_profile: "bwd" and
        "step" add the backward/step/iteration lines, "fwd" replaces the hooks' forward latency."""
        self.started = False
        """A profile exists: start_profile ran and end_profile has not."""
        self.flops = self.macs = self.params = 0
        """Totals of the last print_model_profile (DeepSpeed's attributes)."""
        self._counter: FlopCounterMode | None = None  # the counts of the last profile, until end_profile
        self._counting = False  # _counter is entered (start_profile) and not yet exited (stop_profile)
        self._handles: list[RemovableHandle] = []
        self._ignore: tuple[type, ...] = ()
        self._names: dict[nn.Module, str] = {}  # FlopCounterMode's name for each module that ran
        self._seconds: dict[nn.Module, float] = {}
        self._calls: dict[nn.Module, int] = {}
        self._open: dict[nn.Module, list[tuple[float, frozenset[str]]]] = {}  # running calls (recursion)
        self._sync = False  # CUDA runs asynchronously: synchronise around each module to time it

    # ------------------------------------------------------------------------ lifecycle
    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Reset, then count every op and time every module's forward until stop_profile. Modules
        whose type is in `ignore_list` (and everything inside them) drop out of the flops and latency
        of their ancestors and of the totals; their parameters still count (they are stored)."""
        if self._counting:
            raise RuntimeError("FlopsProfiler.start_profile: already profiling; call stop_profile() first")
        self.reset_profile()
        self._ignore = tuple(ignore_list or ())
        _warm_up_counter()
        first = next(iter(self.model.parameters()), None)
        self._sync = first is not None and first.device.type == "cuda"
        for module in self.model.modules():
            # First and last of the module's own hooks: its latency covers them too (e.g. ZeRO-3's gather).
            self._handles.append(module.register_forward_pre_hook(self._pre_hook, prepend=True))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        self._counter = FlopCounterMode(display=False, custom_mapping=_counter_mapping())
        self._counter.__enter__()
        self._counting = self.started = True

    def stop_profile(self) -> None:
        """Stop counting and timing; the figures stay until reset_profile or end_profile. Exit any
        dispatch mode entered after start_profile first (modes unwind in order)."""
        if self._counting and self._counter is not None:
            self._counter.__exit__(None, None, None)
        self._counting = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset_profile(self) -> None:
        """Zero the figures (a running profile keeps counting from zero)."""
        if self._counter is not None:
            self._counter.flop_counts.clear()
        self._names.clear()
        self._seconds.clear()
        self._calls.clear()
        self._open.clear()

    def end_profile(self) -> None:
        """Stop and discard the profile."""
        self.stop_profile()
        self.reset_profile()
        self._counter = None
        self.started = False

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        parents = frozenset(self._counter.mod_tracker.parents) if self._counter is not None else frozenset()
        if self._sync:
            torch.cuda.synchronize()
        self._open.setdefault(module, []).append((time.perf_counter(), parents))

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._sync:
            torch.cuda.synchronize()
        stack = self._open.get(module)
        if not stack:  # reset_profile ran inside this forward
            return
        started, parents = stack.pop()
        self._seconds[module] = self._seconds.get(module, 0.0) + time.perf_counter() - started
        self._calls[module] = self._calls.get(module, 0) + 1
        if module not in self._names and self._counter is not None:
            # See [Note: per-module figures from FlopCounterMode's module hierarchy]
            own = parents - self._counter.mod_tracker.parents
            if len(own) == 1:
                self._names[module] = next(iter(own))

    # ---------------------------------------------------------------------- figures
    def _measured_flops(self, module: nn.Module) -> float:
        if self._counter is None or module not in self._names:
            return 0
        return sum(self._counter.flop_counts.get(self._names[module], {}).values())

    def _aggregate(self, measured: Callable[[nn.Module], float]) -> dict[nn.Module, float]:
        """Each module's figure with ignored modules left out (see the module docstring's note)."""
        values: dict[nn.Module, float] = {}

        def walk(module: nn.Module, inside_ignored: bool) -> tuple[float, float]:
            # (everything the module ran, what it reports): the difference is its ignored part
            ignored = inside_ignored or type(module) in self._ignore
            children = [walk(child, ignored) for child in module.children()]
            if self._calls.get(module):
                ran = measured(module)
                value = ran - sum(c_ran - c_value for c_ran, c_value in children)
            else:  # a container never called: its children ran from its parent's forward
                ran = sum(c_ran for c_ran, _ in children)
                value = sum(c_value for _, c_value in children)
            values[module] = 0 if ignored else value  # 0, not 0.0: flops stay exact ints
            return ran, values[module]

        walk(self.model, False)
        return values

    def _profiles(self) -> dict[nn.Module, ModuleProfile]:
        flops = self._aggregate(self._measured_flops)
        seconds = self._aggregate(lambda m: self._seconds.get(m, 0.0))
        ignored = self._ignored_modules()
        return {m: ModuleProfile(params=_param_count(m), flops=int(f), macs=int(f) // 2, latency=seconds[m],
                                 ignored=m in ignored) for m, f in flops.items()}

    def _ignored_modules(self) -> set[nn.Module]:
        out: set[nn.Module] = set()
        for module in self.model.modules():
            if type(module) in self._ignore:
                out.update(module.modules())
        return out

    def module_profile(self, module: nn.Module) -> ModuleProfile:
        """The figures of one submodule of the model (not in DeepSpeed's API, which stores them as
        module.__flops__ etc.)."""
        profiles = self._profiles()
        if module not in profiles:
            raise KeyError(f"{type(module).__name__} is not a submodule of the profiled model")
        return profiles[module]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward flops of the model (matmul-like ops, see the module docstring)."""
        flops = self._profiles()[self.model].flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates: flops / 2 (every counted formula is 2 flops per MAC)."""
        macs = self._profiles()[self.model].macs
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward latency of the model in seconds, from its own forward hooks."""
        seconds = self._profiles()[self.model].latency
        return duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters stored per rank (full size under ZeRO-3, the local shard under tensor parallelism)."""
        params = _param_count(self.model)
        return params_to_string(params) if as_string else params

    # ---------------------------------------------------------------------- printing
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> str:
        """DeepSpeed's report: summary, top modules per depth, then (detailed) the module tree down to
        `module_depth` (the model is depth 0; -1: all). Printed to stdout, or written to `output_file`
        (overwritten, as DeepSpeed's), and returned."""
        if not self.started:
            raise RuntimeError("FlopsProfiler.print_model_profile: no profile; call start_profile(), run the "
                               "model's forward, then stop_profile() first")
        profiles = self._profiles()
        total = profiles[self.model]
        self.flops, self.macs, self.params = total.flops, total.macs, total.params
        lines = ["", "-------------------------- Flops Profiler --------------------------",
                 f"Profile Summary at step {profile_step}:", *_NOTATIONS, ""]
        lines += self._summary_lines(total)
        lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
        lines += _aggregated_lines(self.model, profiles, module_depth, top_modules)
        if detailed:
            lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                      *_DETAILED_HEADER]
            lines += _tree_lines(self.model, profiles, total, module_depth)
        lines.append("------------------------------------------------------------------------------")
        text = "\n".join(lines) + "\n"
        if output_file:
            os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
            with open(output_file, "w") as f:
                f.write(text)
        else:
            print(text, end="")
        return text

    def _summary_lines(self, total: ModuleProfile) -> list[str]:
        engine = self.ds_engine
        mp_size = engine.mp_world_size if engine is not None else 1
        out = []
        if engine is not None:
            out += [_LINE.format("world size: ", engine.world_size),
                    _LINE.format("data parallel size: ", engine.dp_world_size),
                    _LINE.format("model parallel size: ", mp_size),
                    _LINE.format("batch size per GPU: ", engine.train_micro_batch_size_per_gpu())]
        fwd = self.timings.get("fwd", total.latency)
        out += [_LINE.format("params per GPU: ", params_to_string(total.params)),
                _LINE.format("params of model = params per GPU * mp_size: ", params_to_string(total.params * mp_size)),
                _LINE.format("fwd MACs per GPU: ", macs_to_string(total.macs)),
                _LINE.format("fwd flops per GPU: ", number_to_string(total.flops)),
                _LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ",
                             number_to_string(total.flops * mp_size)),
                _LINE.format("fwd latency: ", duration_to_string(fwd)),
                _LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
                             flops_to_string(_rate(total.flops, fwd)))]
        if "bwd" not in self.timings or "step" not in self.timings:
            return out
        bwd, step = self.timings["bwd"], self.timings["step"]
        factor = 2 + self.recompute_fwd_factor  # the backward is twice the forward, plus any recomputation
        iteration = fwd + bwd + step
        out += [_LINE.format("bwd latency: ", duration_to_string(bwd)),
                _LINE.format(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                             flops_to_string(_rate(factor * total.flops, bwd))),
                _LINE.format(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                             flops_to_string(_rate((factor + 1) * total.flops, fwd + bwd))),
                _LINE.format("step latency: ", duration_to_string(step)),
                _LINE.format("iter latency: ", duration_to_string(iteration)),
                _LINE.format(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                             flops_to_string(_rate((factor + 1) * total.flops, iteration)))]
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
    ("params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total "
     "fwd latency, fwd FLOPS"),
    "",
    ("Note: 1. A module's figures include its functional calls (e.g. attention) that are not submodules: "
     "they make up the difference between a parent's MACs (or latency) and the sum of its submodules'."),
    ("2. Flops count matmul-like ops only (torch.utils.flop_counter); attention is counted in full even "
     "when causal."),
    ("3. The model's own latency is measured at its forward; the fwd latency above can come from the "
     "engine's timer instead."),
    "",
]


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _percent(part: float, whole: float) -> float:
    return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0


def _aggregated_lines(model: nn.Module, profiles: Mapping[nn.Module, ModuleProfile], module_depth: int,
                      top_modules: int) -> list[str]:
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

        out += [f"depth {depth}:",
                f"    params      - {top(0, params_to_string)}",
                f"    MACs        - {top(1, macs_to_string)}",
                f"    fwd latency - {top(2, duration_to_string)}"]
    return out


def _tree_lines(model: nn.Module, profiles: Mapping[nn.Module, ModuleProfile], total: ModuleProfile,
                module_depth: int) -> list[str]:
    """The model's repr (nn.Module's layout) with each module's profile first in its parentheses."""

    def describe(module: nn.Module) -> str:
        p = profiles[module]
        items = [f"{params_to_string(p.params)} = {_percent(p.params, total.params):g}% Params"]
        if p.ignored:
            items.append("not profiled (ignore_list)")
        else:
            items += [f"{macs_to_string(p.macs)} = {_percent(p.macs, total.macs):g}% MACs",
                      f"{duration_to_string(p.latency)} = {_percent(p.latency, total.latency):g}% latency",
                      flops_to_string(round(_rate(p.flops, p.latency), DEFAULT_PRECISION))]
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


# ----------------------------------------------------------------------------- one call
def get_model_profile(model: nn.Module, input_shape: tuple[int, ...] | None = None,
                      args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Iterable[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward (or `generate`, mode="generate") of `model` in eval mode under no_grad,
    after `warm_up` unprofiled ones: returns (flops, MACs, params), strings when `as_string`.
    `input_shape` makes the only positional input: torch.ones of that shape in the dtype and on the
    device of the model's first parameter (DeepSpeed's takes an uninitialised tensor). The model's
    train/eval mode is restored afterwards."""
    call = _check_profile_inputs(model, input_shape, args, kwargs, mode)
    positional = list(args or ())
    if input_shape is not None:
        first = next(iter(model.parameters()), None)
        dtype = first.dtype if first is not None else None
        positional = [torch.ones(input_shape, dtype=dtype, device=first.device if first is not None else None)]
    keywords = dict(kwargs or {})
    was_training = model.training
    model.eval()
    prof = FlopsProfiler(model)
    try:
        with torch.no_grad():
            for _ in range(warm_up):
                call(*positional, **keywords)
            prof.start_profile(ignore_list=ignore_modules)
            try:
                call(*positional, **keywords)
            finally:
                prof.stop_profile()
        total = prof.module_profile(model)
        flops, macs, params = total.flops, total.macs, total.params
        if print_profile:
            prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    finally:
        prof.end_profile()
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params


def _check_profile_inputs(model: nn.Module, input_shape: Any, args: Any, kwargs: Any,
                          mode: str) -> Callable[..., Any]:
    """The callable to profile, after the checks a caller can fail (each names the fix)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    if args is not None and not isinstance(args, (tuple, list)):
        raise TypeError(f"get_model_profile: args must be a tuple or list of positional inputs, got "
                        f"{type(args).__name__}; for one tensor x pass args=(x,)")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"get_model_profile: kwargs must be a dict of keyword inputs, got {type(kwargs).__name__}")
    if input_shape is not None:
        if args:
            raise ValueError("get_model_profile: give input_shape or args, not both: input_shape builds the "
                             "only positional input (torch.ones(input_shape)); drop one of them")
        if not isinstance(input_shape, tuple):
            raise TypeError(f"get_model_profile: input_shape must be a tuple such as (batch, features), got "
                            f"{type(input_shape).__name__} {input_shape!r}; pass tuple(input_shape)")
        if not input_shape or not all(isinstance(n, int) and n > 0 for n in input_shape):
            raise ValueError(f"get_model_profile: input_shape must hold one or more positive ints, got "
                             f"{input_shape!r}")
    elif not args and not kwargs:
        raise ValueError("get_model_profile: no input for the model: pass input_shape=(batch, ...) for one "
                         "tensor input, or args=(...) and/or kwargs={...}")
    if mode == "generate":
        generate = getattr(model, "generate", None)
        if not callable(generate):
            raise ValueError(f"get_model_profile: mode='generate' needs model.generate, which "
                             f"{type(model).__name__} has not; use mode='forward'")
        return generate
    return model
