"""save_checkpoint (load_checkpoint's side is restore.py): sharded, atomic, resumable exactly, loadable at any world size and
stage (engine/checkpoint/files.py has the layout, engine/zero/records.py the piece description).

Save: every rank writes its own two files in parallel (no rank gathers the model); rank 0 writes the
manifest and then makes the tag visible with one rename, and `latest` last. Load: every rank reads,
for each piece it holds now, the saved pieces of the same parameter that overlap it, from whichever
ranks' files have them (memory-mapped, so a rank never holds more than its own state plus one file's
index), so a checkpoint saved by 4 ranks at stage 3 loads on 2 ranks at stage 2. Under tensor
parallelism the same holds per tensor-parallel rank, whose slices are saved under names of their own
(See [Note: checkpoint names under tensor parallelism] in tensor_parallel.py).

The store never sees the Engine: it saves from and loads into a `TrainingState` (training_state.py),
and `load` hands the saved counters back for the Engine to set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import comm
from engine.checkpoint.atomic_file import atomic_open, atomic_save, fsync_dir
from engine.checkpoint.client_state import prepare_client_state
from engine.checkpoint.files import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    CheckpointError,
    check_tag,
    model_file,
    optim_file,
    partial_dir,
)
from engine.checkpoint.rng import rng_state
from engine.checkpoint.tensor_parallel import CheckpointNames, manifest_section
from engine.checkpoint.training_state import TrainingState
from engine.monitor.log import get_logger
from engine.zero.partitioned_init import full_shape
from engine.zero.records import ShardRecord

logger = get_logger()

PieceIndex = list[tuple[str, str, int, int]]
"""(file kind "model" or "optim", parameter name, offset, numel) of every piece one rank wrote: its row
of the manifest's `pieces`."""


# ----------------------------------------------------------------------------------------- save
def save(
    state: TrainingState,
    save_dir: str,
    tag: str | None,
    client_state: dict[str, Any] | None,
    save_latest: bool,
    exclude_frozen_parameters: bool = False,
) -> str:
    """Every rank writes its files into save_dir/.<tag>.partial; rank 0 writes the manifest, renames the
    folder to save_dir/<tag> and then writes `latest`. Returns save_dir/<tag>. With
    exclude_frozen_parameters the values of parameters with requires_grad=False are not written (as
    DeepSpeed leaves them out of its module state): loading such a checkpoint keeps the model's own
    values for them and needs load_module_strict=False."""
    rank, world = comm.get_rank(), comm.get_world_size()
    tag = check_tag(str(tag) if tag is not None else f"global_step{state.counters.global_steps}", "save_checkpoint")
    client_state = _agree_on_client_state(client_state)
    started = time.perf_counter()
    names = CheckpointNames.of(state.module, state.parallel)
    records = names.for_saving(state.stage.checkpoint_shards())
    left_out = _frozen_names(state.module, names) if exclude_frozen_parameters else set()
    final, partial = os.path.join(save_dir, tag), partial_dir(save_dir, tag)
    _start_partial(save_dir, partial)

    pieces = _collect_pieces(records, state.optimizer, left_out)
    whole = _whole_tensors(state.module, names, left_out)
    pieces.index.extend(("model", name, 0, int(value.numel())) for name, value in whole.items())
    model_state: dict[str, Any] = {"pieces": pieces.model, "whole": whole, "rng": rng_state()}
    if rank == 0:
        model_state.update(_rank0_head(state, client_state))
        # The client state's keys at the top level too, where DeepSpeed keeps them and where tools that read
        # DeepSpeed's files look (Lightning's convert_zero_checkpoint_to_fp32_state_dict). The values are the
        # same objects as under "client_state", which the pickle stores once; a key the engine itself uses
        # stays only there (DeepSpeed's load drops such keys from the client state too; this engine's does not).
        for key, value in client_state.items():
            model_state.setdefault(key, value)
    checksums = _write_rank_files(partial, rank, model_state, pieces, state.stage.stage)

    gathered = comm.all_gather_object((pieces.index, checksums, names.spec_row(_aliases(state.module))))
    tensor_parallel = manifest_section(state.parallel.tp_size, state.parallel.dp_size, [g[2] for g in gathered])
    if rank == 0:
        manifest = _manifest(state, tag, world, [g[:2] for g in gathered], tensor_parallel, exclude_frozen_parameters)
        _write_text(os.path.join(partial, MANIFEST), json.dumps(manifest, indent=1))
        _publish(save_dir, tag, save_latest)
    comm.barrier()
    if rank == 0:
        logger.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - started)
    return final


@dataclass
class _Pieces:
    """This rank's share of the checkpoint, by parameter name, as its files hold it."""

    model: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Frozen parameters' pieces, {"offset", "model"}: rank_<r>_model_states.pt."""
    optim: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """fp32 master pieces with their optimizer state, {"offset", "master", "exp_avg", ...}:
    rank_<r>_optim_states.pt."""
    scalars: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per optimizer group, the state not shaped like a master (Adam's step), from its first record."""
    index: PieceIndex = field(default_factory=list)
    masters_bytes: int | None = None
    """The optimizer file's masters' bytes when they are one storage (_pack), else None."""


def _agree_on_client_state(client_state: dict[str, Any] | None) -> dict[str, Any]:
    """client_state as it is written. Checked on every rank before anything is written, and agreed on, so
    a refusal is raised by every rank (none waits in a barrier) and the previous checkpoint and `latest`
    stay as they were."""
    refusal: CheckpointError | None = None
    try:
        prepared = prepare_client_state(client_state)
    except CheckpointError as err:
        prepared, refusal = {}, err
    refusals = comm.all_gather_object(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    if any(refusals):
        first = next(r for r, msg in enumerate(refusals) if msg)
        raise CheckpointError(f"save_checkpoint refused on rank {first}: {refusals[first]}")
    return prepared


def _start_partial(save_dir: str, partial: str) -> None:
    """Rank 0 makes the hidden folder every rank writes into (removing dead saves first); all wait for it."""
    if comm.get_rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        _remove_partial_saves(save_dir)
        os.makedirs(partial)
    comm.barrier()


def _remove_partial_saves(save_dir: str) -> None:
    """Hidden .<tag>.partial folders are saves that died before their rename (any tag): never loadable,
    only taking space."""
    for entry in os.listdir(save_dir):
        if entry.startswith(".") and entry.endswith(".partial"):
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)


def _frozen_names(module: torch.nn.Module, names: CheckpointNames) -> set[str]:
    """The saved names of the parameters with requires_grad=False."""
    return {names.saved_name(name) for name, p in module.named_parameters() if not p.requires_grad}


def _collect_pieces(records: list[ShardRecord], optimizer: torch.optim.Optimizer | None, left_out: set[str]) -> _Pieces:
    """The records this rank writes, cut into named pieces (cloned: a file holds only its pieces' bytes),
    except the pieces of the parameters `left_out` names."""
    pieces = _Pieces()
    for record in records:
        if record.write:
            _add_record(pieces, record, optimizer, left_out)
    pieces.masters_bytes = _pack(pieces.optim)
    return pieces


def _pack(optim: dict[str, list[dict[str, Any]]]) -> int | None:
    """Every optimizer piece's tensors copied into one flat tensor per (key, dtype), each piece's value a
    view of it, in the pieces' order: torch.save writes one storage each, so the file holds its masters
    as one run of bytes, before the moments (the first piece's "master" is the first tensor pickled),
    and few records to unpickle. Returns the masters' bytes when they are all one dtype (one storage,
    whose checksum goes into the manifest on its own for consolidate, files.py), else None."""
    groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for entries in optim.values():
        for entry in entries:
            for key, value in entry.items():
                if torch.is_tensor(value):
                    groups.setdefault((key, value.dtype), []).append(value)
    views = {
        group: iter(torch.cat(parts).split([p.numel() for p in parts]) if parts else [])
        for group, parts in groups.items()
    }
    for entries in optim.values():
        for entry in entries:
            for key, value in entry.items():
                if torch.is_tensor(value):
                    entry[key] = next(views[(key, value.dtype)])
    masters = [parts for (key, _), parts in groups.items() if key == "master"]
    return sum(p.numel() * p.element_size() for p in masters[0]) if len(masters) == 1 else None


def _add_record(
    pieces: _Pieces, record: ShardRecord, optimizer: torch.optim.Optimizer | None, left_out: set[str]
) -> None:
    flat = record.tensor.detach().reshape(-1)
    if record.opt_group is None:
        for piece in record.pieces:
            if piece.name in left_out:
                continue
            lo, hi = piece.tensor_offset, piece.tensor_offset + piece.numel
            pieces.model.setdefault(piece.name, []).append({"offset": piece.param_offset, "model": flat[lo:hi].clone()})
            pieces.index.append(("model", piece.name, piece.param_offset, piece.numel))
        return
    states = {k: v.detach().reshape(-1) for k, v in _state_tensors(optimizer, record).items()}
    pieces.scalars.setdefault(record.opt_group, _scalar_state(optimizer, record))
    for piece in record.pieces:
        lo, hi = piece.tensor_offset, piece.tensor_offset + piece.numel
        entry = {"offset": piece.param_offset, "master": flat[lo:hi]}  # views: _pack copies them
        entry.update({k: v[lo:hi] for k, v in states.items()})
        pieces.optim.setdefault(piece.name, []).append(entry)
        pieces.index.append(("optim", piece.name, piece.param_offset, piece.numel))


def _optimizer_state(optimizer: torch.optim.Optimizer | None, record: ShardRecord) -> dict[str, Any]:
    return optimizer.state.get(record.tensor, {}) if optimizer is not None else {}


def _shaped_like_master(value: Any, record: ShardRecord) -> bool:
    return torch.is_tensor(value) and value.numel() == record.tensor.numel() and value.numel() > 1


def _state_tensors(optimizer: torch.optim.Optimizer | None, record: ShardRecord) -> dict[str, torch.Tensor]:
    """The optimizer state tensors shaped like the record's master (exp_avg, exp_avg_sq, ...)."""
    return {k: v for k, v in _optimizer_state(optimizer, record).items() if _shaped_like_master(v, record)}


def _scalar_state(optimizer: torch.optim.Optimizer | None, record: ShardRecord) -> dict[str, Any]:
    """The rest of the master's optimizer state (Adam's step), saved once per optimizer group."""
    return {
        k: (v.detach().clone() if torch.is_tensor(v) else v)
        for k, v in _optimizer_state(optimizer, record).items()
        if not _shaped_like_master(v, record)
    }


def managed_ids(module: torch.nn.Module) -> set[int]:
    """Trainable parameters: their values travel as fp32 master pieces (on whichever rank owns each
    piece), never as whole tensors. Stage-3 frozen parameters are released here (numel 0) and travel
    as their shards' pieces."""
    return {id(p) for p in module.parameters() if p.requires_grad}


def _whole_tensors(
    module: torch.nn.Module, names: CheckpointNames, left_out: set[str] | frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """What this rank saves whole, by saved name: buffers, and frozen parameters at stages 0-2. Rank 0
    without tensor parallelism; with it, the first rank of each data-parallel group its slices of
    them, and rank 0 also the replicated ones. Not the parameters `left_out` names (by saved name)."""
    if not names.writes_whole():
        return {}
    managed = managed_ids(module)
    return {
        names.saved_name(n): t.detach().clone()
        for n, t in module.state_dict(keep_vars=True).items()
        if id(t) not in managed and t.numel() > 0 and names.writes(n) and names.saved_name(n) not in left_out
    }


def _rank0_head(state: TrainingState, client_state: dict[str, Any]) -> dict[str, Any]:
    """What only rank 0's model file holds, besides its pieces, whole tensors and RNG states."""
    optimizer = state.optimizer
    return {
        "engine": dataclasses.asdict(state.counters),
        "lr_scheduler": state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None,
        "loss_scaler": state.loss_scaler.state_dict() if state.loss_scaler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        if optimizer is not None
        else [],
        "client_state": client_state,
    }


def _write_rank_files(
    partial: str, rank: int, model_state: dict[str, Any], pieces: _Pieces, stage: int
) -> dict[str, dict[str, Any]]:
    """This rank's two files, each written atomically; their checksums, for the manifest. The optimizer
    file also names the ZeRO stage under DeepSpeed's keys, which tools written for DeepSpeed read from
    it themselves (Lightning: optim_state["optimizer_state_dict"]["zero_stage"])."""
    optim_state = {"pieces": pieces.optim, "scalars": pieces.scalars, "optimizer_state_dict": {"zero_stage": stage}}
    model = atomic_save(model_state, os.path.join(partial, model_file(rank)))
    optim = atomic_save(optim_state, os.path.join(partial, optim_file(rank)))
    model.pop("first_storage", None)
    first = optim.pop("first_storage", None)
    if first is not None and first["bytes"] == pieces.masters_bytes:  # the masters, as _pack laid them out
        optim["masters"] = first
    return {model_file(rank): model, optim_file(rank): optim}


def _manifest(
    state: TrainingState,
    tag: str,
    world: int,
    gathered: list[tuple[PieceIndex, dict[str, dict[str, Any]]]],
    tensor_parallel: dict[str, Any],
    exclude_frozen_parameters: bool,
) -> dict[str, Any]:
    """manifest.json (engine/checkpoint/files.py), from every rank's pieces and file checksums (an
    optimizer file's "masters" go to masters_checksums). A
    tensor-parallel parameter's shape is its whole one (its slices' are in tensor_parallel)."""
    sliced = tensor_parallel["params"]
    params = {
        n: {
            "shape": sliced[n]["shape"] if n in sliced else list(full_shape(p)),
            "dtype": str(p.dtype).removeprefix("torch."),
            "trainable": p.requires_grad,
        }
        for n, p in state.module.named_parameters()
    }
    return {
        "format_version": FORMAT_VERSION,
        "engine_version": _engine_version(),
        "torch_version": torch.__version__,
        "tag": tag,
        "world_size": world,
        "stage": state.stage.stage,
        "model_dtype": str(state.model_dtype).removeprefix("torch.") if state.model_dtype is not None else "as built",
        "global_steps": state.counters.global_steps,
        "params": params,
        "exclude_frozen_parameters": exclude_frozen_parameters,
        "aliases": _aliases(state.module),
        "tensor_parallel": tensor_parallel,
        "files": {"model": [model_file(r) for r in range(world)], "optim": [optim_file(r) for r in range(world)]},
        "pieces": [[list(entry) for entry in entries] for entries, _ in gathered],
        "masters_checksums": {n: d["masters"] for _, sums in gathered for n, d in sums.items() if "masters" in d},
        "checksums": {
            n: {k: v for k, v in d.items() if k != "masters"} for _, sums in gathered for n, d in sums.items()
        },
    }


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


def _publish(save_dir: str, tag: str, save_latest: bool) -> None:
    """The complete tag appears with one rename, then `latest` names it. A tag saved over is moved aside
    first and deleted after (files.resolve_tag_dir loads the aside copy if a crash comes between)."""
    final, old = os.path.join(save_dir, tag), os.path.join(save_dir, f".{tag}.old")
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial_dir(save_dir, tag), final)
    fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        _write_text(os.path.join(save_dir, LATEST), tag)


def _write_text(path: str, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)
