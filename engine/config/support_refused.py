"""The support table's rows for DeepSpeed features this engine refuses (ignoring them would change results
or the memory / parallel plan) or warns about (no effect on the trained numbers), with the implemented
values of the same keys beside them (engine/config/support.py says what each status means)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config.support_entry import (
    NON_EMPTY,
    PRESENT,
    TRUE,
    Entry,
    When,
    above,
    changed_from,
    not_in,
    number,
    one_of,
)
from engine.config.support_entry import Status as S
from engine.config.types import CompileConfig

_COMPILE_KEYS_READ = frozenset(f.name for f in dataclasses.fields(CompileConfig))
"""The compile section's keys read into CompileConfig; the others are DeepCompile's."""

_NO_WRITER = "no writer for it in this engine yet; training is unaffected, the metrics are just not written there"


def _tp_size_differs(section: Any) -> bool:
    """tensor_parallel.tp.tp_size above 1 and not autotp_size (DeepSpeed's engine refuses it too)."""
    if not isinstance(section, dict) or not isinstance(section.get("tp"), dict):
        return False
    tp_size = section["tp"].get("tp_size")
    return number(tp_size) and tp_size > 1 and tp_size != section.get("autotp_size")


REFUSED_ENTRIES: tuple[Entry, ...] = (
    # --- refused: ignoring these would change results or the memory / parallel plan ---------------
    Entry(
        "zero_optimization.offload_optimizer.device",
        S.IMPLEMENTED,
        one_of("cpu"),
        "ZeRO-Offload at stages 1-3: the step runs as one fused CPU Adam pass over the fp32 master shards "
        "(averaging, unscale and clip folded in, the bf16/fp16 shard written in the same pass; "
        "engine/zero/master_step.py); CPU training only for now (CUDA training with offload is refused at "
        "initialize); pin_memory, fast_init and cpuadam_cores_perc accepted without effect",
    ),
    Entry(
        "zero_optimization.offload_optimizer.device",
        S.IMPLEMENTED,
        one_of("nvme"),
        "ZeRO-Infinity's optimizer offload at stages 1-3, CPU training: the Adam moments of every fp32 master "
        "shard, and the master itself where it is a copy of a bf16/fp16 shard (stages 1-2), live only in swap "
        "files under nvme_path (one folder per run and rank, removed at exit and by the next start after a "
        "crash); the fused CPU Adam steps them sub_group_size elements at a time through buffer_count host "
        "buffers, with pipeline_read / pipeline_write overlapping the reads and writes "
        "(engine/offload/); Adam-family optimizers only",
    ),
    Entry(
        "zero_optimization.offload_optimizer.ratio",
        S.REFUSED,
        When("< 1", lambda v: isinstance(v, (int, float)) and v < 1),
        "partial optimizer offload (part of the step on the accelerator) is not implemented",
        "remove ratio (or set it to 1)",
    ),
    Entry(
        "zero_optimization.offload_optimizer.super_offload",
        S.REFUSED,
        TRUE,
        "SuperOffload (superchip CPU-GPU offload) is not implemented",
        "remove super_offload or set it to false",
    ),
    Entry(
        "zero_optimization.offload_param.device",
        S.IMPLEMENTED,
        one_of("cpu"),
        "stage 3, CPU training: the partitioned parameters already live in host memory (each rank keeps its "
        "1/N of every parameter there and gathers a unit for its forward and backward), so it changes nothing "
        "and initialize says so; CUDA training: refused at initialize until parameter offload to host memory "
        "has been tested on a GPU; pin_memory, buffer_count, buffer_size and max_in_cpu accepted without effect; "
        "stages 0-2: ignored with a warning, as DeepSpeed ignores it there (valid only with stage 3)",
    ),
    Entry(
        "zero_optimization.offload_param.device",
        S.IMPLEMENTED,
        one_of("nvme"),
        "ZeRO-Infinity's parameter offload at stage 3 with offload_optimizer.device nvme, CPU training: every "
        "trainable fp32 master shard (the only persistent copy of a parameter at stage 3) lives in its swap "
        "file, read by each gather of its unit and by the optimizer step, written by the step "
        "(engine/offload/optimizer_swap.py); frozen parameters' shards stay in memory; buffer_count: the units "
        "whose shards are read ahead of their gathers along the recorded order (default 4); buffer_size and "
        "max_in_cpu accepted without effect (the gathered units are bounded by stage3_max_live_parameters); "
        "another stage or optimizer offload is refused at initialize",
    ),
    Entry(
        "zero_optimization.zero_quantized_weights",
        S.REFUSED,
        TRUE,
        "ZeRO++ quantized weight all-gather changes the numbers and is not implemented",
        "set it to false",
    ),
    Entry(
        "zero_optimization.zero_quantized_nontrainable_weights",
        S.REFUSED,
        TRUE,
        "quantized storage of frozen weights changes the numbers and is not implemented",
        "set it to false",
    ),
    Entry(
        "zero_optimization.zero_quantized_gradients",
        S.REFUSED,
        TRUE,
        "ZeRO++ quantized gradient reduction changes the numbers and is not implemented",
        "set it to false",
    ),
    Entry(
        "zero_optimization.zero_hpz_partition_size",
        S.IMPLEMENTED,
        above(1),
        "ZeRO++ hierarchical partitioning at stage 3: each group of k consecutive ranks keeps a secondary shard "
        "of every trainable unit gathered in a training forward, and the backward's all-gather runs inside the "
        "group (engine/zero/stage3/secondary.py); bitwise equal to plain stage 3, checkpoints interchangeable; "
        "k must divide the world and the ranks per node; not with offload, sequence or tensor parallelism",
    ),
    Entry(
        "zero_optimization.mics_shard_size",
        S.REFUSED,
        above(0),
        "MiCS sharding is not implemented",
        "set it to -1 or remove it",
    ),
    Entry(
        "zero_optimization.zenflow",
        S.REFUSED,
        NON_EMPTY,
        "ZenFlow delays part of the optimizer update, which changes results; not implemented",
        "remove it",
    ),
    Entry(
        "fp16.auto_cast",
        S.IMPLEMENTED,
        TRUE,
        "with fp16 enabled, the engine's forward casts floating tensors among the positional inputs (in "
        "lists, tuples and dicts too) to fp16, as DeepSpeed does; keyword inputs pass unchanged, as in DeepSpeed",
    ),
    Entry(
        "fp16.fp16_master_weights_and_grads",
        S.REFUSED,
        TRUE,
        "fp16 master weights and gradients change the numbers; this engine keeps fp32 master shards",
        "set it to false or remove it",
    ),
    Entry(
        "bf16.bf16_master_weights_and_grads",
        S.REFUSED,
        TRUE,
        "bf16 master weights and gradients change the numbers; this engine keeps fp32 master shards",
        "set it to false or remove it",
    ),
    Entry(
        "bf16.bf16_optimizer_states",
        S.REFUSED,
        TRUE,
        "bf16 optimizer states change the numbers; this engine keeps optimizer states in fp32",
        "set it to false or remove it",
    ),
    Entry(
        "bf16.check_grad_overflow",
        S.ACCEPTED,
        PRESENT,
        "a step whose global gradient norm is inf/nan is always skipped (DeepSpeed 0.19's default, true, which "
        "it honours at stages 1-2; here at every stage, fp32 too), or stops training with "
        "check_for_nan_in_loss_and_grad; false does not apply such a step, which would write NaN into every weight",
    ),
    Entry(
        "amp.enabled",
        S.REFUSED,
        TRUE,
        "Apex AMP is not supported; ignoring it would train in fp32",
        "set amp.enabled to false or remove the amp section",
    ),
    Entry(
        "torch_autocast.enabled",
        S.REFUSED,
        TRUE,
        "torch.autocast in the engine's forward is not implemented; ignoring it would train in fp32",
        "set torch_autocast.enabled to false",
    ),
    Entry(
        "communication_data_type",
        S.REFUSED,
        not_in("fp32", "fp16", "bf16"),
        "only fp32, fp16 and bf16 gradient communication is implemented (no int8 quantised reduction)",
        'set communication_data_type to "fp32", "bf16" or "fp16", or remove it',
    ),
    Entry(
        "data_types.grad_accum_dtype",
        S.REFUSED,
        not_in(
            "fp32",
            "float32",
            "float",
            "torch.float32",
            "fp16",
            "float16",
            "half",
            "torch.float16",
            "bf16",
            "bfloat16",
            "torch.bfloat16",
        ),
        "gradients accumulate in fp32, fp16 or bf16 only",
        'set data_types.grad_accum_dtype to "fp32" or remove it',
    ),
    Entry(
        "optimizer.type",
        S.REFUSED,
        one_of("OneBitAdam", "ZeroOneAdam", "OneBitLamb"),
        "1-bit / 0/1 compressed-communication optimizers are not implemented",
        'use "Adam", "AdamW" or "Lamb"',
    ),
    Entry(
        "optimizer.params.max_grad_norm",
        S.REFUSED,
        PRESENT,
        "DeepSpeed does not clip through optimizer params; silently dropping it would change results",
        "remove it and set the top-level gradient_clipping instead",
    ),
    Entry(
        "elasticity.enabled",
        S.REFUSED,
        TRUE,
        "elastic training rewrites the batch sizes; not implemented",
        "set elasticity.enabled to false",
    ),
    Entry(
        "compression_training",
        S.REFUSED,
        NON_EMPTY,
        "compression (quantization/pruning during training) changes the model; not implemented",
        "remove it",
    ),
    Entry(
        "curriculum_learning.enabled",
        S.REFUSED,
        TRUE,
        "curriculum learning changes the data the model sees; not implemented",
        "set curriculum_learning.enabled to false",
    ),
    Entry(
        "data_efficiency.enabled",
        S.REFUSED,
        TRUE,
        "data sampling/routing changes the data the model sees; not implemented",
        "set data_efficiency.enabled to false",
    ),
    Entry(
        "progressive_layer_drop.enabled",
        S.REFUSED,
        TRUE,
        "progressive layer drop changes the forward pass; not implemented",
        "set progressive_layer_drop.enabled to false",
    ),
    Entry(
        "hybrid_engine.enabled",
        S.REFUSED,
        TRUE,
        "the RLHF hybrid engine is not implemented",
        "set hybrid_engine.enabled to false",
    ),
    Entry(
        "tensor_parallel",
        S.REFUSED,
        When("tp.tp_size > 1 and not equal to autotp_size", _tp_size_differs),
        "tensor_parallel.tp.tp_size (the size DeepSpeed's inference engine reads) must equal "
        "tensor_parallel.autotp_size when above 1, as DeepSpeed requires; training shards by autotp_size",
        "set tensor_parallel.tp.tp_size to the autotp_size value, or remove it",
    ),
    Entry(
        "tensor_parallel.vocab_parallel_lm_head",
        S.REFUSED,
        TRUE,
        "a vocabulary-parallel output head and loss are not implemented (AutoTP keeps the head whole on every rank)",
        "set tensor_parallel.vocab_parallel_lm_head to false or remove it",
    ),
    Entry(
        "tensor_parallel.injection_policy_tuple",
        S.REFUSED,
        When("not null", lambda v: v is not None),
        "an injection policy names layers for DeepSpeed's inference module replacement; AutoTP training "
        "chooses layers by name rules or tensor_parallel.partition_config",
        "write the layers as tensor_parallel.partition_config.layer_specs, or remove it",
    ),
    Entry(
        "tensor_parallel.replace_with_kernel_inject",
        S.REFUSED,
        TRUE,
        "DeepSpeed's inference kernels are not part of this training engine",
        "set it to false or remove it",
    ),
    Entry(
        "tensor_parallel.kernel_inject",
        S.REFUSED,
        TRUE,
        "DeepSpeed's inference kernels are not part of this training engine",
        "set it to false or remove it",
    ),
    Entry(
        "tensor_parallel.tp_overlap_comm",
        S.WARNED,
        TRUE,
        "the row layers' all-reduce is not overlapped with compute; the numbers are the same",
        "remove it to silence this",
    ),
    Entry(
        "pipeline",
        S.REFUSED,
        NON_EMPTY,
        "pipeline parallelism (PipelineModule) is not implemented",
        "remove the pipeline section",
    ),
    Entry(
        "sparse_attention",
        S.REFUSED,
        PRESENT,
        "DeepSpeed sparse attention kernels are not implemented",
        "remove the sparse_attention section",
    ),
    Entry(
        "quantize_training.enabled",
        S.REFUSED,
        TRUE,
        "MoQ quantization during training changes the weights; not implemented",
        "set quantize_training.enabled to false",
    ),
    Entry(
        "weight_quantization",
        S.REFUSED,
        NON_EMPTY,
        "weight quantization at init/after load changes the weights; not implemented",
        "remove it",
    ),
    # --- warned: accepted, no effect on the trained numbers ----------------------------------------
    Entry("trackio.enabled", S.WARNED, TRUE, _NO_WRITER, "use csv_monitor, or set it to false"),
    Entry(
        "activation_checkpointing",
        S.IMPLEMENTED,
        PRESENT,
        "configures engine.checkpointing (DeepSpeed's deepspeed.checkpointing) at initialize: "
        "partition_activations (P_a over the tensor-parallel group), cpu_checkpointing (pinned host memory "
        "on CUDA; no effect on CPU), contiguous_memory_optimization (checkpoints in one arena sized by "
        "number_checkpoints), synchronize_checkpoint_boundary, profile; the model calls "
        "engine.checkpointing.checkpoint(block, x)",
    ),
    Entry("autotuning.enabled", S.WARNED, TRUE, "the autotuner is not implemented", "set it to false"),
    Entry(
        "aio",
        S.IMPLEMENTED,
        PRESENT,
        "the NVMe swap files' I/O (engine/ops/aio.py): block_size (bytes per request) honoured; thread_count "
        "/ intra_op_parallelism x queue_depth = requests in flight, as in DeepSpeed (one blocking thread each, "
        "at most 64); single_submit and overlap_events accepted (a thread submits one request at a time, "
        "transfers always overlap the caller); use_gds must be false",
    ),
    Entry(
        "checkpoint",
        S.WARNED,
        changed_from(
            {
                "tag_validation": "Warn",
                "load_universal": False,
                "use_node_local_storage": False,
                "parallel_write": {"pipeline_stage": False},
                "writer": None,
            }
        ),
        "tag validation / universal / node-local / parallel-write options are not read; checkpoints are "
        "resharded on load by default",
        "remove the section to silence this",
    ),
    Entry(
        "nebula.enabled",
        S.WARNED,
        TRUE,
        "the Nebula checkpoint service is not supported; checkpoints are written by the engine's own writer",
        "set it to false",
    ),
    Entry(
        "timers",
        S.WARNED,
        changed_from({"throughput": {"enabled": True, "synchronized": True}}),
        "throughput timers are always on in the progress log",
        "remove it",
    ),
    Entry("dump_state", S.WARNED, TRUE, "state dumping is not implemented", "set it to false"),
    Entry(
        "sparse_gradients",
        S.WARNED,
        TRUE,
        "sparse (CSR) embedding-gradient reduction is not implemented; gradients are reduced dense, "
        "which gives the same result",
        "set it to false",
    ),
    Entry(
        "eigenvalue.enabled",
        S.WARNED,
        TRUE,
        "eigenvalue computation only feeds MoQ / layer drop, which are refused",
        "set it to false",
    ),
    Entry(
        "compile.deepcompile",
        S.REFUSED,
        TRUE,
        "DeepCompile (DeepSpeed's compiler passes that schedule ZeRO's gathers and reductions inside the graph) is "
        "not implemented; engine.compile() compiles the model between the engine's hooks instead",
        "remove compile.deepcompile (or set it to false) and compile with engine.compile(), the Trainer's "
        'torch_compile=True, or "compile": {"enabled": true}',
    ),
    Entry(
        "compile",
        S.REFUSED,
        When(
            "enabled true with disable true",
            lambda v: isinstance(v, dict) and v.get("enabled") is True and v.get("disable") is True,
        ),
        "compile.enabled and compile.disable say opposite things",
        "keep one of them: enabled true (or disable false) compiles at initialize",
    ),
    Entry(
        "compile",
        S.WARNED,
        When(
            "a DeepCompile option",
            lambda v: isinstance(v, dict) and bool(set(v) - _COMPILE_KEYS_READ - {"deepcompile"}),
        ),
        "DeepCompile's options (free_activation, offload_activation, offload_opt_states, double_buffer, passes, ...) "
        "act only with deepcompile, which is not implemented",
        "remove them",
    ),
    Entry("graph_harvesting", S.WARNED, TRUE, "CUDA-graph harvesting is not implemented", "set it to false"),
    Entry("disable_allgather", S.WARNED, TRUE, "legacy option with no effect", "remove it"),
    Entry("optimizer.legacy_fusion", S.WARNED, TRUE, "legacy fused-optimizer switch with no effect", "remove it"),
)
