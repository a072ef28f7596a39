"""client_state is checked when it is saved, so that what saves also loads.

Rank 0's model-states file is read back with torch.load(weights_only=True), whose unpickler accepts
tensors, Python scalars, strings, bytes, None, and dicts/lists/tuples/sets of them (plus a few torch
types), and nothing else. `save_checkpoint(d, client_state={"best": np.float64(1.5)})` used to save
and then fail to load with a bare UnpicklingError, losing the resume. Here every value is walked
before anything is written: what converts without losing information is converted (numpy scalars to
Python numbers, numpy arrays to tensors, paths to strings, defaultdict/OrderedDict and other dict
subclasses to dict, namedtuples to tuples), anything else is refused with its key path, its type and
the fix. A final round trip through the same unpickler guards against what the walk does not know.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from engine.checkpoint.files import CheckpointError

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_TORCH_LEAVES = (torch.Tensor, torch.dtype, torch.device, torch.Size)


def prepare_client_state(client_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of client_state that torch.load(weights_only=True) reads back; CheckpointError otherwise."""
    if client_state is None:
        return {}
    if not isinstance(client_state, Mapping):
        raise CheckpointError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
    prepared = _convert(client_state, "client_state")
    buffer = io.BytesIO()
    torch.save(prepared, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"save_checkpoint: client_state would not load back with torch.load(weights_only=True) "
                              f"({str(err).splitlines()[0]}); keep to numbers, strings, tensors and "
                              "dicts/lists/tuples of them") from None
    return prepared


def _convert(value: Any, path: str) -> Any:
    if isinstance(value, np.generic):  # first: np.float64 is a float subclass, which the unpickler refuses
        if isinstance(value, (np.bool_, np.integer, np.floating, np.complexfloating)):
            return value.item()  # np.float64 -> float, np.int64 -> int: the same value
        return _refuse(value, path)
    if type(value) in _SCALARS or isinstance(value, _TORCH_LEAVES):
        return value
    if isinstance(value, _SCALARS):  # a subclass of str/int/float (an IntEnum, a str subclass): its base value
        return next(base for base in _SCALARS if isinstance(value, base))(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biufc":
            return torch.from_numpy(np.ascontiguousarray(value).copy())
        return _refuse(value, path)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise CheckpointError(f"save_checkpoint: {path} has a key of type {type(key).__name__} ({key!r}); "
                                      "client_state keys must be strings or numbers")
            out[key] = _convert(item, f"{path}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        items = [_convert(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        return type(value)(_convert(item, f"{path}{{{item!r}}}") for item in value)
    return _refuse(value, path)


_HINTS = {
    "Namespace": "store vars(args) (a dict) instead",
    "datetime": "store value.isoformat() or value.timestamp() instead",
    "date": "store value.isoformat() instead",
    "timedelta": "store value.total_seconds() instead",
}


def _refuse(value: Any, path: str) -> Any:
    kind = type(value)
    hint = _HINTS.get(kind.__name__, "convert it to numbers, strings, tensors or dicts/lists of them")
    raise CheckpointError(
        f"save_checkpoint: {path} is a {kind.__module__}.{kind.__qualname__}, which a checkpoint cannot load back "
        f"(torch.load(weights_only=True) refuses it, so the resume would fail); {hint}. Nothing was written")
