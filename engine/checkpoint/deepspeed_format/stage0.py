"""DeepSpeed's stage 0 checkpoints: no ZeRO partitions, the optimizer's state dict in the model file.

In fp32 the masters are the module's parameters and the state dict is the torch optimizer's. In fp16 and
bf16 DeepSpeed wraps the optimizer: FP16_UnfusedOptimizer (any torch optimizer) keeps a list of fp32
masters per param group, FP16_Optimizer (DeepSpeed's FusedAdam) one flat fp32 master per group; both keep
the loss scale in plain keys. None records which parameters a group holds: they are read as the module's
parameters in order, as DeepSpeed numbers them when given model.parameters().
"""

from __future__ import annotations

from typing import Any

import torch

from engine.checkpoint.deepspeed_format.converted import (
    Converted,
    Pieces,
    aliases_of,
    converted_head,
    moments_of,
    piece,
    scalar_state,
    scaler_state,
)
from engine.checkpoint.files import CheckpointError


def convert_stage0(
    tag_dir: str, head: dict[str, Any], module: dict[str, Any], whole: dict[str, torch.Tensor], world: int
) -> Converted:
    """Stage 0: the model file holds the module and the optimizer's state dict, whose parameters are
    numbered in the order the optimizer was given them: module.parameters()'s order. In fp32 that is
    the torch optimizer's own, and the masters are the module's parameters. In fp16 and bf16 it is
    DeepSpeed's FP16_UnfusedOptimizer's (any torch optimizer): the fp32 masters in `fp32_groups` (a
    list per param group, in the groups' order), the torch optimizer's state dict over them in
    `optimizer_state_dict`, and the loss scale in plain keys (cur_scale, cur_iter, ...); or, with
    DeepSpeed's FusedAdam, its fused FP16_Optimizer's (_convert_stage0_fused)."""
    names = [n for n in module if n not in whole]
    opt = head.get("optimizer")
    opt = opt if isinstance(opt, dict) else {}
    if "fp32_groups_flat" in opt:
        return _convert_stage0_fused(tag_dir, head, opt, module, names, whole, world)
    masters: list[torch.Tensor] | None = None
    scaler = None
    if "fp32_groups" in opt:
        scaler = _stage0_loss_scaler(opt, head)
        found = opt["fp32_groups"]
        if not (isinstance(found, list) and all(isinstance(g, list) for g in found)):
            raise CheckpointError(
                f"{tag_dir}: DeepSpeed's fp32_groups is not a list per param group; the file is corrupted"
            )
        masters = [t for group in found for t in group]
        if not all(torch.is_tensor(t) for t in masters):
            raise CheckpointError(f"{tag_dir}: DeepSpeed's fp32_groups holds a non-tensor; the file is corrupted")
        opt = opt.get("optimizer_state_dict", {})
        if len(masters) != len(names):
            raise _not_by_position(tag_dir, f"{len(masters)} fp32 masters", f"{len(names)} parameters")
    state: dict[int, dict[str, Any]] = opt.get("state", {})
    groups = opt.get("param_groups", [])
    numbered = [i for g in groups for i in g.get("params", [])]
    if numbered and len(numbered) != len(names):
        raise _not_by_position(tag_dir, f"{len(numbered)} parameters", f"{len(names)}")
    pieces: Pieces = {}
    scalars: dict[int, dict[str, Any]] = {}
    index = {i: g for g, group in enumerate(groups) for i in group.get("params", [])}
    for i, name in enumerate(names):
        flat = module[name].reshape(-1) if masters is None else masters[i].reshape(-1)
        if flat.numel() != module[name].numel():
            raise CheckpointError(
                f"{tag_dir}: DeepSpeed's fp32 master number {i} has {flat.numel()} elements, parameter {name!r} "
                f"{module[name].numel()}; the optimizer was not given the module's parameters in their order"
            )
        s = state.get(i, {})
        scalars.setdefault(index.get(i, 0), scalar_state(s, flat.numel()))
        pieces[name] = [piece(0, flat, moments_of(s, flat.numel()), 0, flat.numel())]
    return _replicated(world, module, names, pieces, scalars, whole, converted_head(head, groups, scaler), head)


def _stage0_loss_scaler(opt: dict[str, Any], head: dict[str, Any]) -> dict[str, Any] | None:
    """FP16_UnfusedOptimizer's loss scale (plain keys of its state dict `opt`) as the engine's LossScaler
    state: fp16 only (bf16 has none). It saves no hysteresis count: DeepSpeed's load starts it afresh at
    the config's fp16.hysteresis, and so does this."""
    config = head.get("ds_config")
    fp16 = config.get("fp16") if isinstance(config, dict) else None
    if not (isinstance(fp16, dict) and fp16.get("enabled")):
        return None
    return scaler_state(opt, head, bool(opt.get("dynamic_loss_scale", False)), int(fp16.get("hysteresis", 2)))


def _convert_stage0_fused(
    tag_dir: str,
    head: dict[str, Any],
    opt: dict[str, Any],
    module: dict[str, Any],
    names: list[str],
    whole: dict[str, torch.Tensor],
    world: int,
) -> Converted:
    """Stage 0 in fp16/bf16 with DeepSpeed's FusedAdam: its fused FP16_Optimizer keeps one flat fp32
    master per param group (`fp32_groups_flat`: the group's parameters flattened in order, no padding),
    FusedAdam's state over each flat under the group's number, and the loss scale in the same plain keys
    as FP16_UnfusedOptimizer. The file does not say which parameters a group holds: as for the unfused
    optimizer, the groups are read as the module's parameters in order, which must end exactly where
    each flat does."""
    flats = opt["fp32_groups_flat"]
    if not (isinstance(flats, list) and all(torch.is_tensor(f) for f in flats)):
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed's fp32_groups_flat is not a list of tensors; the file is corrupted"
        )
    osd = opt.get("optimizer_state_dict", {})
    state: dict[int, dict[str, Any]] = osd.get("state", {})
    groups = osd.get("param_groups", [])
    sizes = [module[n].numel() for n in names]
    if sum(sizes) != sum(f.numel() for f in flats):
        held = f"{sum(f.numel() for f in flats)} fp32 master elements in {len(flats)} flat groups"
        raise _not_by_position(tag_dir, held, f"{sum(sizes)} in its parameters")
    pieces: Pieces = {}
    scalars: dict[int, dict[str, Any]] = {}
    params = iter(zip(names, sizes))
    for g, flat in enumerate(flats):
        flat = flat.reshape(-1)
        moments, offset = moments_of(state.get(g, {}), flat.numel()), 0
        scalars[g] = scalar_state(state.get(g, {}), flat.numel())
        while offset < flat.numel():
            name, n = next(params)
            if offset + n > flat.numel():
                raise CheckpointError(
                    f"{tag_dir}: parameter {name!r} crosses the end of DeepSpeed's flat fp32 group {g}; the "
                    "optimizer's param groups were not the module's parameters in order"
                )
            pieces[name] = [piece(0, flat, moments, offset, n)]
            offset += n
    head_out = converted_head(head, groups, _stage0_loss_scaler(opt, head))
    return _replicated(world, module, names, pieces, scalars, whole, head_out, head)


def _replicated(
    world: int,
    module: dict[str, Any],
    names: list[str],
    pieces: Pieces,
    scalars: dict[int, dict[str, Any]],
    whole: dict[str, torch.Tensor],
    converted: dict[str, Any],
    head: dict[str, Any],
) -> Converted:
    """A stage-0 conversion: every master and its state in rank 0's pieces (each rank held all of them).
    `converted`: the engine's head (converted_head); `head`: DeepSpeed's model file's, for its aliases."""
    return Converted(
        world,
        0,
        {n: list(module[n].shape) for n in names},
        set(names),
        [pieces, *[{} for _ in range(world - 1)]],
        [{} for _ in range(world)],
        scalars,
        whole,
        converted,
        aliases_of(head),
    )


def _not_by_position(tag_dir: str, held: str, module_has: str) -> CheckpointError:
    return CheckpointError(
        f"{tag_dir}: DeepSpeed's stage 0 optimizer holds {held}, the module {module_has}; the engine maps them "
        "by position, which needs the optimizer to have been given every parameter of the module "
        "(deepspeed.initialize(model_parameters=model.parameters()))"
    )
