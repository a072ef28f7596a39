"""checkpoint(function, *args): run `function` without keeping its intermediate activations, and run it
again in the backward to get them. DeepSpeed's two forms:

- `checkpoint` (reentrant, DeepSpeed's CheckpointFunction): the forward runs under no_grad inside an
  autograd.Function whose backward restores the inputs, recomputes with grad enabled and runs a nested
  backward through the recomputed graph. Outputs need an input that requires grad to be differentiable.
- `non_reentrant_checkpoint`: the forward runs with grad, but every tensor autograd would save is
  replaced by its index (saved_tensors_hooks); the first time the backward asks for one, the function
  is recomputed once and the recomputed tensors are handed out by index. Gradients reach parameters
  even when no input requires grad (a frozen embedding feeding checkpointed layers).

Both keep the inputs with engine/activation_checkpointing/store.py (whole, partitioned over the tensor-parallel
group, in host memory, in the arena) and replay the forward's randomness exactly: the default
generators and every stream of the tensor-parallel RNG tracker are put back to their state at the
forward for the recompute, and afterwards to where the backward had them, so dropout masks are the
same and the run's random sequence is the same as without checkpointing. Autocast is re-entered as
it was. In fp32 the gradients are bitwise those of the same model without checkpointing
(tests/test_activation_checkpointing.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from engine import comm
from engine.accelerator import get_accelerator
from engine.activation_checkpointing import contiguous
from engine.activation_checkpointing.settings import current, say_once
from engine.activation_checkpointing.store import KeptInputs
from engine.parallel.random import AllRNGStates, get_all_states, set_all_states

logger = logging.getLogger("engine.checkpointing")

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Replay:
    """What the forward ran under, to run the recompute under the same."""

    rng: AllRNGStates
    autocast: tuple[tuple[str, torch.dtype, bool], ...]

    @classmethod
    def capture(cls) -> Replay:
        autocast = tuple(
            (d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
            for d in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(d)
        )
        return cls(get_all_states(), autocast)

    @contextmanager
    def replaying(self) -> Iterator[None]:
        outside = get_all_states()
        set_all_states(self.rng)
        try:
            with ExitStack() as stack, torch.enable_grad():
                for device, dtype, cache in self.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
                yield
        finally:
            set_all_states(outside)


@contextmanager
def _boundary(what: str) -> Iterator[None]:
    """synchronize_checkpoint_boundary and profile around a checkpoint's forward or recompute+backward."""
    options = current().options
    sync = options.synchronize_checkpoint_boundary and get_accelerator().device_name() != "cpu"
    if sync:
        get_accelerator().synchronize()
    start = time.perf_counter()
    yield
    if sync or (options.profile and get_accelerator().device_name() != "cpu"):
        get_accelerator().synchronize()
    if options.profile and (not comm.is_initialized() or comm.get_rank() == 0):
        logger.info("activation checkpoint %s: %.2f ms", what, (time.perf_counter() - start) * 1e3)


def _with_kwargs(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Keyword arguments become trailing positional ones, so tensors passed by keyword are kept and get
    gradients like positional ones (DeepSpeed does the same)."""
    if not kwargs:
        return function, args
    count, keys = len(args), tuple(kwargs)

    def positional(*all_args: Any) -> Any:
        return function(*all_args[:count], **dict(zip(keys, all_args[count:])))

    return positional, args + tuple(kwargs.values())


def _tensors(outputs: Any) -> list[torch.Tensor]:
    if torch.is_tensor(outputs):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [o for o in outputs if torch.is_tensor(o)]
    raise TypeError(
        f"engine.checkpointing.checkpoint: the function returned {type(outputs).__name__}; a "
        "checkpointed function returns a tensor or a tuple/list (tensors and other values)"
    )


def _rebuild(outputs: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
    """`outputs` with its tensors replaced, in order, by the autograd-connected `tensors`."""
    if torch.is_tensor(outputs):
        return tensors[0]
    replaced = iter(tensors)
    return type(outputs)(next(replaced) if torch.is_tensor(o) else o for o in outputs)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], box: list[Any], *args: Any) -> tuple[torch.Tensor, ...]:
        with _boundary("forward"):
            ctx.run_function = run_function
            ctx.kept = KeptInputs(args, current())
            ctx.replay = Replay.capture()
            with torch.no_grad():
                outputs = run_function(*args)
        box.append(outputs)
        tensors = _tensors(outputs)
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        contiguous.check()
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "engine.checkpointing.checkpoint (reentrant) cannot run under torch.autograd.grad(); "
                "call .backward(), or use engine.checkpointing.non_reentrant_checkpoint"
            )
        if ctx.kept is None:
            raise RuntimeError(
                "engine.checkpointing.checkpoint: this checkpoint's backward already ran and its "
                "inputs were released; a second backward through it needs retain_graph on the "
                "first and non_reentrant_checkpoint"
            )
        with _boundary("recompute+backward"):
            inputs = ctx.kept.restore()
            ctx.kept = None
            with ctx.replay.replaying():
                outputs = ctx.run_function(*inputs)
            pairs = [(o, g) for o, g in zip(_tensors(outputs), grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs))


# Both forms are opaque to torch.compile: inside a compiled model the graph breaks at the call and the
# checkpoint runs as written here, its function eagerly, in the forward and in the recompute alike (a
# forward traced by the compiler saves other tensors than the eager recompute would: the counts below
# would disagree, and the model-parallel RNG replay would not reach the compiled kernels). torch's own
# torch.utils.checkpoint, which Hugging Face models use, is compiled with the model (docs/compile.md).
@torch.compiler.disable
def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's deepspeed.checkpointing.checkpoint (reentrant): `function(*args, **kwargs)`, its
    activations recomputed in the backward instead of kept."""
    function, args = _with_kwargs(function, args, kwargs)
    if not torch.is_grad_enabled():  # no backward will come: nothing to keep
        return function(*args)
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        say_once(
            "no-grad-inputs",
            "engine.checkpointing.checkpoint: no input requires grad, so the reentrant "
            "checkpoint's outputs do not either and the parameters inside get no "
            "gradient; use engine.checkpointing.non_reentrant_checkpoint there",
        )
    box: list[Any] = []
    tensors = _CheckpointFunction.apply(function, box, *args)
    return _rebuild(box[0], tensors)


class _Frame:
    """One non-reentrant checkpoint: its kept inputs until the recompute, then the recomputed tensors."""

    def __init__(self, function: Callable[..., Any], kept: KeptInputs) -> None:
        self.function = function
        self.kept: KeptInputs | None = kept
        self.replay = Replay.capture()
        self.packed = 0
        self.recomputed: list[torch.Tensor] | None = None

    def pack(self, _tensor: torch.Tensor) -> int:
        self.packed += 1
        return self.packed - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.recomputed is None:
            self._recompute()
        assert self.recomputed is not None
        return self.recomputed[index]

    def _recompute(self) -> None:
        contiguous.check()
        assert self.kept is not None
        with _boundary("recompute"):
            inputs = self.kept.restore()
            self.kept = None
            saved: list[torch.Tensor] = []

            def keep(tensor: torch.Tensor) -> int:
                saved.append(tensor.detach())
                return len(saved) - 1

            with self.replay.replaying(), torch.autograd.graph.saved_tensors_hooks(keep, saved.__getitem__):
                self.function(*inputs)
        if len(saved) != self.packed:
            raise RuntimeError(
                f"engine.checkpointing.non_reentrant_checkpoint: the recompute saved {len(saved)} "
                f"tensors for backward but the forward saved {self.packed}; the checkpointed "
                "function must run the same operations every time it is called with the same "
                "inputs and random state"
            )
        self.recomputed = saved


@torch.compiler.disable
def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's deepspeed.checkpointing.non_reentrant_checkpoint (torch's use_reentrant=False form)."""
    function, args = _with_kwargs(function, args, kwargs)
    if not torch.is_grad_enabled():
        return function(*args)
    frame = _Frame(function, KeptInputs(args, current()))
    with _boundary("forward"), torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return function(*args)
