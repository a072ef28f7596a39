"""DeepSpeed's checkpoint layout, turned into the engine's named pieces (engine/zero/records.py).

    <dir>/latest                                         the tag (text), as the engine writes it too
    <dir>/<tag>/mp_rank_00_model_states.pt               stages 0-2: the module (buffers, frozen parameters,
                                                         model-dtype weights), counters, LR scheduler,
                                                         param_shapes, client state keys; stage 0 also
                                                         the torch optimizer's state dict
    <dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: the same, per data-parallel rank
                                                         (parameters empty; frozen ones as fragments)
    <dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   stages 1-3: rank r's fp32 partition
                                                         of every group and its Adam moments

# [Note: where DeepSpeed's partitions put a parameter]
Stages 1-2 lay each optimizer group's parameters end to end (param_shapes order, plus
param_alignment_paddings) in one flat vector cut into equal partitions; rank r holds elements
[r*P, r*P + len) where P is rank 0's partition length (only the last rank's is shorter: DeepSpeed
drops the group's end padding when it saves). Stage 3 cuts every parameter on its own into
ceil(numel / world) elements per rank (the last rank's padded) and lays a rank's cuts end to end,
in param_shapes order, across its groups' flat tensors. zero_to_fp32 reconstructs both the same way.
Either way a rank's file becomes pieces (name, offset within the parameter, numel) of the fp32
master and its moments, which the engine's loading reshards to any world size and stage.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from engine.checkpoint.deepspeed_format.converted import (
    Converted,
    Pieces,
    aliases_of,
    converted_head,
    loss_scaler_state,
    moments_of,
    piece,
    scalar_state,
)
from engine.checkpoint.deepspeed_format.safe_load import load_deepspeed_file
from engine.checkpoint.deepspeed_format.stage0 import convert_stage0
from engine.checkpoint.files import CheckpointError


def model_states_name(stage3_rank: int | None, mp_rank: int = 0) -> str:
    return (
        f"mp_rank_{mp_rank:02d}_model_states.pt"
        if stage3_rank is None
        else f"zero_pp_rank_{stage3_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    )


def optim_states_name(rank: int, bf16: bool, mp_rank: int = 0) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def is_deepspeed_tag_dir(tag_dir: str) -> bool:
    """A tag directory written by DeepSpeed (its model-states file, no manifest of the engine's)."""
    return not os.path.exists(os.path.join(tag_dir, "manifest.json")) and any(
        os.path.isfile(os.path.join(tag_dir, model_states_name(r))) for r in (None, 0)
    )


def mp_world_size(tag_dir: str) -> int:
    """The tensor (model) parallel size DeepSpeed saved at: how many mp_rank_XX files it wrote."""
    mp = 0
    while any(os.path.isfile(os.path.join(tag_dir, model_states_name(r, mp))) for r in (None, 0)):
        mp += 1
    return mp


def convert(tag_dir: str, mp_rank: int = 0) -> Converted:
    """Read the files of one tensor-parallel rank (all of them without tensor parallelism) of a
    DeepSpeed tag directory and describe them as the engine's pieces."""
    stage3 = os.path.isfile(os.path.join(tag_dir, model_states_name(0, mp_rank)))
    head = load_deepspeed_file(os.path.join(tag_dir, model_states_name(0 if stage3 else None, mp_rank)))
    _check_supported(tag_dir, head)
    world = _int(head, "dp_world_size", tag_dir)
    module = _mapping(head.get("module"), "module", tag_dir)
    buffer_names = set(head.get("buffer_names") or [])
    whole = {n: t for n, t in module.items() if n in buffer_names}
    if not stage3 and head.get("param_shapes") is None:
        return convert_stage0(tag_dir, head, module, whole, world)
    optim = [_optim_states(tag_dir, r, world, mp_rank) for r in range(world)]
    osd = _mapping(optim[0].get("optimizer_state_dict"), "optimizer_state_dict", tag_dir)
    stage = int(osd.get("zero_stage", 3 if stage3 else 2))
    shapes = _param_shapes(head, tag_dir)
    frozen_shapes = {n: list(s) for n, s in (head.get("frozen_param_shapes") or {}).items()}
    if stage3:
        rank_heads = [head] + [
            load_deepspeed_file(os.path.join(tag_dir, model_states_name(r, mp_rank))) for r in range(1, world)
        ]
        pieces, scalars, groups = _stage3_pieces(tag_dir, optim, shapes)
        frozen = _stage3_frozen(rank_heads, frozen_shapes, world)
    else:
        pieces, scalars, groups = _stage12_pieces(tag_dir, optim, shapes)
        frozen = [{} for _ in range(world)]
        whole.update({n: module[n] for n in frozen_shapes if n in module})
    params = {n: list(s) for group in shapes for n, s in group.items()} | frozen_shapes
    trainable = {n for group in shapes for n in group}
    return Converted(
        world,
        stage,
        params,
        trainable,
        pieces,
        frozen,
        scalars,
        whole,
        converted_head(head, groups, loss_scaler_state(osd.get("loss_scaler"), head)),
        aliases_of(head),
    )


def _check_supported(tag_dir: str, head: dict[str, Any]) -> None:
    if any(name.startswith("layer_") for name in os.listdir(tag_dir)):
        raise CheckpointError(
            f"{tag_dir} was saved by DeepSpeed's pipeline engine (layer_*-model_states.pt files), "
            "which this engine does not read"
        )


def _int(data: dict[str, Any], key: str, where: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(
            f"{where}: DeepSpeed's model states have {key}={value!r}, not a positive integer; the "
            "checkpoint is corrupted or not DeepSpeed's"
        )
    return value


def _mapping(value: Any, key: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{where}: DeepSpeed's {key!r} is a {type(value).__name__}, not a dict; the checkpoint "
            "is corrupted or from a DeepSpeed version this engine does not read"
        )
    return value


def _optim_states(tag_dir: str, rank: int, world: int, mp_rank: int) -> dict[str, Any]:
    """Rank `rank`'s optimizer file, bf16_-prefixed or not, refused by rank and name when missing."""
    names = [optim_states_name(rank, bf16, mp_rank) for bf16 in (False, True)]
    found = next((n for n in names if os.path.isfile(os.path.join(tag_dir, n))), None)
    if found is None:
        raise CheckpointError(
            f"{tag_dir}: the optimizer states of data-parallel rank {rank} ({names[0]} or "
            f"{names[1]}) are missing; DeepSpeed saved this checkpoint at {world} data-parallel "
            "ranks (dp_world_size) and each wrote one; copy the whole tag directory"
        )
    return load_deepspeed_file(os.path.join(tag_dir, found))


def _param_shapes(head: dict[str, Any], tag_dir: str) -> list[dict[str, list[int]]]:
    shapes = head.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed's param_shapes is {type(shapes).__name__}, not a list of dicts "
            "per optimizer group; the checkpoint is corrupted"
        )
    return [{n: list(s) for n, s in group.items()} for group in shapes]


# ------------------------------------------------------------------------------------- stages 1-2
def _stage12_pieces(
    tag_dir: str, optim: list[dict[str, Any]], shapes: list[dict[str, list[int]]]
) -> tuple[list[Pieces], dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """See [Note: where DeepSpeed's partitions put a parameter]."""
    osds = [o["optimizer_state_dict"] for o in optim]
    partitions = [_list(o, "single_partition_of_fp32_groups", tag_dir) for o in osds]
    states = [o.get("base_optimizer_state", {}).get("state", {}) for o in osds]
    paddings = osds[0].get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
    pieces: list[Pieces] = [{} for _ in optim]
    scalars: dict[int, dict[str, Any]] = {}
    for g, group in enumerate(shapes):
        spans = _spans(group, paddings[g] if g < len(paddings) else [0] * len(group))
        size = partitions[0][g].numel()  # every rank's but the last one's; the last one's end padding is not saved
        for r, parts in enumerate(partitions):
            flat = parts[g].reshape(-1)
            state = states[r].get(g, {})
            moments = moments_of(state, flat.numel())
            scalars.setdefault(g, scalar_state(state, flat.numel()))
            for name, start, numel in spans:
                lo, hi = max(start, r * size), min(start + numel, r * size + flat.numel())
                if lo < hi:
                    pieces[r].setdefault(name, []).append(piece(lo - start, flat, moments, lo - r * size, hi - lo))
    return pieces, scalars, osds[0].get("base_optimizer_state", {}).get("param_groups", [])


def _spans(group: dict[str, list[int]], paddings: list[int]) -> list[tuple[str, int, int]]:
    """(name, first element in the group's flat vector, numel) of every parameter of a group."""
    spans, offset = [], 0
    for (name, shape), pad in zip(group.items(), paddings):
        spans.append((name, offset, math.prod(shape)))
        offset += math.prod(shape) + pad
    return spans


def _list(osd: dict[str, Any], key: str, tag_dir: str) -> list[torch.Tensor]:
    value = osd.get(key)
    if not isinstance(value, list) or not all(torch.is_tensor(t) for t in value):
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed's optimizer state has no list of tensors {key!r}; the checkpoint "
            "is corrupted or from a DeepSpeed version this engine does not read"
        )
    return value


# ---------------------------------------------------------------------------------------- stage 3
def _stage3_pieces(
    tag_dir: str, optim: list[dict[str, Any]], shapes: list[dict[str, list[int]]]
) -> tuple[list[Pieces], dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """See [Note: where DeepSpeed's partitions put a parameter]."""
    world = len(optim)
    order = [(n, math.prod(s)) for group in shapes for n, s in group.items()]
    pieces: list[Pieces] = [{} for _ in optim]
    scalars: dict[int, dict[str, Any]] = {}
    for r, o in enumerate(optim):
        osd = o["optimizer_state_dict"]
        flats = [t.reshape(-1) for t in _list(osd, "fp32_flat_groups", tag_dir)]
        states = osd.get("optimizer_state_dict", {}).get("state", {})
        moments = [moments_of(states.get(g, {}), f.numel()) for g, f in enumerate(flats)]
        for g, f in enumerate(flats):
            scalars.setdefault(g, scalar_state(states.get(g, {}), f.numel()))
        group, offset = 0, 0  # position in the rank's flats
        for name, numel in order:
            cut = math.ceil(numel / world)
            while group < len(flats) and offset >= flats[group].numel():
                group, offset = group + 1, offset - flats[group].numel()
            held = max(0, min(cut, numel - r * cut))  # the last ranks' cuts are (partly) padding
            if group >= len(flats) or offset + cut > flats[group].numel():
                raise CheckpointError(
                    f"{tag_dir}: rank {r}'s fp32 partition is too short for parameter {name!r} "
                    "(param_shapes lists more than the file holds); the checkpoint is corrupted"
                )
            if held:
                pieces[r].setdefault(name, []).append(piece(r * cut, flats[group], moments[group], offset, held))
            offset += cut
    param_groups = optim[0]["optimizer_state_dict"].get("optimizer_state_dict", {}).get("param_groups", [])
    return pieces, scalars, param_groups


def _stage3_frozen(rank_heads: list[dict[str, Any]], shapes: dict[str, list[int]], world: int) -> list[Pieces]:
    """Each rank's fragment of every frozen parameter (its own dtype), cut as trainable ones are."""
    pieces: list[Pieces] = [{} for _ in rank_heads]
    for r, head in enumerate(rank_heads):
        fragments = head.get("frozen_param_fragments") or {}
        for name, shape in shapes.items():
            numel = math.prod(shape)
            cut = math.ceil(numel / world)
            held = max(0, min(cut, numel - r * cut))
            if held and name in fragments:
                pieces[r][name] = [{"offset": r * cut, "model": fragments[name].reshape(-1)[:held]}]
    return pieces
