"""The support table's rows for keys the engine reads: implemented, other spellings, and accepted without
effect (engine/config/support.py says what each status means; support_refused.py holds the rest)."""

from __future__ import annotations

from engine.config.support_entry import PRESENT, Entry
from engine.config.support_entry import Status as S

READ_ENTRIES: tuple[Entry, ...] = (
    # --- implemented -------------------------------------------------------------------------------
    Entry(
        "train_batch_size",
        S.IMPLEMENTED,
        PRESENT,
        "global samples per optimizer step; DeepSpeed's batch rules",
    ),
    Entry("train_micro_batch_size_per_gpu", S.IMPLEMENTED, PRESENT, "samples per rank per micro-step"),
    Entry("gradient_accumulation_steps", S.IMPLEMENTED, PRESENT, "micro-steps per optimizer step"),
    Entry("optimizer", S.IMPLEMENTED, PRESENT, "type and params, built by engine/optim"),
    Entry("scheduler", S.IMPLEMENTED, PRESENT, "type and params, built by engine/optim"),
    Entry(
        "gradient_clipping",
        S.IMPLEMENTED,
        PRESENT,
        "global grad-norm clipping; default 1.0 as DeepSpeed 0.19.8",
    ),
    Entry(
        "check_for_nan_in_loss_and_grad",
        S.IMPLEMENTED,
        PRESENT,
        "engine-specific, Megatron-LM's name: true stops fp32/bf16 training with NonFiniteGradientError at a step "
        "whose global gradient norm is inf/nan, before anything is updated; false (default) skips the step with a "
        "warning and counts it in skipped_steps (fp16: its loss scaler skips overflows either way)",
    ),
    Entry("prescale_gradients", S.IMPLEMENTED, PRESENT, "divide gradients before the all-reduce"),
    Entry("gradient_predivide_factor", S.IMPLEMENTED, PRESENT, "pre-division factor for the all-reduce"),
    Entry(
        "communication_data_type",
        S.IMPLEMENTED,
        PRESENT,
        "dtype gradients are reduced in (fp32, fp16, bf16); null = the gradients' own dtype, as DeepSpeed",
    ),
    Entry(
        "data_types.grad_accum_dtype",
        S.IMPLEMENTED,
        PRESENT,
        "dtype gradients accumulate and stay in until the optimizer step reads them (the full buffer of "
        "stages 0-1, the gradient shard of stages 2-3); default the parameter dtype, as DeepSpeed "
        '(bf16 training: 2 bytes per gradient element); "fp32" for fp32 accumulation',
    ),
    Entry("comms_logger", S.IMPLEMENTED, PRESENT, "enabled: bytes sent per collective type at each step log line"),
    Entry(
        "steps_per_print",
        S.IMPLEMENTED,
        PRESENT,
        "period of the progress log line; null or Infinity (what HF Accelerate writes) = never",
    ),
    Entry("wall_clock_breakdown", S.IMPLEMENTED, PRESENT, "per-phase timers in the progress log"),
    Entry(
        "memory_breakdown",
        S.IMPLEMENTED,
        PRESENT,
        "rank 0's model-state bytes per category (memory_report) and peak RSS at every steps_per_print line",
    ),
    Entry("csv_monitor", S.IMPLEMENTED, PRESENT, "CSV metrics writer (engine/monitor)"),
    Entry(
        "flops_profiler",
        S.IMPLEMENTED,
        PRESENT,
        "rank 0 profiles the forward of step profile_step (torch.utils.flop_counter per module; latency, "
        "params) and prints DeepSpeed's report (module_depth, top_modules, detailed, output_file); then the "
        "progress log and the monitors show achieved TFLOPs and MFU against a measured matmul peak; "
        "recompute_fwd_factor adds the recomputed forwards (engine/profiling)",
    ),
    Entry(
        "tensorboard",
        S.IMPLEMENTED,
        PRESENT,
        "TensorBoard event files in output_path/job_name from rank 0 (needs the tensorboard package: "
        "pip install 'zero-engine[tensorboard]'; missing, enabling it is a ConfigError)",
    ),
    Entry(
        "wandb",
        S.IMPLEMENTED,
        PRESENT,
        "Weights & Biases run from rank 0: wandb.init(project, group, entity=team) (pip install "
        "'zero-engine[wandb]'; WANDB_MODE=offline works without an account)",
    ),
    Entry(
        "comet",
        S.IMPLEMENTED,
        PRESENT,
        "Comet experiment from rank 0 with every key (comet_ml.start; samples_log_interval honoured; "
        "pip install 'zero-engine[comet]'; online: false writes an offline archive)",
    ),
    Entry(
        "zero_optimization",
        S.IMPLEMENTED,
        PRESENT,
        "stages 0-2: reduce_bucket_size, allgather_bucket_size (elements of all-gathers in flight; both "
        "absent: sized from the link's latency and bandwidth measured at start, logged), "
        "overlap_comm (stage 2: two bucket buffers in flight), reduce_scatter (false: all-reduce), "
        "allgather_partitions (false: broadcasts), contiguous_gradients (always on), ignore_unused_parameters "
        "(false: a step where a trainable parameter got no gradient is refused, naming it and the ranks; "
        "DeepSpeed asserts only with offload), round_robin_gradients "
        "(accepted, no effect without offload); stage 3: gather units of repeated blocks plus a root unit, or "
        "the modules named by leaf_module {classes, names, name_suffixes} / engine.zero.set_z3_leaf_modules; "
        "stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_param_persistence_threshold, "
        "stage3_max_reuse_distance (elements of other units used before a unit's next use) and "
        "stage3_gather_16bit_weights_on_model_save (save_16bit_model) and stage3_module_granularity_threshold "
        "(consecutive sibling blocks under that many elements merged into one unit up to that size) honoured; "
        "memory_efficient_linear (default true: F.linear saves stage-3 weights, not views of their gathered "
        "unit, so a released unit's memory is freed before its backward); "
        "our stage3_arena_bytes sizes the pre-touched arena that gathered units and gradient buckets come from "
        'on CPU ("auto": from the units and stage3_max_live_parameters, the worst case; a number of bytes: '
        "requests past it come from the default allocator, logged once; absent or 0: off); "
        "sub_group_size: elements of optimizer state swapped and stepped at a time with NVMe offload; "
        "stage3_model_persistence_threshold accepted without effect",
    ),
    Entry("zero_allow_untested_optimizer", S.IMPLEMENTED, PRESENT, "read into EngineConfig"),
    Entry(
        "zero_force_ds_cpu_optimizer",
        S.ACCEPTED,
        PRESENT,
        "accepted: the offloaded step is always the engine's fused CPU Adam (engine/zero/master_step.py)",
    ),
    Entry(
        "dataloader_drop_last",
        S.IMPLEMENTED,
        PRESENT,
        "drop the last incomplete batch of the engine's loader",
    ),
    Entry(
        "fp16",
        S.IMPLEMENTED,
        PRESENT,
        "fp16 model, fp32 master shards, dynamic (or static loss_scale) loss scaling with DeepSpeed's keys; "
        "an overflow on any rank skips the step everywhere",
    ),
    Entry("bf16", S.IMPLEMENTED, PRESENT, "bf16 model with fp32 master shards (no loss scaling needed)"),
    Entry(
        "bf16.immediate_grad_update",
        S.ACCEPTED,
        PRESENT,
        "gradients always go into their fp32 accumulation as they arrive; same numbers either way",
    ),
    Entry(
        "collectives",
        S.IMPLEMENTED,
        PRESENT,
        'engine-specific, not a DeepSpeed key: "engine" (default; on gloo the engine\'s point-to-point '
        'reduce-scatter and all-gather as direct exchanges, torch\'s elsewhere), "ring" (the same as rings: '
        'two neighbours per rank, N-1 steps; for large groups on thin networks) or "native" (torch\'s '
        "everywhere); ZERO_ENGINE_COLLECTIVES=engine|ring|native overrides it",
    ),
    Entry(
        "tensor_parallel.autotp_size",
        S.IMPLEMENTED,
        PRESENT,
        "AutoTP: the tensor-parallel size (EngineConfig.autotp_size; 0 or 1: off); engine.tp_model_init "
        "shards the model's attention and MLP Linears by name (engine/parallel/autotp.py)",
    ),
    Entry(
        "tensor_parallel.partition_config",
        S.IMPLEMENTED,
        PRESENT,
        "DeepSpeed's layer specs decide which Linears AutoTP splits: row, column (shape [N, -1]: N equal "
        "parts, each split), skip; model_types, use_default_specs and strict_mode as DeepSpeed reads them "
        "(engine/config/autotp_specs.py); unequal parts, gather_output, grad_allreduce and other shapes are "
        "refused by key path",
    ),
    Entry(
        "tensor_parallel.preset_model",
        S.IMPLEMENTED,
        PRESENT,
        "DeepSpeed's presets (llama, qwen2, bloom, chatglm, phi3, mixtral, deepseek_v2) as the same layer specs",
    ),
    Entry(
        "tensor_parallel.vocab_parallel_ce_backend",
        S.ACCEPTED,
        PRESENT,
        "only read with vocab_parallel_lm_head, which is refused",
    ),
    Entry(
        "tensor_parallel.dtype",
        S.ACCEPTED,
        PRESENT,
        "DeepSpeed's AutoTP training takes the precision from the bf16/fp16 sections, as the engine does",
    ),
    Entry(
        "tensor_parallel.keep_module_on_host",
        S.ACCEPTED,
        PRESENT,
        "where DeepSpeed keeps weights while it loads a checkpoint into sharded layers for inference; the "
        "engine shards the model in place",
    ),
    Entry(
        "compile.enabled",
        S.IMPLEMENTED,
        PRESENT,
        "true: engine.initialize compiles the model in place with torch.compile (engine.compile() with "
        "compile.backend and compile.kwargs); at stage 3 the graph breaks at each gather unit (docs/compile.md)",
    ),
    Entry("compile.disable", S.IMPLEMENTED, PRESENT, "axolotl's spelling: false is compile.enabled true"),
    Entry(
        "compile.backend",
        S.IMPLEMENTED,
        PRESENT,
        "torch.compile's backend for engine.compile() called without one (default inductor): a registered name or "
        "the dotted path of a callable",
    ),
    Entry(
        "compile.kwargs",
        S.IMPLEMENTED,
        PRESENT,
        "torch.compile's other arguments (mode, fullgraph, dynamic, options) for engine.compile() called without "
        "compile_kwargs",
    ),
    Entry(
        "seed",
        S.IMPLEMENTED,
        PRESENT,
        "engine-specific, not a DeepSpeed key: seeds the shuffle of the engine's DistributedSampler (default 0)",
    ),
    Entry(
        "sequence_parallel_size",
        S.IMPLEMENTED,
        PRESENT,
        "DeepSpeed-Ulysses sequence parallelism: the ranks that split each sample's tokens (consecutive ranks; "
        "made at initialize unless UlyssesSPAttentionHF.register_with_transformers or mpu= made them, whose "
        "size it must then equal); batch sizes count world / sequence_parallel_size replicas and ZeRO "
        "partitions over every rank; with tensor parallelism refused",
    ),
    # --- other spellings ---------------------------------------------------------------------------
    Entry("bfloat16", S.ALIAS, PRESENT, "old name of bf16; read as bf16"),
    Entry(
        "seq_parallel_communication_data_type",
        S.ALIAS,
        PRESENT,
        "name in DeepSpeed's docs; read as seq_parallel_comm_data_type",
    ),
    Entry(
        "allgather_size",
        S.ALIAS,
        PRESENT,
        'legacy companion of "zero_optimization": true; read as zero_optimization.allgather_bucket_size',
    ),
    # --- accepted, no effect -----------------------------------------------------------------------
    Entry("vocabulary_size", S.ACCEPTED, PRESENT, "DeepSpeed only uses it for a tensor-core alignment warning"),
    Entry("use_data_before_expert_parallelism", S.ACCEPTED, PRESENT, "only matters with MoE expert parallelism"),
    Entry(
        "seq_parallel_comm_data_type",
        S.ACCEPTED,
        PRESENT,
        "only used by sequence parallelism, which is refused",
    ),
    Entry("elasticity", S.ACCEPTED, PRESENT, "harmless while elasticity.enabled is false"),
)
