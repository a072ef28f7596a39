"""Stage 3 gather units: which parameters are fetched together by one all-gather.

Granularity decides speed: one gather per small submodule made DeepSpeed ~10% slower than FSDP on
the same model (DeepSpeed issue #5047), and each gloo collective costs ~1 ms here. The default plan
is coarse, as FSDP users wrap models: every element of a repeated block list (an nn.ModuleList or
nn.Sequential of two or more modules of one class, e.g. transformer layers) is a unit, and every
parameter outside those blocks (embeddings, final norm, head) goes to one *root* unit that stays
gathered from the start of forward to the end of backward. A parameter shared by two blocks, or by
a block and the rest, is moved to the root unit, so tied weights always live in one unit.
The user can name the units instead, as DeepSpeed users do for MoE blocks: modules marked with
`engine.zero.set_z3_leaf_modules(model, [Block])` (DeepSpeed's functions and `_z3_leaf` flag, in
engine/zero/leaf_modules.py), or
matched by the config's `zero_optimization.leaf_module` (`classes`, `names`, `name_suffixes`). Each
such module (outermost, when they nest) is one unit with all its descendants; every other
parameter goes to the root unit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from engine.zero.leaf_modules import z3_leaf_module
from engine.zero.released import full_numel


@dataclass
class UnitPlan:
    name: str
    modules: list[torch.nn.Module]
    """The modules whose forwards use the unit: one block, or consecutive small blocks merged (gathered
    by the first one's forward, released after the last one's). Empty: the root unit, gathered by the
    model's forward."""
    params: list[torch.nn.Parameter] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)


LeafTest = Callable[[str, torch.nn.Module], bool]


def leaf_test(leaf_module: Mapping[str, Iterable[str]] | None) -> LeafTest:
    """Whether a module is a user-named unit: marked by set_z3_leaf_modules or matched by the config's
    zero_optimization.leaf_module (class name, full module name, or module-name suffix)."""
    spec = leaf_module or {}
    classes, names = set(spec.get("classes", ())), set(spec.get("names", ()))
    suffixes = tuple(spec.get("name_suffixes", ()))

    def test(name: str, module: torch.nn.Module) -> bool:
        cls = type(module)
        return (
            z3_leaf_module(module)
            or cls.__name__ in classes
            or f"{cls.__module__}.{cls.__qualname__}" in classes
            or name in names
            or bool(suffixes)
            and name.endswith(suffixes)
        )

    return test


def user_leaves(model: torch.nn.Module, is_leaf: LeafTest) -> list[tuple[str, torch.nn.Module]]:
    """The outermost modules the user named as units (flagged, or matched by the config), with their names."""
    return _outermost([(n, m) for n, m in model.named_modules() if m is not model and is_leaf(n, m)])


def _blocks(model: torch.nn.Module, is_leaf: LeafTest) -> list[tuple[str, torch.nn.Module]]:
    """User-named units if any module is named, else the elements of repeated block lists."""
    named = user_leaves(model, is_leaf)
    if named:
        return named
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        children = list(module.named_children())
        if (
            isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
            and len(children) >= 2
            and len({type(c) for _, c in children}) == 1
            and any(full_numel(p) for _, c in children for p in c.parameters())
        ):
            found += [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in children]
    return _outermost(found)


def _outermost(found: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    kept: list[tuple[str, torch.nn.Module]] = []
    for name, module in found:  # named_modules order: a parent comes before its descendants
        if not any(name.startswith(k + ".") for k, _ in kept):
            kept.append((name, module))
    return kept


def _merge_small(
    blocks: list[tuple[str, torch.nn.Module]], merge_below: int
) -> list[list[tuple[str, torch.nn.Module]]]:
    """Runs of consecutive sibling blocks (e.g. blocks.3, blocks.4) each under `merge_below` elements,
    merged until a run reaches that size: one all-gather and one reduce-scatter for the run instead
    of one per block, when each collective costs ~1 ms of latency whatever its size."""
    runs: list[list[tuple[str, torch.nn.Module]]] = []

    def numel(module: torch.nn.Module) -> int:
        return sum(full_numel(p) for p in module.parameters())

    def parent(name: str) -> str:
        return name.rpartition(".")[0]

    for name, module in blocks:
        run = runs[-1] if runs else None
        if (
            run is not None
            and merge_below > 0
            and numel(module) < merge_below
            and parent(run[0][0]) == parent(name)
            and all(numel(m) < merge_below for _, m in run)
            and sum(numel(m) for _, m in run) < merge_below
        ):
            run.append((name, module))
        else:
            runs.append([(name, module)])
    return runs


def _run_name(run: list[tuple[str, torch.nn.Module]]) -> str:
    if len(run) == 1:
        return run[0][0]
    return f"{run[0][0]}-{run[-1][0].rpartition('.')[2]}"


def plan_units(model: torch.nn.Module, is_leaf: LeafTest | None = None, merge_below: int = 0) -> list[UnitPlan]:
    """Units in registration order; the root unit (if it has parameters) comes first."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    runs = _merge_small(_blocks(model, is_leaf or leaf_test(None)), merge_below)
    blocks = [(name, module) for run in runs for name, module in run]
    run_of = [i for i, run in enumerate(runs) for _ in run]  # block index -> unit index
    owners: dict[int, set[int]] = {}  # id(param) -> indices of blocks that use it
    for i, (_, block) in enumerate(blocks):
        for p in block.parameters():
            owners.setdefault(id(p), set()).add(i)
    outside = {
        id(p)
        for n, p in model.named_parameters(remove_duplicate=False)
        if not any(n == b or n.startswith(b + ".") for b, _ in blocks)
    }
    root = UnitPlan("<root>", [])
    units = [UnitPlan(_run_name(run), [m for _, m in run]) for run in runs]
    for p in model.parameters():  # each parameter once, in registration order
        using = {run_of[i] for i in owners.get(id(p), set())}
        target = units[next(iter(using))] if len(using) == 1 and id(p) not in outside else root
        target.params.append(p)
        target.param_names.append(names[id(p)])
    return ([root] if root.params else []) + [u for u in units if u.params]
