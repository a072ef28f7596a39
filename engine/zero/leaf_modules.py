"""Stage-3 leaf modules: DeepSpeed's `deepspeed.utils.z3_leaf_module` surface.

A module flagged as a leaf (`module._z3_leaf = True`, DeepSpeed's flag) is one stage-3 gather unit with
all its descendants (engine/zero/stage3/unit_plan.py): its parameters are gathered when it starts, even
when its children run in an order that changes from step to step (the experts of a mixture of experts).
Flags are set before engine.initialize, by class (a type, or a class name: `"MixtralSparseMoeBlock"`
or its qualified `"transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"`), by module
name (`model.named_modules()`'s), or by name suffix. The config's `zero_optimization.leaf_module`
reaches the same units without flags.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

LEAF = "_z3_leaf"
"""DeepSpeed's flag on a module that is one stage-3 unit."""

_IN_LEAF = "ds_z3_leaf_module"
"""DeepSpeed's mark on a parameter of a leaf module (z3_leaf_parameter)."""


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether `module` is flagged as a leaf."""
    return bool(getattr(module, LEAF, False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether `param` was marked as belonging to a leaf module."""
    return hasattr(param, _IN_LEAF)


def mark_leaf_parameters(leaf: torch.nn.Module) -> None:
    """Mark every parameter of `leaf` as a leaf module's (stage 3 does, as DeepSpeed's does)."""
    for p in leaf.parameters():
        setattr(p, _IN_LEAF, leaf)


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` flagged as leaves, in `model.modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(module: torch.nn.Module, flag: bool) -> None:
    """Flag (or unflag) one module."""
    setattr(module, LEAF, flag)


def _class_matches(module: torch.nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_classes(
    model: torch.nn.Module, classes: Iterable[type | str], flag: bool, raise_if_not_found: bool, caller: str
) -> list[torch.nn.Module]:
    wanted = list(classes)
    odd = [c for c in wanted if not isinstance(c, (type, str))]
    if odd:
        raise TypeError(
            f"{caller}: leaf_module_classes takes module classes or class names (str), got "
            f"{', '.join(f'{c!r} ({type(c).__name__})' for c in odd)}"
        )
    found = [m for m in model.modules() if any(_class_matches(m, c) for c in wanted)]
    if not found and raise_if_not_found:
        names = [c.__name__ if isinstance(c, type) else c for c in wanted]
        raise ValueError(
            f"{caller}: no submodule of {type(model).__name__} is of the classes {names} (a class, its name, or "
            "its module-qualified name); pass raise_if_not_found=False to allow none"
        )
    for m in found:
        set_z3_leaf_module(m, flag)
    return found


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Iterable[type | str], raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Flag every submodule of one of `leaf_module_classes` (types or class names) as a leaf; returns
    them. Call before engine.initialize."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found, "set_z3_leaf_modules")


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Iterable[type | str], raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Clear the flag of every submodule of one of `leaf_module_classes`; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found, "unset_z3_leaf_modules")


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module, module_names: Iterable[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules named in `module_names` (`model.named_modules()` names); returns (the modules,
    the names that matched none)."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
            continue
        set_z3_leaf_module(module, flag)
        found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_name: {type(model).__name__} has no module named {missing} (names as "
            "model.named_modules() gives them); pass raise_if_not_found=False to skip them"
        )
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module, module_name_suffixes: Iterable[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag every module whose `model.named_modules()` name ends with one of `module_name_suffixes`;
    returns (the modules, each once, and the suffixes that matched none)."""
    named = list(model.named_modules())
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        matched = [m for name, m in named if name.endswith(suffix)]
        if not matched:
            missing.append(suffix)
        for m in matched:
            set_z3_leaf_module(m, flag)
            found.setdefault(id(m), m)
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_suffix: no module name of {type(model).__name__} ends with {missing}; pass "
            "raise_if_not_found=False to skip them"
        )
    return list(found.values()), missing
