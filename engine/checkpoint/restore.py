"""load_checkpoint: fills a TrainingState from a checkpoint saved at any world size, stage and layout
(store.py writes it; see its docstring for the format and why every rank reads only the pieces that
overlap what it holds now). DeepSpeed's own checkpoints are read through deepspeed_format/ the same way.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from engine import comm
from engine.checkpoint.client_state import restore_client_state
from engine.checkpoint.deepspeed_format import open_reader
from engine.checkpoint.files import (
    CheckpointError,
    model_file,
    optim_file,
    resolve_tag_dir,
    tp_section,
)
from engine.checkpoint.piece_reader import PieceReader
from engine.checkpoint.rng import set_rng_state
from engine.checkpoint.store import managed_ids
from engine.checkpoint.tensor_parallel import CheckpointNames, reader_for
from engine.checkpoint.training_state import Counters, LoadResult, Stateful, TrainingState
from engine.monitor.log import get_logger
from engine.zero.records import ShardRecord

logger = get_logger()


def load(
    state: TrainingState,
    load_dir: str,
    tag: str | None,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> LoadResult:
    """Fills the state's module, optimizer, LR scheduler and loss scaler (as the flags say) and this
    process's RNGs from load_dir/<tag> (tag None: the one `latest` names). The saved counters come back
    in the result, for the caller to set."""
    rank = comm.get_rank()
    started = time.perf_counter()
    tag_dir = resolve_tag_dir(load_dir, tag)
    names = CheckpointNames.of(state.module, state.parallel)
    # The engine's own layout, or DeepSpeed's (deepspeed_format/).
    reader = open_reader(tag_dir, state.module, names.whole_shapes(state.module))
    manifest = reader.manifest
    reader = reader_for(reader, names, state.module)  # re-cuts slices saved at another tensor-parallel size
    records = names.for_loading(state.stage.checkpoint_shards())
    optimizer = state.optimizer if load_optimizer_states and not load_module_only else None

    _fill_records(reader, records, optimizer, load_module_strict)
    _fill_whole_tensors(reader, state.module, names, load_module_strict)
    head = reader.file(model_file(0))
    if optimizer is not None:
        _restore_scalar_state(reader, records, optimizer)
        _restore_param_groups(optimizer, head)
    if load_lr_scheduler_states and not load_module_only:
        _restore(state.lr_scheduler, head.get("lr_scheduler"))
    counters = None
    if not load_module_only:
        _restore(state.loss_scaler, head.get("loss_scaler"))
        counters = _saved_counters(head)
        _restore_rng(reader, rank)
    comm.barrier()
    if rank == 0:
        logger.info(
            "loaded checkpoint %s (saved at world size %d, tensor-parallel size %d, stage %d) in %.2f s",
            tag_dir,
            manifest["world_size"],
            tp_section(manifest)["tp_size"],
            manifest["stage"],
            time.perf_counter() - started,
        )
    client_state = restore_client_state(dict(head.get("client_state") or {}), os.path.join(tag_dir, model_file(0)))
    return LoadResult(tag_dir, client_state, counters)


def _fill_records(
    reader: PieceReader, records: list[ShardRecord], optimizer: torch.optim.Optimizer | None, strict: bool
) -> None:
    """Every record's tensor (and, given the optimizer, its state) from the saved pieces of the same names."""
    missing: list[str] = []
    for record in records:
        missing.extend(_fill_record(reader, record, optimizer))
    if missing and strict:
        raise CheckpointError(
            f"checkpoint {reader.tag_dir} has no values for parameters {sorted(set(missing))[:5]}"
            f"{_excluded(reader)}; pass load_module_strict=False to keep their current values"
        )


def _excluded(reader: PieceReader) -> str:
    """Why parameters may be missing from a checkpoint, when it says so."""
    return (
        " (it was saved with exclude_frozen_parameters=True: frozen parameters were not written)"
        if reader.manifest.get("exclude_frozen_parameters")
        else ""
    )


def _fill_record(reader: PieceReader, record: ShardRecord, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """One record, its pieces read into a flat copy and copied in at once; returns the names of the
    pieces the checkpoint has no values for. The copy starts from the record's current values, so what
    the checkpoint lacks (a frozen parameter saved with exclude_frozen_parameters, loaded with
    load_module_strict=False) keeps them instead of taking uninitialised memory."""
    flat = record.tensor.detach().reshape(-1).clone()
    states = _state_to_fill(reader, record, optimizer) if record.opt_group is not None and optimizer is not None else {}
    state_flats = {k: v.detach().reshape(-1).clone() for k, v in states.items()}
    missing: list[str] = []
    for piece in record.pieces:
        kind = _saved_kind(reader, record, piece.name)
        if not reader.has(piece.name, kind):
            missing.append(piece.name)
            continue
        window = slice(piece.tensor_offset, piece.tensor_offset + piece.numel)
        reader.read(
            piece.name, kind, "master" if kind == "optim" else "model", piece.param_offset, piece.numel, flat[window]
        )
        for k, sf in state_flats.items():
            reader.read(piece.name, kind, k, piece.param_offset, piece.numel, sf[window])
    with torch.no_grad():
        record.tensor.copy_(flat.view(record.tensor.shape).to(record.tensor.dtype))
        for k, v in states.items():
            v.copy_(state_flats[k].view(v.shape))
    return missing


def _saved_kind(reader: PieceReader, record: ShardRecord, name: str) -> str:
    """Which files hold the values of a record's piece of `name`: "optim" (fp32 master pieces) in a
    trainable record; in a frozen one "model", unless the checkpoint saved that parameter as trainable
    (per piece: a frozen record, e.g. a stage-3 group of an engine without optimizer, may hold
    parameters saved either way)."""
    if record.opt_group is not None:
        return "optim"
    return "model" if reader.has(name, "model") else "optim"


def _state_to_fill(
    reader: PieceReader, record: ShardRecord, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """The master's optimizer state tensors under the saved state's keys, made where missing (torch
    creates Adam's state at the first step: a fresh engine has none). A record with no pieces on this rank (its
    slice is all padding: a small stage-3 unit over many ranks) still gets them, zeros, under the keys any
    trainable parameter was saved with: the step's scalars are restored for it too, and Adam with a `step` but
    no `exp_avg` fails (found: a stage-3 checkpoint that loaded but could not be trained on)."""
    state = optimizer.state.setdefault(record.tensor, {})
    states: dict[str, torch.Tensor] = {}
    keys = reader.state_keys(record.pieces[0].name) if record.pieces else _any_state_keys(reader)
    for k in keys:
        if not (torch.is_tensor(state.get(k)) and state[k].shape == record.tensor.shape):
            state[k] = torch.zeros_like(record.tensor, memory_format=torch.contiguous_format)
        states[k] = state[k]
    return states


def _any_state_keys(reader: PieceReader) -> list[str]:
    """The optimizer state keys saved with the first trainable parameter the checkpoint has ([] if none)."""
    for name, kinds in reader.where.items():
        if "optim" in kinds:
            return reader.state_keys(name)
    return []


def _fill_whole_tensors(reader: PieceReader, module: torch.nn.Module, names: CheckpointNames, strict: bool) -> None:
    """Whole tensors this rank holds outside the records: buffers, frozen parameters at stages 0-2, and
    the model-dtype copies of trainable parameters (cast from the loaded fp32 masters' values); with
    tensor parallelism this rank's slices of them."""
    managed = managed_ids(module)
    for own_name, tensor in module.state_dict(keep_vars=True).items():
        if tensor.numel() == 0:
            continue
        name = names.saved_name(own_name)
        kind = "model" if reader.has(name, "model") else "optim" if reader.has(name, "optim") else None
        if kind is None:
            if strict and id(tensor) not in managed:
                raise CheckpointError(
                    f"checkpoint {reader.tag_dir} has no entry {name!r}{_excluded(reader)}; pass "
                    "load_module_strict=False to keep its current value"
                )
            continue
        flat = torch.empty(tensor.numel(), dtype=torch.float32 if kind == "optim" else tensor.dtype)
        reader.read(name, kind, "master" if kind == "optim" else "model", 0, tensor.numel(), flat)
        with torch.no_grad():
            tensor.data.copy_(flat.view(tensor.shape).to(tensor.dtype))


def _restore_scalar_state(reader: PieceReader, records: list[ShardRecord], optimizer: torch.optim.Optimizer) -> None:
    for record in records:
        if record.opt_group is None:
            continue
        state = optimizer.state.setdefault(record.tensor, {})
        for k, v in _find_scalars(reader, record.opt_group).items():
            state[k] = v.clone() if torch.is_tensor(v) else v


def _find_scalars(reader: PieceReader, opt_group: int) -> dict[str, Any]:
    """The optimizer's per-group scalar state (e.g. Adam's step), from the first rank file that has it."""
    for r in range(reader.manifest["world_size"]):
        scalars = reader.file(optim_file(r)).get("scalars", {})
        if opt_group in scalars:
            return scalars[opt_group]
    return {}


def _restore_param_groups(optimizer: torch.optim.Optimizer, head: dict[str, Any]) -> None:
    """lr, betas, weight_decay, ... as saved."""
    for group, saved in zip(optimizer.param_groups, head.get("param_groups", [])):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _restore(target: Stateful | None, saved: dict[str, Any] | None) -> None:
    """An LR scheduler or loss scaler, where both it and its saved state exist."""
    if target is not None and saved is not None:
        target.load_state_dict(saved)


def _saved_counters(head: dict[str, Any]) -> Counters:
    saved = head.get("engine", {})
    return Counters(**{f.name: int(saved.get(f.name, 0)) for f in dataclasses.fields(Counters)})


def _restore_rng(reader: PieceReader, rank: int) -> None:
    """This rank's saved generator states; a rank beyond the saved world size keeps its own."""
    own = reader.file(model_file(rank)) if rank < reader.manifest["world_size"] else None
    if own is not None and "rng" in own:
        set_rng_state(own["rng"])
