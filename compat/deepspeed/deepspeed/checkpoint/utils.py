"""`deepspeed.checkpoint.utils` -> engine.checkpoint.clone."""

from engine.checkpoint.clone import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
