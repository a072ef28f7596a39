"""DeepSpeed entry points for features this engine does not implement, so a client that reaches for
one (Hugging Face Trainer/Accelerate with a TP size above 1, or torch_compile)
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


def refuse_compile(backend: Any = None, compile_kwargs: Any = None, **_: Any) -> NoReturn:
    """`DeepSpeedEngine.compile`: compiling through the engine is not implemented."""
    raise UnsupportedFeatureError(
        f"engine.compile(backend={backend!r}) (torch_compile through DeepSpeed) is not implemented by this "
        "engine; train without it: TrainingArguments(torch_compile=False), or Accelerate's dynamo_backend "
        "'no' (unset ACCELERATE_DYNAMO_BACKEND)"
    )


def refuse_zero3_hook_internals() -> NoReturn:
    """`optimizer.parameter_offload` at stage 3: DeepSpeed's DeepSpeedZeRoOffload, holding its stage-3 module
    hooks. TRL's generation with ds3_gather_for_generation=True (trl.models.utils.unwrap_model_for_generation:
    GRPO, RLOO, online distillation, LogCompletionsCallback) gathers every parameter, then removes those hooks
    (forward_hooks, backward_hooks, param.ds_active_sub_modules, module.ds_external_parameters) and re-adds them
    after generation (param_coordinator._invalidate_trace, _register_deepspeed_module). This engine's stage-3
    hooks are its own (engine/zero/stage3/stage.py) and have no such handles. Generation through them works: each
    forward gathers and releases each layer, as in training."""
    raise UnsupportedFeatureError(
        "TRL generation at ZeRO stage 3 with ds3_gather_for_generation=True (GRPO, RLOO, online distillation: "
        "trl's unwrap_model_for_generation) removes and re-adds DeepSpeed's own stage-3 hooks through "
        "optimizer.parameter_offload (forward_hooks, param_coordinator, _register_deepspeed_module), which this "
        "engine's stage 3 does not have; set ds3_gather_for_generation=False in GRPOConfig/RLOOConfig (generation "
        "then gathers each layer as it runs, as a training forward does: less memory, slower), or train at ZeRO "
        "stage 2"
    )
