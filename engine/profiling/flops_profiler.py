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

This module counts; report.py formats the figures and prints DeepSpeed's report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.hooks import RemovableHandle

# DeepSpeed's module holds the number formats too: they stay importable from here.
from engine.profiling.report import (
    DEFAULT_PRECISION,
    ModuleProfile,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    report_text,
    summary_lines,
    write_report,
)

__all__ = [
    "DEFAULT_PRECISION",
    "FlopsProfiler",
    "ModuleProfile",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]

_aten = torch.ops.aten


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


def _cpu_attention_flops(
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return int(flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape))


def _cpu_attention_backward_flops(
    grad_out_shape: Sequence[int],
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
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
        return {
            m: ModuleProfile(
                params=_param_count(m), flops=int(f), macs=int(f) // 2, latency=seconds[m], ignored=m in ignored
            )
            for m, f in flops.items()
        }

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
    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> str:
        """DeepSpeed's report (report.py): summary, top modules per depth, then (detailed) the module tree
        down to `module_depth` (the model is depth 0; -1: all). Printed to stdout, or written to
        `output_file` (overwritten, as DeepSpeed's), and returned."""
        if not self.started:
            raise RuntimeError(
                "FlopsProfiler.print_model_profile: no profile; call start_profile(), run the "
                "model's forward, then stop_profile() first"
            )
        profiles = self._profiles()
        total = profiles[self.model]
        self.flops, self.macs, self.params = total.flops, total.macs, total.params
        summary = summary_lines(total, self.timings, self.ds_engine, self.recompute_fwd_factor)
        text = report_text(self.model, profiles, summary, profile_step, module_depth, top_modules, detailed)
        write_report(text, output_file)
        return text


# ----------------------------------------------------------------------------- one call
def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Iterable[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
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
            prof.print_model_profile(
                profile_step=warm_up,
                module_depth=module_depth,
                top_modules=top_modules,
                detailed=detailed,
                output_file=output_file,
            )
    finally:
        prof.end_profile()
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params


def _check_profile_inputs(model: nn.Module, input_shape: Any, args: Any, kwargs: Any, mode: str) -> Callable[..., Any]:
    """The callable to profile, after the checks a caller can fail (each names the fix)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    if args is not None and not isinstance(args, (tuple, list)):
        raise TypeError(
            f"get_model_profile: args must be a tuple or list of positional inputs, got "
            f"{type(args).__name__}; for one tensor x pass args=(x,)"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"get_model_profile: kwargs must be a dict of keyword inputs, got {type(kwargs).__name__}")
    if input_shape is not None:
        if args:
            raise ValueError(
                "get_model_profile: give input_shape or args, not both: input_shape builds the "
                "only positional input (torch.ones(input_shape)); drop one of them"
            )
        if not isinstance(input_shape, tuple):
            raise TypeError(
                f"get_model_profile: input_shape must be a tuple such as (batch, features), got "
                f"{type(input_shape).__name__} {input_shape!r}; pass tuple(input_shape)"
            )
        if not input_shape or not all(isinstance(n, int) and n > 0 for n in input_shape):
            raise ValueError(f"get_model_profile: input_shape must hold one or more positive ints, got {input_shape!r}")
    elif not args and not kwargs:
        raise ValueError(
            "get_model_profile: no input for the model: pass input_shape=(batch, ...) for one "
            "tensor input, or args=(...) and/or kwargs={...}"
        )
    if mode == "generate":
        generate = getattr(model, "generate", None)
        if not callable(generate):
            raise ValueError(
                f"get_model_profile: mode='generate' needs model.generate, which "
                f"{type(model).__name__} has not; use mode='forward'"
            )
        return generate
    return model
