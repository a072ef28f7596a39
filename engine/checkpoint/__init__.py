"""Sharded checkpoints: engine.save_checkpoint / engine.load_checkpoint (store.py, given the
TrainingState of training_state.py), the directory layout and manifest (files.py), files that appear
whole or not at all (atomic_file.py), reading saved pieces back (piece_reader.py), the RNG states
(rng.py), the client state (client_state.py), the names and manifest section of tensor-parallel slices
(tensor_parallel.py), and `python -m engine.checkpoint.consolidate` / zero_to_fp32.py (one state dict
from a checkpoint). What each rank holds comes from its stage as named pieces (engine/zero/records.py):
this package sits above the stages and never changes them."""

from engine.checkpoint.files import CheckpointError

__all__ = ["CheckpointError"]
