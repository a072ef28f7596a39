"""DeepSpeed entry points for features this engine does not implement, so a client that reaches for
one (Hugging Face Trainer/Accelerate with a TP size above 1)
stops at once with an error naming the setting that asked for it and what to do instead, never an
AttributeError or ImportError from inside a `deepspeed` alias package.

Config keys are refused by engine/config/support.py when the config is loaded; these are the code
paths that run before a config reaches initialize. (`tensor_parallel.autotp_size` works with engine.initialize; only the Hugging Face
path to it is refused here.)
"""

from __future__ import annotations

from typing import Any, NoReturn


class UnsupportedFeatureError(NotImplementedError):
    """A DeepSpeed feature this engine does not implement; the message names the setting and the fix."""


def tp_model_init(model: Any = None, tp_size: int = 1, dtype: Any = None, config: Any = None, **_: Any) -> NoReturn:
    """`deepspeed.tp_model_init` reached through the `deepspeed` alias package (Hugging Face Trainer /
    Accelerate with tp_size > 1): refused. engine.tp_model_init and tensor_parallel.autotp_size work with
    engine.initialize, but the Trainer's own data loading under tensor parallelism is untested here,
    and every rank of a tensor-parallel group must read the same batch."""
    raise UnsupportedFeatureError(
        f"tensor_parallel.autotp_size = {tp_size} through Hugging Face Trainer/Accelerate (deepspeed.tp_model_init): "
        "tensor parallelism is not supported on this path (the Trainer's data loading under tensor parallelism is "
        "untested with this engine); remove tensor_parallel from the DeepSpeed config (or set autotp_size to 1; for "
        "HF TrainingArguments, drop tp_size) and train data-parallel with ZeRO stage 3, or call "
        "engine.initialize(...) with tensor_parallel.autotp_size in your own training loop"
    )
