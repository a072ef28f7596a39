"""DeepSpeed's `deepspeed.utils.zero_to_fp32` over this engine's checkpoints and DeepSpeed's own: the fp32
state dict is consolidate.py's (which reads both); the files of one of this engine's tag directories
are the ones its manifest lists, those of DeepSpeed's are listed as DeepSpeed lists them (a glob in
natural order, get_checkpoint_files). safetensors output is streamed from the rank files
(consolidate_stream.py), never the whole state dict in memory.

Tools written for DeepSpeed also open those files themselves. Lightning's
convert_zero_checkpoint_to_fp32_state_dict (lightning/pytorch/utilities/deepspeed.py) reads
`torch.load(get_optim_files(tag_dir)[0])["optimizer_state_dict"]["zero_stage"]`, then takes the top-level
keys of `torch.load(get_model_state_file(tag_dir, zero_stage))` as its client state. So every optimizer
file carries {"optimizer_state_dict": {"zero_stage": N}} and rank 0's model file holds the client state's
keys at its top level as well (engine/checkpoint/store.py). On DeepSpeed's own directories both answer
with DeepSpeed's files, which hold the same keys.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from engine.checkpoint.consolidate import consolidate
from engine.checkpoint.consolidate_plan import open_checkpoint, tag_dir_of
from engine.checkpoint.consolidate_stream import write_dir
from engine.checkpoint.deepspeed_format.layout import model_states_name
from engine.checkpoint.files import MANIFEST, model_file, optim_file, read_manifest
from engine.monitor.log import get_logger


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    """The model's state dict from checkpoint_dir/<tag> (tag None: the one `latest` names), in CPU
    memory: trainable parameters from the fp32 masters, frozen ones in fp32 (left out with
    exclude_frozen_parameters), buffers as saved, tied names sharing one tensor. Any stage, any world
    size, this engine's checkpoints and DeepSpeed's. lazy_mode is accepted for DeepSpeed's callers: the
    values are tensors already, which answer the `.contiguous()` those callers use to materialise
    DeepSpeed's lazy ones."""
    state = consolidate(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        _, manifest = open_checkpoint(tag_dir_of(checkpoint_dir, tag))
        frozen = {name for name, spec in manifest["params"].items() if spec.get("trainable") is False}
        frozen |= {alias for alias, target in manifest.get("aliases", {}).items() if target in frozen}
        state = {name: value for name, value in state.items() if name not in frozen}
    return state


def get_checkpoint_files(checkpoint_dir: str, glob_pattern: str) -> list[str]:
    """As DeepSpeed's: the files of checkpoint_dir matching glob_pattern, in natural order (rank 2 before
    rank 10), FileNotFoundError when there are none. checkpoint_dir is matched as a literal path (DeepSpeed
    reads a "[" in it as a glob character)."""
    pattern = os.path.join(glob.escape(checkpoint_dir), glob_pattern)
    files = sorted(glob.glob(pattern), key=_natural_key)
    if not files:
        raise FileNotFoundError(
            f"can't find {glob_pattern} files in directory '{checkpoint_dir}': it is not a checkpoint's tag "
            "directory (or does not exist); pass <save_dir>/<tag>, e.g. the tag that <save_dir>/latest names"
        )
    return files


def get_optim_files(checkpoint_dir: str) -> list[str]:
    """Every rank's optimizer-state file of a tag directory: this engine's in rank order (from its
    manifest), DeepSpeed's as DeepSpeed lists them (its *_optim_states.pt files in natural order;
    FileNotFoundError when there are none, as at stage 0)."""
    if not _is_engine_dir(checkpoint_dir):
        return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")
    manifest = read_manifest(checkpoint_dir)
    return [os.path.join(checkpoint_dir, optim_file(rank)) for rank in range(manifest["world_size"])]


def get_model_state_files(checkpoint_dir: str) -> list[str]:
    """Every rank's model-state file of a tag directory: this engine's in rank order, DeepSpeed's as
    DeepSpeed lists them (its *_model_states.pt files in natural order)."""
    if not _is_engine_dir(checkpoint_dir):
        return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")
    manifest = read_manifest(checkpoint_dir)
    return [os.path.join(checkpoint_dir, model_file(rank)) for rank in range(manifest["world_size"])]


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """The file holding the engine counters, LR scheduler and client state of a tag directory: rank 0's
    model-state file at every stage for this engine's; for DeepSpeed's, the one DeepSpeed names
    (mp_rank_00_model_states.pt at stages 0-2, zero_pp_rank_0_mp_rank_00_model_states.pt at stage 3),
    FileNotFoundError when it is not there."""
    if _is_engine_dir(checkpoint_dir):
        return get_model_state_files(checkpoint_dir)[0]
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    path = os.path.join(checkpoint_dir, model_states_name(0 if zero_stage == 3 else None))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"can't find model states file at '{path}' (zero_stage {zero_stage}); pass the stage the "
            "checkpoint was saved at (its optimizer files' optimizer_state_dict.zero_stage)"
        )
    return path


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None
) -> torch.nn.Module:
    """As DeepSpeed's: the model moved to the CPU and loaded (strict=False) with the consolidated fp32
    state dict. Like DeepSpeed's, the model no longer belongs to an engine afterwards."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """As DeepSpeed's: the fp32 state dict written into output_dir as pytorch_model.bin (model.safetensors
    with safe_serialization), split into shards of at most max_shard_size with an index file as
    Hugging Face names them when it is larger. safetensors are streamed from the rank files by worker
    processes (consolidate_stream.py); pytorch_model.bin needs the state dict in memory
    (huggingface_hub splits it, as in DeepSpeed)."""
    if safe_serialization and not exclude_frozen_parameters:
        names = write_dir(tag_dir_of(checkpoint_dir, tag), output_dir, max_shard_size=max_shard_size)
        get_logger().info(
            "wrote the fp32 state dict of %s into %s (%d file(s))", checkpoint_dir, output_dir, len(names)
        )
        return
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    files: dict[str, list[str]] = {weights_name: list(state)}
    index: dict[str, Any] | None = None
    if max_shard_size is not None:
        from huggingface_hub import split_torch_state_dict_into_shards

        pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
        split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=max_shard_size)
        files = split.filename_to_tensors
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    os.makedirs(output_dir, exist_ok=True)
    for name, keys in files.items():
        _save(
            _untied({key: state[key] for key in keys}) if safe_serialization else {key: state[key] for key in keys},
            os.path.join(output_dir, name),
            safe_serialization,
        )
    if index is not None:
        import json

        index_name = f"{weights_name}.index.json"
        with open(os.path.join(output_dir, index_name), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    get_logger().info("wrote the fp32 state dict of %s into %s (%d file(s))", checkpoint_dir, output_dir, len(files))


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied names): each gets its own copy."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        out[key] = value.clone() if id(value) in seen else value
        seen.add(id(value))
    return out


def _save(state: dict[str, torch.Tensor], path: str, safe_serialization: bool) -> None:
    if safe_serialization:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(state, path)


def _is_engine_dir(tag_dir: str) -> bool:
    """A tag directory of this engine's (its manifest, or its rank-0 file when the manifest is lost, which
    read_manifest then names); anything else is listed by DeepSpeed's rules."""
    return any(os.path.isfile(os.path.join(tag_dir, name)) for name in (MANIFEST, model_file(0)))


def _natural_key(text: str) -> list[int | str]:
    """DeepSpeed's natural_keys: digit runs compare as numbers."""
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]
