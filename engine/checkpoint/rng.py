"""The random number generators' states (torch, CUDA, Python, numpy, and the tensor-parallel RNG
tracker's streams), saved per rank so a resumed run draws the same dropout masks and data order as
the uninterrupted one."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from engine.checkpoint.files import CheckpointError
from engine.parallel.random import RNGState, get_rng_tracker


def rng_state() -> dict[str, Any]:
    """This process's generator states, as torch.load(weights_only=True) reads them back (numpy's key
    array as an int64 tensor)."""
    numpy_state = np.random.get_state(legacy=True)
    if isinstance(numpy_state, dict):  # np.random.set_bit_generator replaced MT19937
        raise CheckpointError(
            f"save_checkpoint: numpy's global generator is {numpy_state['bit_generator']}; "
            "checkpoints save only the state of numpy's default generator, MT19937"
        )
    kind, keys, pos, has_gauss, gauss = numpy_state
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracked = get_rng_tracker().get_states()
    if tracked:  # engine.parallel's streams (dropout inside tensor-parallel regions), this rank's own
        state["tracker"] = {
            name: {"cpu": s.cpu} | ({"cuda": s.cuda} if s.cuda is not None else {}) for name, s in tracked.items()
        }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "tracker" in state:
        get_rng_tracker().set_states({name: RNGState(s["cpu"], s.get("cuda")) for name, s in state["tracker"].items()})


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
