"""DeepSpeed checkpoints saved with tensor parallelism (AutoTP): one set of files per tensor-parallel
rank (`mp_rank_XX`), read as the engine's own tensor-parallel checkpoint.

DeepSpeed 0.19 records in every model-states file (`universal_checkpoint_info.affine_map`) each
parameter's logical (whole) shape and every tensor-parallel rank's shard, as pieces (boxes of the
logical tensor and where each sits in the shard). A split tensor is read when each rank holds one
piece, or (a fused layer DeepSpeed cut into sub-parameters: [q; k; v], [gate; up]) its share of each
part: equal parts are the engine's partition_stride, unequal ones (fewer key/value heads than query
heads) are recorded as the parts' sizes (partition_sections) and joined by them; `original_vocab_size`
with `vocabulary_parameter_patterns` says which rows of a vocabulary-parallel tensor are padding.
`merge_tensor_parallel` turns the per-rank conversions (layout.convert) into one: a split
parameter's pieces go under the engine's slice names (engine/checkpoint/tensor_parallel.py's
`slice_name`) with the manifest's `tensor_parallel` section saying how to join them, a replicated one
is taken from rank 0's files. The engine's load then re-cuts the slices for any tensor-parallel size
(engine/checkpoint/tp_recut.py), 1 included.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from engine.checkpoint.deepspeed_format.converted import Converted, Pieces
from engine.checkpoint.files import CheckpointError


def _slice_name(name: str, tp_rank: int) -> str:
    from engine.checkpoint.tensor_parallel import slice_name  # checkpoint/tensor_parallel imports this package

    return slice_name(name, tp_rank)


def _affine_map(head: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(universal_checkpoint_info or {}, its affine_map's params, or None when DeepSpeed wrote none)."""
    info = head.get("universal_checkpoint_info")
    info = info if isinstance(info, dict) else {}
    amap = info.get("affine_map")
    return info, amap["params"] if isinstance(amap, dict) and isinstance(amap.get("params"), dict) else None


# Module names DeepSpeed < 0.18's AutoTP cut as a fused qkv (module_inject/fusedqkv_utils.py's
# require_tp_fused_qkvw), in a layout that depends on the model type and that its files do not record.
_OLD_FUSED_QKV = ("qkv_proj", "query_key_value", "attn.Wqkv", "self_attn.W_pack", "c_attn")


class Split(NamedTuple):
    """How DeepSpeed split one parameter over the tensor-parallel ranks."""

    logical: list[int]
    """The whole (logical) shape."""
    dim: int | None
    """The partition dim; None: replicated."""
    stride: int
    """Equal parts each rank holds its share of (the engine's partition_stride)."""
    sections: list[int] | None
    """The whole sizes of unequal parts each rank holds its share of (partition_sections), or None."""


def _split_from_shapes(name: str, shards: list[list[int]], whole: list[int] | None, tag_dir: str) -> Split:
    """How one parameter of a checkpoint without an affine_map was split, from its shard shapes and the
    model's whole shape: replicated, or one equal piece per rank."""
    mp = len(shards)
    if whole is None or all(shape == whole for shape in shards):
        return Split(list(shards[0]), None, 1, None)
    dims = [d for d in range(len(whole)) if shards[0][d] != whole[d]] if len(shards[0]) == len(whole) else []
    if len(dims) != 1 or any(shape != shards[0] for shape in shards) or shards[0][dims[0]] * mp != whole[dims[0]]:
        raise CheckpointError(
            f"{tag_dir}: {name!r} has shard shapes {shards} over {mp} tensor-parallel ranks, which no equal split "
            f"of the model's shape {whole} along one dimension gives (this checkpoint has no affine_map to say "
            "how DeepSpeed split it)"
        )
    if any(fused in name for fused in _OLD_FUSED_QKV):
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed split {name!r} as a fused qkv, in a layout that depends on the model type and "
            "that a checkpoint without universal_checkpoint_info.affine_map (DeepSpeed < 0.18) does not record; "
            "save it with DeepSpeed >= 0.18, or at tensor-parallel size 1"
        )
    return Split(list(whole), dims[0], 1, None)


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _sections(shards: list[dict[str, Any]], logical: list[int], dim: int) -> list[int] | None:
    """The whole sizes of the parts a split along `dim` cut each rank's shard from, when every rank's
    pieces are, in order, its share of each part: part j (whole size W_j, starting at the sum of the
    earlier parts) gives rank r its W_j / mp rows from r x W_j / mp on. One part is a plain split; N
    equal parts are Megatron's strided split (engine/zero/tp_state.py; DeepSpeed's sub-parameters of a
    fused [q; k; v] or [gate; up]); unequal parts a fused [q; k; v] with fewer key/value heads. None
    when the pieces are laid out any other way."""
    mp = len(shards)
    first = shards[0].get("pieces", [])
    if not first or any(len(p.get("shape", [])) != len(logical) for p in first):
        return None
    widths = [int(p["shape"][dim]) for p in first]
    sections = [w * mp for w in widths]
    if sum(sections) != logical[dim]:
        return None
    shard_shape = [sum(widths) if d == dim else n for d, n in enumerate(logical)]
    source_strides, dest_strides = _contiguous_strides(logical), _contiguous_strides(shard_shape)
    starts = [sum(sections[:j]) for j in range(len(sections))]
    for r, shard in enumerate(shards):
        want = [
            {
                "shape": [w if d == dim else n for d, n in enumerate(logical)],
                "source": [(starts[j] + r * w) * source_strides[dim], source_strides],
                "dest": [sum(widths[:j]) * dest_strides[dim], dest_strides],
            }
            for j, w in enumerate(widths)
        ]
        got = [
            {
                "shape": [int(x) for x in p["shape"]],
                "source": [int(p["source"][0]), [int(x) for x in p["source"][1]]],
                "dest": [int(p["dest"][0]), [int(x) for x in p["dest"][1]]],
            }
            for p in shard.get("pieces", [])
        ]
        if got != want:
            return None
    return sections


def _split_of(name: str, pattern_entry: dict[str, Any], mp: int, tag_dir: str) -> Split:
    """How one parameter was split, from its affine_map entry."""
    logical = [int(s) for s in pattern_entry["logical_shape"]]
    ranks = pattern_entry.get("ranks", {})
    shards = [ranks.get(r, ranks.get(str(r))) for r in range(mp)]
    if any(s is None for s in shards):
        raise CheckpointError(f"{tag_dir}: affine_map entry of {name!r} lacks some of the {mp} tensor-parallel ranks")
    shapes = [[int(x) for x in s["shard_shape"]] for s in shards]
    if all(shape == logical for shape in shapes):
        return Split(logical, None, 1, None)
    dims = [d for d in range(len(logical)) if shapes[0][d] != logical[d]]
    if len(dims) != 1 or any(shape != shapes[0] for shape in shapes) or shapes[0][dims[0]] * mp != logical[dims[0]]:
        raise CheckpointError(
            f"{tag_dir}: {name!r} has shard shapes {shapes} of the logical shape {logical} over {mp} "
            "tensor-parallel ranks; only equal splits along one dimension are read"
        )
    sections = _sections(shards, logical, dims[0])
    if sections is None:
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed split {name!r} (logical shape {logical}) into pieces that are not each "
            f"rank's share of consecutive parts of dimension {dims[0]}; this engine reads a split tensor whose "
            "ranks each hold one piece, or their share of each part of a fused layer"
        )
    if len(set(sections)) == 1:
        return Split(logical, dims[0], len(sections), None)
    return Split(logical, dims[0], 1, sections)


def merge_tensor_parallel(
    parts: list[Converted], head: dict[str, Any], tag_dir: str, model_shapes: Mapping[str, Sequence[int]] | None = None
) -> tuple[Converted, dict]:
    """One Converted for all tensor-parallel ranks (engine rank m * dp + d holds rank (m, d)'s pieces),
    and the manifest's tensor_parallel section. `head`: tensor-parallel rank 0's (first) model-states file.
    How each parameter was split comes from the affine_map; a checkpoint without one (DeepSpeed < 0.18)
    is read from the shard shapes against `model_shapes`, the model's whole parameter shapes (under the
    checkpoint's names)."""
    mp, dp = len(parts), parts[0].world_size
    info, amap = _affine_map(head)
    if amap is None and model_shapes is None:
        raise CheckpointError(
            f"{tag_dir} was saved by DeepSpeed with tensor parallelism but its model-states file has no "
            "universal_checkpoint_info.affine_map (DeepSpeed >= 0.18 writes it), which says how each parameter "
            "was split; load it with engine.load_checkpoint into the model, whose shapes say it"
        )
    vocab_patterns = [re.compile(p) for p in info.get("vocabulary_parameter_patterns", [])]
    vocab = info.get("original_vocab_size")
    split: dict[str, int] = {}
    whole_shapes = dict(parts[0].params)
    tp_params: dict[str, Any] = {}
    for name, shape in parts[0].params.items():
        if amap is None:
            assert model_shapes is not None
            whole = model_shapes.get(name)
            shards = [list(part.params[name]) for part in parts]
            logical, dim, stride, sections = _split_from_shapes(
                name, shards, None if whole is None else list(whole), tag_dir
            )
        else:
            entry = next((e for p, e in amap.items() if re.fullmatch(p, name)), None)
            if entry is None:
                raise CheckpointError(
                    f"{tag_dir}: parameter {name!r} is missing from universal_checkpoint_info.affine_map"
                )
            logical, dim, stride, sections = _split_of(name, entry, mp, tag_dir)
        if dim is None:
            continue
        split[name] = dim
        whole_shapes[name] = logical
        padded = logical[dim] if any(p.fullmatch(name) for p in vocab_patterns) and dim == 0 else None
        tp_params[name] = {
            "partition_dim": dim,
            "partition_stride": stride,
            "shape": logical,
            "slice_shapes": [list(shape)] * mp,
            "saved_as": [_slice_name(name, m) for m in range(mp)],
        }
        if sections is not None:  # a fused layer of unequal parts: each rank holds its share of each
            tp_params[name]["partition_sections"] = sections
        if padded is not None and isinstance(vocab, int) and vocab < padded:
            tp_params[name]["rows_kept"] = vocab  # the rest is DeepSpeed's vocabulary padding
            whole_shapes[name] = [vocab, *logical[1:]]

    def renamed(pieces: Pieces, m: int) -> Pieces:
        return {(_slice_name(n, m) if n in split else n): es for n, es in pieces.items() if n in split or m == 0}

    optim = [renamed(parts[m].optim[d], m) for m in range(mp) for d in range(dp)]
    frozen = [renamed(parts[m].frozen[d], m) for m in range(mp) for d in range(dp)]
    first = parts[0]
    merged = Converted(
        mp * dp,
        first.stage,
        whole_shapes,
        set(first.trainable),
        optim,
        frozen,
        first.scalars,
        first.whole,
        first.head,
        first.aliases,
    )
    return merged, {"tp_size": mp, "dp_size": dp, "params": tp_params}
