"""client_state is checked when it is saved, so that what saves also loads, as the same types.

Rank 0's model-states file is read back with torch.load(weights_only=True), whose unpickler accepts
tensors, Python scalars, strings, bytes, None, dicts/OrderedDicts/Counters/lists/tuples/sets of them
(plus a few torch types), and nothing else. `save_checkpoint(d, client_state={"best": np.float64(1.5)})`
used to save and then fail to load with a bare UnpicklingError, losing the resume.

What DeepSpeed users put there comes back as the type they saved: Megatron-style scripts store
`args` (an argparse.Namespace) and numpy's RNG state (`np.random.get_state()`, a tuple holding a uint32
array that `np.random.set_state` needs back). numpy values and Namespaces are stored as plain data
(a dict tagged with ENCODED: dtype string, shape and raw bytes; or the Namespace's attributes) and
rebuilt by `restore_client_state` at load. The alternative, allowlisting numpy's reconstruct
functions in the unpickler (torch.serialization.safe_globals), is not taken: torch keeps numpy off its
default allowlist because it does not control what those functions do, documents allowlisting only
for globals "you trust", and the pickled names differ between numpy 1 and 2 (numpy.core vs
numpy._core), so a checkpoint would load or not depending on the numpy installed.

Other values convert without losing information (paths to strings, defaultdict and other dict
subclasses to dict: a default_factory is code, which a checkpoint does not run; namedtuples to
tuples), or are refused with their key path, their type and the fix, before anything is written. A
final round trip through the same unpickler guards against what the walk does not know.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from engine.checkpoint.files import CheckpointError, unpickling_reason

ENCODED = "__zero_engine_type__"
"""The key that marks a value stored as plain data (its value names the type); reserved in client_state."""

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_TORCH_LEAVES = (torch.Tensor, torch.dtype, torch.device, torch.Size)
_NUMPY_KINDS = "biufcmMSU"  # numbers, datetimes and fixed-width strings: values that are their bytes
_KEPT_MAPPINGS = (OrderedDict, Counter)  # on the unpickler's allowlist: kept as they are


def prepare_client_state(client_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """client_state as it is written: what torch.load(weights_only=True) reads back and
    `restore_client_state` turns into what was given; CheckpointError (nothing written) otherwise."""
    if client_state is None:
        return {}
    if not isinstance(client_state, Mapping):
        raise CheckpointError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
    prepared = dict(_encode(client_state, "client_state"))
    buffer = io.BytesIO()
    torch.save(_without_tensor_data(prepared), buffer)
    buffer.seek(0)
    try:
        restore_client_state(torch.load(buffer, map_location="cpu", weights_only=True), "client_state")
    except (pickle.UnpicklingError, CheckpointError) as err:
        raise CheckpointError(
            f"save_checkpoint: client_state would not load back with torch.load(weights_only=True) "
            f"({unpickling_reason(err)}); keep to numbers, strings, tensors, numpy arrays and "
            "dicts/lists/tuples of them. Nothing was written"
        ) from None
    return prepared


def restore_client_state(value: Any, where: str) -> Any:
    """The client_state a checkpoint holds, with its encoded values rebuilt (numpy arrays and scalars,
    Namespaces); `where` (the file) names a malformed one in the CheckpointError."""
    return _decode(value, where, "client_state")


# ------------------------------------------------------------------------------------- save side
def _encode(value: Any, path: str) -> Any:
    if isinstance(value, (np.generic, np.ndarray)):  # first: np.float64 is a float subclass
        return _encode_numpy(value, path)
    if type(value) in _SCALARS or isinstance(value, _TORCH_LEAVES):
        return value
    if isinstance(value, _SCALARS):  # a subclass of str/int/float (an IntEnum, a str subclass): its base value
        base: type = next(t for t in _SCALARS if isinstance(value, t))
        return base(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, argparse.Namespace):
        return {
            ENCODED: "argparse.Namespace",
            "attrs": {
                k: _encode(v, f"{path}.{k}" if isinstance(k, str) and k.isidentifier() else f"{path}[{k!r}]")
                for k, v in vars(value).items()
            },
        }
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise CheckpointError(
                    f"save_checkpoint: {path} has a key of type {type(key).__name__} ({key!r}); "
                    "client_state keys must be strings or numbers. Nothing was written"
                )
            if key == ENCODED:
                raise CheckpointError(
                    f"save_checkpoint: {path} has the key {ENCODED!r}, which checkpoints reserve "
                    "to mark numpy values and Namespaces; rename it. Nothing was written"
                )
            out[key] = _encode(item, f"{path}[{key!r}]")
        mapping_type: type = type(value)
        return mapping_type(out) if mapping_type in _KEPT_MAPPINGS else out
    if isinstance(value, (list, tuple)):
        items = [_encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        return type(value)(_encode(item, f"{path}{{{item!r}}}") for item in value)
    return _refuse(value, path)


def _encode_numpy(value: np.generic | np.ndarray, path: str) -> dict[str, Any]:
    array = np.asarray(value)
    if array.dtype.kind not in _NUMPY_KINDS or array.dtype.fields is not None:
        return _refuse(value, path, f"a numpy value of dtype {array.dtype}")
    return {
        ENCODED: "numpy",
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "scalar": isinstance(value, np.generic),
        "data": np.ascontiguousarray(array).tobytes(),
    }


def _without_tensor_data(value: Any) -> Any:
    """The structure to round-trip, with plain tensors' data left out (a client_state may hold a model's
    worth of EMA weights, on the GPU: their dtype, not their bytes, decides whether they load)."""
    if type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout == torch.strided:
        return torch.empty(0, dtype=value.dtype, device=value.device)
    if isinstance(value, dict):
        return type(value)({k: _without_tensor_data(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_without_tensor_data(v) for v in value)
    return value


_HINTS = {
    "datetime": "store value.isoformat() or value.timestamp() instead",
    "date": "store value.isoformat() instead",
    "timedelta": "store value.total_seconds() instead",
}


def _refuse(value: Any, path: str, what: str | None = None) -> Any:
    kind = type(value)
    what = what or f"a {kind.__module__}.{kind.__qualname__}"
    hint = _HINTS.get(kind.__name__, "convert it to numbers, strings, tensors, numpy arrays or dicts/lists of them")
    raise CheckpointError(
        f"save_checkpoint: {path} is {what}, which a checkpoint cannot load back "
        f"(torch.load(weights_only=True) refuses it, so the resume would fail); {hint}. Nothing was written"
    )


# ------------------------------------------------------------------------------------- load side
def _decode(value: Any, where: str, path: str) -> Any:
    if isinstance(value, dict) and ENCODED in value:
        return _decode_tagged(value, where, path)
    if isinstance(value, dict):
        out = {k: _decode(v, where, f"{path}[{k!r}]") for k, v in value.items()}
        return type(value)(out) if type(value) in _KEPT_MAPPINGS else out
    if isinstance(value, (list, tuple)):
        items = [_decode(v, where, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _decode_tagged(value: dict[str, Any], where: str, path: str) -> Any:
    kind = value[ENCODED]
    try:
        if kind == "argparse.Namespace":
            attrs = value["attrs"]
            if not (isinstance(attrs, dict) and all(isinstance(k, str) for k in attrs)):
                raise ValueError("its attrs are not a dict of names")
            return argparse.Namespace(**{k: _decode(v, where, f"{path}.{k}") for k, v in attrs.items()})
        if kind == "numpy":
            dtype = np.dtype(value["dtype"])
            if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None or not isinstance(value["data"], bytes):
                raise ValueError(f"dtype {dtype} or its data is not one this engine writes")
            array = np.frombuffer(value["data"], dtype=dtype).reshape(value["shape"]).copy()
            return array[()] if value["scalar"] else array
        raise ValueError(f"{ENCODED} {kind!r} is none this engine writes")
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{where}: {path} is an encoded value this engine cannot rebuild ({err}); the file "
            "was edited or written by another program; load another tag"
        ) from None
