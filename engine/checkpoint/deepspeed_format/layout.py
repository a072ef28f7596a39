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
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.checkpoint.deepspeed_format.safe_load import DeepSpeedObject, load_deepspeed_file
from engine.checkpoint.files import CheckpointError

Pieces = dict[str, list[dict[str, Any]]]
"""Parameter name -> its pieces in one rank's file: {"offset", "master" | "model", "exp_avg", ...}."""

# The keys of DeepSpeed's own in a model-states file; the others are the client_state it was given.
DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "csr_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "iteration",
        "universal_checkpoint_info",
    }
)
# torch's switches for how an optimizer step runs in DeepSpeed's process: no part of the training state.
_RUN_SWITCHES = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


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


@dataclass
class Converted:
    """A DeepSpeed checkpoint as the engine's pieces: what engine/checkpoint/store.py's load reads."""

    world_size: int
    stage: int
    params: dict[str, list[int]]
    """Every parameter's whole shape, trainable and frozen."""
    trainable: set[str]
    optim: list[Pieces]
    """Per rank: fp32 master pieces with their moments."""
    frozen: list[Pieces]
    """Per rank: stage-3 pieces of frozen parameters ({"offset", "model"})."""
    scalars: dict[int, dict[str, Any]]
    """Per optimizer group: the state not shaped like a master (Adam's step)."""
    whole: dict[str, torch.Tensor]
    """Buffers, and frozen parameters at stages 0-2."""
    head: dict[str, Any]
    """Counters, LR scheduler, loss scaler, param_groups, client_state: rank 0's model file's head."""
    aliases: dict[str, str] = field(default_factory=dict)


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
        return _convert_stage0(tag_dir, head, module, whole, world)
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
        _head(head, groups, _loss_scaler(osd.get("loss_scaler"), head)),
        _aliases(head),
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


def _moments(state: dict[str, Any], numel: int) -> dict[str, torch.Tensor]:
    """The optimizer state tensors laid like the flat partition (exp_avg, exp_avg_sq, ...). They may be
    longer than the saved partition: DeepSpeed drops the last rank's end padding from the fp32
    partition it saves, not from the moments."""
    return {k: v.reshape(-1) for k, v in state.items() if _like_partition(v, numel)}


def _scalar(state: dict[str, Any], numel: int) -> dict[str, Any]:
    """The state not shaped like the partition. Adam's step becomes torch's layout (a float32 scalar
    tensor, as torch.optim.Optimizer.load_state_dict makes it): DeepSpeed's FusedAdam saves a Python int,
    which torch's AdamW step refuses ("state_steps ... singleton tensors")."""
    found = {k: v for k, v in state.items() if not _like_partition(v, numel)}
    if isinstance(found.get("step"), (int, float)) and not isinstance(found["step"], bool):
        found["step"] = torch.tensor(float(found["step"]), dtype=torch.float32)
    return found


def _like_partition(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() >= numel and value.numel() > 1


def _piece(offset: int, flat: torch.Tensor, moments: dict[str, torch.Tensor], lo: int, n: int) -> dict[str, Any]:
    entry = {"offset": offset, "master": flat[lo : lo + n].float()}
    entry.update({k: v[lo : lo + n].float() for k, v in moments.items()})
    return entry


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
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed's stage 0 optimizer holds {sum(f.numel() for f in flats)} fp32 master elements "
            f"in {len(flats)} flat groups, the module's parameters {sum(sizes)}; the engine maps them by position, "
            "which needs the optimizer to have been given every parameter of the module "
            "(deepspeed.initialize(model_parameters=model.parameters()))"
        )
    pieces: Pieces = {}
    scalars: dict[int, dict[str, Any]] = {}
    params = iter(zip(names, sizes))
    for g, flat in enumerate(flats):
        flat = flat.reshape(-1)
        moments, offset = _moments(state.get(g, {}), flat.numel()), 0
        scalars[g] = _scalar(state.get(g, {}), flat.numel())
        while offset < flat.numel():
            name, n = next(params)
            if offset + n > flat.numel():
                raise CheckpointError(
                    f"{tag_dir}: parameter {name!r} crosses the end of DeepSpeed's flat fp32 group {g}; the "
                    "optimizer's param groups were not the module's parameters in order"
                )
            pieces[name] = [_piece(0, flat, moments, offset, n)]
            offset += n
    scaler = _stage0_loss_scaler(opt, head)
    return Converted(
        world,
        0,
        {n: list(module[n].shape) for n in names},
        set(names),
        [pieces, *[{} for _ in range(world - 1)]],
        [{} for _ in range(world)],
        scalars,
        whole,
        _head(head, groups, scaler),
        _aliases(head),
    )


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
            moments = _moments(state, flat.numel())
            scalars.setdefault(g, _scalar(state, flat.numel()))
            for name, start, numel in spans:
                lo, hi = max(start, r * size), min(start + numel, r * size + flat.numel())
                if lo < hi:
                    pieces[r].setdefault(name, []).append(_piece(lo - start, flat, moments, lo - r * size, hi - lo))
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
        moments = [_moments(states.get(g, {}), f.numel()) for g, f in enumerate(flats)]
        for g, f in enumerate(flats):
            scalars.setdefault(g, _scalar(states.get(g, {}), f.numel()))
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
                pieces[r].setdefault(name, []).append(_piece(r * cut, flats[group], moments[group], offset, held))
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


# ---------------------------------------------------------------------------------------- stage 0
def _convert_stage0(
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
            raise CheckpointError(
                f"{tag_dir}: DeepSpeed's stage 0 optimizer holds {len(masters)} fp32 masters, the module "
                f"{len(names)} parameters; the engine maps them by position, which needs the optimizer to have "
                "been given every parameter of the module (deepspeed.initialize(model_parameters="
                "model.parameters()))"
            )
    state: dict[int, dict[str, Any]] = opt.get("state", {})
    groups = opt.get("param_groups", [])
    numbered = [i for g in groups for i in g.get("params", [])]
    if numbered and len(numbered) != len(names):
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed's stage 0 optimizer holds {len(numbered)} parameters, the module "
            f"{len(names)}; the engine maps them by position, which needs the optimizer to have been "
            "given every parameter of the module (deepspeed.initialize(model_parameters="
            "model.parameters()))"
        )
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
        scalars.setdefault(index.get(i, 0), _scalar(s, flat.numel()))
        pieces[name] = [_piece(0, flat, _moments(s, flat.numel()), 0, flat.numel())]
    rest: list[Pieces] = [{} for _ in range(world - 1)]
    shapes = {n: list(module[n].shape) for n in names}
    return Converted(
        world,
        0,
        shapes,
        set(names),
        [pieces, *rest],
        [{} for _ in range(world)],
        scalars,
        whole,
        _head(head, groups, scaler),
        _aliases(head),
    )


def _stage0_loss_scaler(opt: dict[str, Any], head: dict[str, Any]) -> dict[str, Any] | None:
    """FP16_UnfusedOptimizer's loss scale (plain keys of its state dict `opt`) as the engine's LossScaler
    state: fp16 only (bf16 has none). It saves no hysteresis count: DeepSpeed's load starts it afresh at
    the config's fp16.hysteresis, and so does this."""
    config = head.get("ds_config")
    fp16 = config.get("fp16") if isinstance(config, dict) else None
    if not (isinstance(fp16, dict) and fp16.get("enabled")):
        return None
    return _scaler_state(opt, head, bool(opt.get("dynamic_loss_scale", False)), int(fp16.get("hysteresis", 2)))


# ------------------------------------------------------------------------------------------- head
def _head(head: dict[str, Any], groups: list[dict[str, Any]], loss_scaler: dict[str, Any] | None) -> dict[str, Any]:
    """What restore.load reads from rank 0's model file, in the engine's terms."""
    config = head.get("ds_config")
    config = config if isinstance(config, dict) else {}
    steps = int(head.get("global_steps", 0))
    return {
        "engine": {
            "global_steps": steps,
            "global_samples": int(head.get("global_samples", 0)),
            "skipped_steps": int(head.get("skipped_steps", 0)),
            "micro_steps": steps * int(config.get("gradient_accumulation_steps", 1) or 1),
        },
        "lr_scheduler": head.get("lr_scheduler"),
        "loss_scaler": loss_scaler,
        "param_groups": [{k: v for k, v in g.items() if k not in _RUN_SWITCHES} for g in groups],
        "client_state": {k: v for k, v in head.items() if k not in DEEPSPEED_KEYS},
    }


def _loss_scaler(saved: Any, head: dict[str, Any]) -> dict[str, Any] | None:
    """DeepSpeed's LossScaler / DynamicLossScaler as the engine's LossScaler state dict (the same
    update rule: cur_iter, last_overflow_iter and cur_hysteresis mean what the engine's fields do)."""
    if not isinstance(saved, DeepSpeedObject):
        return None
    return _scaler_state(saved, head, bool(saved.get("dynamic", False)), int(saved.get("cur_hysteresis", 1)))


def _scaler_state(saved: Any, head: dict[str, Any], dynamic: bool, hysteresis: int) -> dict[str, Any]:
    """The engine's LossScaler state dict from DeepSpeed's cur_scale, cur_iter and last_overflow_iter
    (in `saved`, a LossScaler stand-in or FP16_UnfusedOptimizer's state dict: the same names)."""
    return {
        "dynamic": dynamic,
        "scale": float(saved.get("cur_scale", 1.0)),
        "iterations": int(saved.get("cur_iter", 0)),
        "skipped_steps": int(head.get("skipped_steps", 0)),
        "last_overflow_iter": int(saved.get("last_overflow_iter", -1) if dynamic else -1),
        "hysteresis_left": hysteresis if dynamic else 1,
    }


def _aliases(head: dict[str, Any]) -> dict[str, str]:
    """Tied parameters: DeepSpeed's shared_params maps each further name to the saved one."""
    shared = head.get("shared_params")
    return {str(k): str(v) for k, v in shared.items()} if isinstance(shared, dict) else {}
