"""`deepspeed.runtime.activation_checkpointing`: where DeepSpeed keeps `checkpointing`."""

from deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
