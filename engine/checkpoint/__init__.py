"""Sharded checkpoints: engine.save_checkpoint / engine.load_checkpoint (store.py, given the
TrainingState of training_state.py), the directory layout and manifest (files.py), the name-and-offset
description of every rank's shards (records.py), reading saved pieces back (piece_reader.py), the RNG
states (rng.py), the names and manifest section of tensor-parallel slices (tensor_parallel.py), and
`python -m engine.checkpoint.consolidate` (one state dict from a checkpoint)."""

from engine.checkpoint.files import CheckpointError

__all__ = ["CheckpointError"]
