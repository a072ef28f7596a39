"""`deepspeed.checkpoint.utils` -> engine.zero.clone."""

from engine.zero.clone import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
