"""`deepspeed.utils.zero_to_fp32` -> engine.checkpoint.zero_to_fp32: the consolidated fp32 state dict and
the files of a tag directory, over the engine's own checkpoints and DeepSpeed's (Lightning's
convert_zero_checkpoint_to_fp32_state_dict uses the first three)."""

from engine.checkpoint.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_checkpoint_files,
    get_fp32_state_dict_from_zero_checkpoint,
    get_model_state_file,
    get_model_state_files,
    get_optim_files,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
]
