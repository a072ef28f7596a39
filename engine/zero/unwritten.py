"""Parameters that `engine.zero.Init` partitioned before anything wrote them: found, never trained on.

A module may create a parameter with `torch.empty` and leave its values to a later initialisation pass
(transformers 5's Mixtral experts, `nn.Parameter(torch.empty(...))` filled only by `_init_weights`). Under
Init the module is partitioned when its `__init__` returns; a pass that writes to the emptied parameter
afterwards writes nothing, and the parameter keeps whatever memory `torch.empty` returned (values up to
1e37 were seen: a loss of NaN from the first step, or worse, a plausible one).

While Init is open, `torch.empty` therefore returns floating-point memory filled with NaN, as torch does
under `torch.use_deterministic_algorithms(True)` with `torch.utils.deterministic.fill_uninitialized_memory`:
the contents of `torch.empty` are unspecified, so no correct program reads them, and a parameter nothing
wrote is then NaN. `check_written` (called by engine.initialize before the parameters are used) finds
any partitioned parameter still holding NaN and raises `UnwrittenParameterError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine import comm


class UnwrittenParameterError(RuntimeError):
    """A parameter built under engine.zero.Init that nothing initialised (its values would be garbage)."""


def poisoning_empty(empty: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`empty` (torch.empty, or a wrapper of it) returning floating-point tensors filled with NaN."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = empty(*args, **kwargs)
        if "out" not in kwargs and (tensor.is_floating_point() or tensor.is_complex()):
            with torch.no_grad():
                tensor.fill_(float("nan"))
        return tensor

    return wrapped


def check_written(model: torch.nn.Module, shard_of: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Raise UnwrittenParameterError naming every parameter of `model` partitioned by Init that holds NaN
    on any rank (`shard_of`: a parameter's local slice, None when it is not partitioned). Collective: every
    rank calls it, with the same model."""
    named = [(n, s) for n, p in model.named_parameters() if (s := shard_of(p)) is not None]
    if not named:
        return
    flags = torch.tensor([float(torch.isnan(s).any()) for _, s in named])
    comm.all_reduce(flags, op=comm.ReduceOp.MAX)
    bad = [n for (n, _), flag in zip(named, flags.tolist()) if flag]
    if bad:
        shown = ", ".join(repr(n) for n in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise UnwrittenParameterError(
            f"engine.zero.Init: {len(bad)} parameter(s) hold values nothing wrote: {shown}. They were made with "
            "torch.empty and partitioned when their module's __init__ returned, and no initialisation reached "
            "them afterwards (a write to a partitioned parameter's .data writes nothing). Initialise each in its "
            "module's __init__ (e.g. torch.nn.init.normal_), through Module.apply or transformers' "
            "post_init/_init_weights (Init gathers the module for both), or under "
            "engine.zero.GatheredParameters(param, modifier_rank=0) before engine.initialize; or build the model "
            "without engine.zero.Init (stage 3 partitions it at initialize)."
        )
