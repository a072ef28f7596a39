"""Stage 3 gather units: which parameters are fetched together by one all-gather.

Granularity decides speed: one gather per small submodule made DeepSpeed ~10% slower than FSDP on
the same model (DeepSpeed issue #5047), and each gloo collective costs ~1 ms here. The default plan
is coarse, as FSDP users wrap models: every element of a repeated block list (an nn.ModuleList or
nn.Sequential of two or more modules of one class, e.g. transformer layers) is a unit, and every
parameter outside those blocks (embeddings, final norm, head) goes to one *root* unit that stays
gathered from the start of forward to the end of backward. A parameter shared by two blocks, or by
a block and the rest, is moved to the root unit, so tied weights always live in one unit.
`unit_classes` names module classes to use as units instead of the detected blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, also when it is already partitioned (engine.zero.Init)."""
    return getattr(param, "ds_numel", None) or param.numel()


@dataclass
class UnitPlan:
    name: str
    module: torch.nn.Module | None
    """The module whose forward gathers the unit (None: the root unit, gathered by the model's forward)."""
    params: list[torch.nn.Parameter] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)


def _repeated_blocks(model: torch.nn.Module, unit_classes: tuple[type, ...]) -> list[tuple[str, torch.nn.Module]]:
    found: list[tuple[str, torch.nn.Module]] = []
    taken: set[int] = set()

    def inside_taken(name: str) -> bool:
        return any(name == t or name.startswith(t + ".") for t, _ in found)

    for name, module in model.named_modules():
        if inside_taken(name) or module is model:
            continue
        if unit_classes:
            if isinstance(module, unit_classes):
                found.append((name, module))
                taken.add(id(module))
            continue
        children = list(module.named_children())
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(children) >= 2 \
                and len({type(c) for _, c in children}) == 1 \
                and any(full_numel(p) for _, c in children for p in c.parameters()):
            for child_name, child in children:
                found.append((f"{name}.{child_name}" if name else child_name, child))
                taken.add(id(child))
    return found


def plan_units(model: torch.nn.Module, unit_classes: tuple[type, ...] = ()) -> list[UnitPlan]:
    """Units in registration order; the root unit (if it has parameters) comes first."""
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    blocks = _repeated_blocks(model, unit_classes)
    owners: dict[int, set[int]] = {}  # id(param) -> indices of blocks that use it
    for i, (_, block) in enumerate(blocks):
        for p in block.parameters():
            owners.setdefault(id(p), set()).add(i)
    outside = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
               if not any(n == b or n.startswith(b + ".") for b, _ in blocks)}
    root = UnitPlan("<root>", None)
    units = [UnitPlan(name, block) for name, block in blocks]
    for p in model.parameters():  # each parameter once, in registration order
        blocks_using = owners.get(id(p), set())
        target = units[next(iter(blocks_using))] if len(blocks_using) == 1 and id(p) not in outside else root
        target.params.append(p)
        target.param_names.append(names[id(p)])
    return ([root] if root.params else []) + [u for u in units if u.params]
