"""Normalise `model_parameters` into optimizer param groups, refusing what would train wrongly."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def normalize_param_groups(model_parameters: Iterable[Any] | None, module: torch.nn.Module) -> list[dict[str, Any]]:
    """Return param-group dicts (caller's per-group options kept), empty groups dropped.

    Refuses a parameter listed in two groups (it would be stepped twice) and a parameter that is
    not part of the module (its gradient would never be reduced across ranks, so ranks diverge).
    """
    if model_parameters is None:
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if all(isinstance(item, dict) for item in items):
        groups = [
            dict(item, params=list(item["params"]) if not torch.is_tensor(item["params"]) else [item["params"]])
            for item in items
        ]
    elif all(torch.is_tensor(item) for item in items):
        groups = [{"params": items}]
    else:
        raise TypeError(
            "model_parameters must be an iterable of parameters or of param-group dicts "
            "({'params': [...], 'lr': ...}), not a mix"
        )
    groups = [g for g in groups if g["params"]]

    in_module = {id(p) for p in module.parameters()}
    seen: dict[int, int] = {}
    for index, group in enumerate(groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is in param groups {seen[id(p)]} "
                    f"and {index}; each parameter may appear in one group only"
                )
            if id(p) not in in_module:
                raise ValueError(
                    f"param group {index} holds a parameter of shape {tuple(p.shape)} that is "
                    "not part of the model; its gradient would never be reduced across ranks"
                )
            seen[id(p)] = index
    return groups
