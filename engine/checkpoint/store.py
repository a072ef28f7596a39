"""save_checkpoint / load_checkpoint: sharded, atomic, resumable exactly, loadable at any world size and
stage (engine/checkpoint/files.py has the layout, records.py the piece description).

Save: every rank writes its own two files in parallel (no rank gathers the model); rank 0 writes the
manifest and then makes the tag visible with one rename, and `latest` last. Load: every rank reads,
for each piece it holds now, the saved pieces of the same parameter that overlap it, from whichever
ranks' files have them (memory-mapped, so a rank never holds more than its own state plus one file's
index), so a checkpoint saved by 4 ranks at stage 3 loads on 2 ranks at stage 2.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

import torch

from engine import comm
from engine.atomic_file import atomic_open, atomic_save, fsync_dir
from engine.checkpoint.client_state import prepare_client_state, restore_client_state
from engine.checkpoint.files import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    CheckpointError,
    check_tag,
    model_file,
    optim_file,
    partial_dir,
    read_manifest,
    resolve_tag_dir,
)
from engine.checkpoint.piece_reader import PieceReader
from engine.checkpoint.records import ShardRecord
from engine.checkpoint.rng import rng_state, set_rng_state
from engine.monitor.log import get_logger

if TYPE_CHECKING:
    from engine.engine import Engine

logger = get_logger()


# ----------------------------------------------------------------------------------------- save
def _state_tensors(optimizer: torch.optim.Optimizer, record: ShardRecord) -> dict[str, torch.Tensor]:
    """The optimizer state tensors shaped like the record's master (exp_avg, exp_avg_sq, ...)."""
    state = optimizer.state.get(record.tensor, {})
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.numel() == record.tensor.numel()
            and v.numel() > 1}


def _scalar_state(optimizer: torch.optim.Optimizer, record: ShardRecord) -> dict[str, Any]:
    state = optimizer.state.get(record.tensor, {})
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in state.items()
            if not (torch.is_tensor(v) and v.numel() == record.tensor.numel() and v.numel() > 1)}


def _managed_ids(module: torch.nn.Module) -> set[int]:
    """Trainable parameters: their values travel as fp32 master pieces (on whichever rank owns each
    piece), never as whole tensors. Stage-3 frozen parameters are released here (numel 0) and travel
    as their shards' pieces."""
    return {id(p) for p in module.parameters() if p.requires_grad}


def save(eng: Engine, save_dir: str, tag: str | None, client_state: dict[str, Any] | None,
         save_latest: bool) -> str:
    stage = eng._require_alive()
    rank, world = comm.get_rank(), comm.get_world_size()
    tag = check_tag(str(tag) if tag is not None else f"global_step{eng.global_steps}", "save_checkpoint")
    # Checked on every rank before anything is written, and agreed on, so a refusal is raised by every
    # rank (none waits in the barrier below) and the previous checkpoint and `latest` stay as they were.
    try:
        client_state, refusal = prepare_client_state(client_state), None
    except CheckpointError as err:
        client_state, refusal = {}, err
    refusals = comm.all_gather_object(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    if any(refusals):
        first = next(r for r, msg in enumerate(refusals) if msg)
        raise CheckpointError(f"save_checkpoint refused on rank {first}: {refusals[first]}")
    started = time.perf_counter()
    records = stage.checkpoint_shards()
    final, partial = os.path.join(save_dir, tag), partial_dir(save_dir, tag)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        _remove_partial_saves(save_dir)
        os.makedirs(partial)
    comm.barrier()

    optim_pieces: dict[str, list[dict[str, Any]]] = {}
    model_pieces: dict[str, list[dict[str, Any]]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    index: list[tuple[str, str, int, int]] = []  # (file kind, name, offset, numel) for the manifest
    for record in records:
        if not record.write:
            continue
        flat = record.tensor.detach().reshape(-1)
        states = {k: v.detach().reshape(-1) for k, v in _state_tensors(eng.optimizer, record).items()} \
            if record.opt_group is not None else {}
        if record.opt_group is not None:
            scalars.setdefault(record.opt_group, _scalar_state(eng.optimizer, record))
        for piece in record.pieces:
            lo, hi = piece.tensor_offset, piece.tensor_offset + piece.numel
            if record.opt_group is None:
                model_pieces.setdefault(piece.name, []).append({"offset": piece.param_offset,
                                                                 "model": flat[lo:hi].clone()})
                index.append(("model", piece.name, piece.param_offset, piece.numel))
            else:
                entry = {"offset": piece.param_offset, "master": flat[lo:hi].clone()}
                entry.update({k: v[lo:hi].clone() for k, v in states.items()})
                optim_pieces.setdefault(piece.name, []).append(entry)
                index.append(("optim", piece.name, piece.param_offset, piece.numel))
    model_state: dict[str, Any] = {"pieces": model_pieces, "rng": rng_state()}
    if rank == 0:
        managed = _managed_ids(eng.module)
        whole = {n: t.detach().clone() for n, t in eng.module.state_dict(keep_vars=True).items()
                 if id(t) not in managed and t.numel() > 0}
        model_state.update({
            "whole": whole,
            "engine": {"global_steps": eng.global_steps, "global_samples": eng.global_samples,
                       "skipped_steps": eng.skipped_steps, "micro_steps": eng.micro_steps},
            "lr_scheduler": eng.lr_scheduler.state_dict() if eng.lr_scheduler is not None else None,
            "loss_scaler": eng.precision.scaler.state_dict() if eng.precision.scaler is not None else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in eng.optimizer.param_groups]
            if eng.optimizer is not None else [],
            "client_state": client_state,
        })
        index.extend(("model", name, 0, int(value.numel())) for name, value in whole.items())
    checksums = {model_file(rank): atomic_save(model_state, os.path.join(partial, model_file(rank))),
                 optim_file(rank): atomic_save({"pieces": optim_pieces, "scalars": scalars},
                                               os.path.join(partial, optim_file(rank)))}

    gathered = comm.all_gather_object((index, checksums))
    everyone = [entries for entries, _ in gathered]
    if rank == 0:
        params = {n: {"shape": list(p.ds_shape) if hasattr(p, "ds_shape") else list(p.shape),
                      "dtype": str(p.dtype).removeprefix("torch."), "trainable": p.requires_grad}
                  for n, p in eng.module.named_parameters()}
        manifest = {
            "format_version": FORMAT_VERSION, "engine_version": _engine_version(), "torch_version": torch.__version__,
            "tag": tag, "world_size": world, "stage": eng.zero_optimization_stage(),
            "model_dtype": str(eng.precision.model_dtype).removeprefix("torch.") if eng.precision.model_dtype
            else "as built", "global_steps": eng.global_steps, "params": params,
            "aliases": _aliases(eng.module),
            "files": {"model": [model_file(r) for r in range(world)], "optim": [optim_file(r) for r in range(world)]},
            "pieces": [[list(entry) for entry in entries] for entries in everyone],
            "checksums": {name: digest for _, sums in gathered for name, digest in sums.items()},
        }
        _write_text(os.path.join(partial, MANIFEST), json.dumps(manifest, indent=1))
        old = os.path.join(save_dir, f".{tag}.old")
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        fsync_dir(save_dir)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            _write_text(os.path.join(save_dir, LATEST), tag)
    comm.barrier()
    if rank == 0:
        logger.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - started)
    return final


def _remove_partial_saves(save_dir: str) -> None:
    """Hidden .<tag>.partial folders are saves that died before their rename (any tag): never loadable,
    only taking space."""
    for entry in os.listdir(save_dir):
        if entry.startswith(".") and entry.endswith(".partial"):
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """Tied parameters: every further name of a parameter -> the name its values are saved under."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _engine_version() -> str:
    try:
        from importlib.metadata import version

        return version("zero-engine")
    except Exception:  # noqa: BLE001 - not installed as a package
        return "unknown"


def _write_text(path: str, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


# ----------------------------------------------------------------------------------------- load
def load(eng: Engine, load_dir: str, tag: str | None, load_module_strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str, dict[str, Any]]:
    stage = eng._require_alive()
    rank = comm.get_rank()
    started = time.perf_counter()
    tag_dir = resolve_tag_dir(load_dir, tag)
    manifest = read_manifest(tag_dir)
    reader = PieceReader(tag_dir, manifest)
    records = stage.checkpoint_shards()
    with_optimizer = load_optimizer_states and not load_module_only

    # Every record's tensor (and its optimizer state) from the saved pieces of the same names.
    missing: list[str] = []
    for record in records:
        kind = "optim" if record.opt_group is not None else ("model" if any(
            reader.has(p.name, "model") for p in record.pieces) else "optim")
        key = "master" if kind == "optim" else "model"
        flat = torch.empty(record.tensor.numel(), dtype=record.tensor.dtype)
        states: dict[str, torch.Tensor] = {}
        if record.opt_group is not None and with_optimizer and eng.optimizer is not None and record.pieces:
            # The saved state's keys (torch creates Adam's state at the first step: a fresh engine has none).
            state = eng.optimizer.state.setdefault(record.tensor, {})
            for k in reader.state_keys(record.pieces[0].name):
                if not (torch.is_tensor(state.get(k)) and state[k].shape == record.tensor.shape):
                    state[k] = torch.zeros_like(record.tensor, memory_format=torch.contiguous_format)
                states[k] = state[k]
        state_flats = {k: torch.empty(v.numel(), dtype=v.dtype) for k, v in states.items()}
        for piece in record.pieces:
            if not reader.has(piece.name, kind):
                missing.append(piece.name)
                continue
            dst = flat[piece.tensor_offset:piece.tensor_offset + piece.numel]
            reader.read(piece.name, kind, key, piece.param_offset, piece.numel, dst)
            for k, sf in state_flats.items():
                reader.read(piece.name, kind, k, piece.param_offset, piece.numel,
                            sf[piece.tensor_offset:piece.tensor_offset + piece.numel])
        with torch.no_grad():
            record.tensor.copy_(flat.view(record.tensor.shape).to(record.tensor.dtype))
            for k, v in states.items():
                v.copy_(state_flats[k].view(v.shape))
    if missing and load_module_strict:
        raise CheckpointError(f"checkpoint {tag_dir} has no values for parameters {sorted(set(missing))[:5]}; "
                              "pass load_module_strict=False to keep their current values")

    # Whole tensors this rank holds outside the records: buffers, frozen parameters at stages 0-2, and
    # the model-dtype copies of trainable parameters (cast from the loaded fp32 masters' values).
    managed = _managed_ids(eng.module)
    for name, tensor in eng.module.state_dict(keep_vars=True).items():
        if tensor.numel() == 0:
            continue
        kind = "model" if reader.has(name, "model") else "optim" if reader.has(name, "optim") else None
        if kind is None:
            if load_module_strict and id(tensor) not in managed:
                raise CheckpointError(f"checkpoint {tag_dir} has no entry {name!r}; pass load_module_strict=False "
                                      "to keep its current value")
            continue
        flat = torch.empty(tensor.numel(), dtype=torch.float32 if kind == "optim" else tensor.dtype)
        reader.read(name, kind, "master" if kind == "optim" else "model", 0, tensor.numel(), flat)
        with torch.no_grad():
            tensor.data.copy_(flat.view(tensor.shape).to(tensor.dtype))
    if hasattr(stage, "after_checkpoint_load"):
        stage.after_checkpoint_load()

    head = reader.file(model_file(0))
    if with_optimizer and eng.optimizer is not None:
        for record in records:
            if record.opt_group is None:
                continue
            saved = _find_scalars(reader, manifest, record.opt_group)
            state = eng.optimizer.state.setdefault(record.tensor, {})
            for k, v in saved.items():
                state[k] = v.clone() if torch.is_tensor(v) else v
        for group, saved in zip(eng.optimizer.param_groups, head.get("param_groups", [])):
            group.update({k: v for k, v in saved.items() if k != "params"})
    if load_lr_scheduler_states and not load_module_only and eng.lr_scheduler is not None \
            and head.get("lr_scheduler") is not None:
        eng.lr_scheduler.load_state_dict(head["lr_scheduler"])
    if not load_module_only:
        if eng.precision.scaler is not None and head.get("loss_scaler") is not None:
            eng.precision.scaler.load_state_dict(head["loss_scaler"])
        counters = head.get("engine", {})
        eng.global_steps = int(counters.get("global_steps", 0))
        eng.global_samples = int(counters.get("global_samples", 0))
        eng.skipped_steps = int(counters.get("skipped_steps", 0))
        eng.micro_steps = int(counters.get("micro_steps", 0))
        own = reader.file(model_file(rank)) if rank < manifest["world_size"] else None
        if own is not None and "rng" in own:
            set_rng_state(own["rng"])
    comm.barrier()
    if rank == 0:
        logger.info("loaded checkpoint %s (saved at world size %d, stage %d) in %.2f s", tag_dir,
                    manifest["world_size"], manifest["stage"], time.perf_counter() - started)
    return tag_dir, restore_client_state(dict(head.get("client_state") or {}), os.path.join(tag_dir, model_file(0)))


def _find_scalars(reader: PieceReader, manifest: dict[str, Any], opt_group: int) -> dict[str, Any]:
    """The optimizer's per-group scalar state (e.g. Adam's step), from the first rank file that has it."""
    for r in range(manifest["world_size"]):
        scalars = reader.file(optim_file(r)).get("scalars", {})
        if opt_group in scalars:
            return scalars[opt_group]
    return {}
