"""A repair of torch.distributed.nn's all-to-all on gloo subgroups, installed when the engine makes a subgroup.

torch.distributed.nn.functional's differentiable all-to-all (`_AlltoAll`, also the backward of its
`all_gather`) runs on gloo as one scatter per member, passing the member's *group* rank as `src`, which
torch reads as a *global* rank. On a group that is not the whole world ([2, 3] of 4 ranks) the scatter
from "rank 0" is refused ("Global rank 0 is not part of group"), and on a group whose ranks happen to
exist it scatters from the wrong rank. Hugging Face's sequence-parallel loss
(transformers' `deepspeed_sp_compute_loss`: an all_gather of the loss over the sequence-parallel group)
meets it in every backward at sequence x data parallelism on CPU. The repair passes the member as
`group_src` and leaves every other backend to torch's code.

Only torch's known code is replaced: `install()` reads `_AlltoAll.forward`'s source and does nothing
when the faulty call is not in it (a torch that fixed it, or changed it).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

_FAULTY_CALL = "dist.scatter(out_tensor_list[i], to_send, i, group=group)"
_installed = False


def _gloo_forward(original: Any) -> Any:
    def forward(ctx: Any, group: Any, out_tensor_list: list[torch.Tensor], *tensors: torch.Tensor) -> Any:
        if dist.get_backend(group=group) != dist.Backend.GLOO:
            return original(ctx, group, out_tensor_list, *tensors)
        ctx.group = group
        size = dist.get_world_size(group=group)
        ctx.input_tensor_size_list = [tensors[i].size() for i in range(size)]
        me = dist.get_rank(group=group)
        contiguous = [t.contiguous() for t in tensors]
        for member in range(size):
            dist.scatter(out_tensor_list[member], contiguous if member == me else None, group=group, group_src=member)
        return tuple(out_tensor_list)

    return forward


def install() -> bool:
    """Replace `_AlltoAll.forward` once, where torch has the faulty call; True when the repair is in place."""
    global _installed
    if _installed:
        return True
    from torch.distributed.nn import functional

    all_to_all = getattr(functional, "_AlltoAll", None)
    if all_to_all is None:
        return False
    try:
        source = inspect.getsource(all_to_all.forward)
    except (OSError, TypeError):
        return False
    if _FAULTY_CALL not in source:
        return False
    all_to_all.forward = staticmethod(_gloo_forward(all_to_all.forward))
    _installed = True
    return True
