"""What this engine does with each DeepSpeed config key: the one support table.

Every top-level key of the schema has at least one entry. An entry is data: a key path, a status, the
value condition under which the status applies, why, and what to do. Implementing a feature later means
flipping its entry from REFUSED to IMPLEMENTED here, nothing else.

- REFUSED: ignoring the key would silently change results or the memory/parallel plan, so loading fails
  with a ConfigError that names the key and the fix.
- WARNED: ignoring it cannot change the trained numbers (logging, profiling, I/O tuning); a
  ConfigWarning is emitted once per key per process.
- IMPLEMENTED: read into EngineConfig and acted on. ACCEPTED: read, harmless, no effect, no warning.
  ALIAS: another spelling, renamed by engine/config/aliases.py before this table is consulted.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import paths


class Status(str, enum.Enum):
    IMPLEMENTED = "implemented"
    ACCEPTED = "accepted"
    ALIAS = "alias"
    WARNED = "warned"
    REFUSED = "refused"


@dataclass(frozen=True)
class When:
    """A condition on a key's value, with the words the docs table shows for it."""

    text: str
    test: Callable[[Any], bool]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _tp_size_differs(section: Any) -> bool:
    """tensor_parallel.tp.tp_size above 1 and not autotp_size (DeepSpeed's engine refuses it too)."""
    if not isinstance(section, dict) or not isinstance(section.get("tp"), dict):
        return False
    tp_size = section["tp"].get("tp_size")
    return _number(tp_size) and tp_size > 1 and tp_size != section.get("autotp_size")


PRESENT = When("present", lambda v: True)
TRUE = When("true", lambda v: v is True)
NON_EMPTY = When("a non-empty object", lambda v: bool(v))
_UNSET = object()


def _changed(section: Mapping[str, Any], defaults: Mapping[str, Any]) -> bool:
    """True when `section` sets any key to something other than DeepSpeed's default."""
    for key, value in section.items():
        default = defaults.get(key, _UNSET)
        if isinstance(value, dict) and isinstance(default, dict):
            if _changed(value, default):
                return True
        elif isinstance(value, str) and isinstance(default, str):
            if value.lower() != default.lower():
                return True
        elif value != default:
            return True
    return False


def changed_from(defaults: Mapping[str, Any]) -> When:
    """A section with a non-default key; a section that only restates defaults is not worth a warning."""
    return When("a key differs from its default", lambda v: isinstance(v, dict) and _changed(v, defaults))


def above(limit: int) -> When:
    return When(f"> {limit}", lambda v: _number(v) and v > limit)


def not_in(*allowed: str) -> When:
    """Strings other than `allowed` (case-insensitive, as DeepSpeed lower-cases dtype names)."""
    low = {a.lower() for a in allowed}
    return When("not " + " / ".join(allowed), lambda v: isinstance(v, str) and v.lower() not in low)


def one_of(*names: str) -> When:
    low = {n.lower() for n in names}
    return When(" / ".join(names), lambda v: isinstance(v, str) and v.lower() in low)


@dataclass(frozen=True)
class Entry:
    path: str
    status: Status
    when: When
    reason: str
    fix: str = ""


S = Status
_NO_WRITER = (
    "no writer for it in this engine yet; training is unaffected, the metrics are just not written there"
)

TABLE: tuple[Entry, ...] = (
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
        "(bf16 training: 2 bytes per gradient element); \"fp32\" for fp32 accumulation",
    ),
    Entry("comms_logger", S.IMPLEMENTED, PRESENT, "enabled: bytes sent per collective type at each step log line"),
    Entry("steps_per_print", S.IMPLEMENTED, PRESENT, "period of the progress log line; null or Infinity (what HF Accelerate writes) = never"),
    Entry("wall_clock_breakdown", S.IMPLEMENTED, PRESENT, "per-phase timers in the progress log"),
    Entry("memory_breakdown", S.IMPLEMENTED, PRESENT,
          "rank 0's model-state bytes per category (memory_report) and peak RSS at every steps_per_print line"),
    Entry("csv_monitor", S.IMPLEMENTED, PRESENT, "CSV metrics writer (engine/monitor)"),
    Entry("flops_profiler", S.IMPLEMENTED, PRESENT,
          "rank 0 profiles the forward of step profile_step (torch.utils.flop_counter per module; latency, "
          "params) and prints DeepSpeed's report (module_depth, top_modules, detailed, output_file); then the "
          "progress log and the monitors show achieved TFLOPs and MFU against a measured matmul peak; "
          "recompute_fwd_factor adds the recomputed forwards (engine/profiling)"),
    Entry("tensorboard", S.IMPLEMENTED, PRESENT,
          "TensorBoard event files in output_path/job_name from rank 0 (needs the tensorboard package: "
          "pip install 'zero-engine[tensorboard]'; missing, enabling it is a ConfigError)"),
    Entry("wandb", S.IMPLEMENTED, PRESENT,
          "Weights & Biases run from rank 0: wandb.init(project, group, entity=team) (pip install "
          "'zero-engine[wandb]'; WANDB_MODE=offline works without an account)"),
    Entry("comet", S.IMPLEMENTED, PRESENT,
          "Comet experiment from rank 0 with every key (comet_ml.start; samples_log_interval honoured; "
          "pip install 'zero-engine[comet]'; online: false writes an offline archive)"),
    Entry(
        "zero_optimization",
        S.IMPLEMENTED,
        PRESENT,
        "stages 0-2: reduce_bucket_size, allgather_bucket_size (elements of all-gathers in flight; both "
        "absent: sized from the link's latency and bandwidth measured at start, logged), "
        "overlap_comm (stage 2: two bucket buffers in flight), reduce_scatter (false: all-reduce), "
        "allgather_partitions (false: broadcasts), contiguous_gradients (always on), round_robin_gradients "
        "(accepted, no effect without offload); stage 3: gather units of repeated blocks plus a root unit, or "
        "the modules named by leaf_module {classes, names, name_suffixes} / engine.zero.set_z3_leaf_modules; "
        "stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_param_persistence_threshold, "
        "stage3_max_reuse_distance (elements of other units used before a unit's next use) and "
        "stage3_gather_16bit_weights_on_model_save (save_16bit_model) and stage3_module_granularity_threshold "
        "(consecutive sibling blocks under that many elements merged into one unit up to that size) honoured; "
        "memory_efficient_linear (default true: F.linear saves stage-3 weights, not views of their gathered "
        "unit, so a released unit's memory is freed before its backward); "
        "our stage3_arena_bytes sizes the pre-touched arena that gathered units and gradient buckets come from "
        "on CPU (\"auto\": from the units and stage3_max_live_parameters; absent or 0: off); "
        "stage3_model_persistence_threshold and sub_group_size accepted without effect",
    ),
    Entry("zero_allow_untested_optimizer", S.IMPLEMENTED, PRESENT, "read into EngineConfig"),
    Entry("zero_force_ds_cpu_optimizer", S.ACCEPTED, PRESENT,
          "accepted: the offloaded step is always the engine's fused CPU Adam (engine/zero/master_step.py)"),
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
    Entry("collectives", S.IMPLEMENTED, PRESENT,
          'engine-specific, not a DeepSpeed key: "engine" (default; on gloo the engine\'s point-to-point '
          'reduce-scatter and all-gather as direct exchanges, torch\'s elsewhere), "ring" (the same as rings: '
          'two neighbours per rank, N-1 steps; for large groups on thin networks) or "native" (torch\'s '
          "everywhere); ZERO_ENGINE_COLLECTIVES=engine|ring|native overrides it"),
    Entry(
        "tensor_parallel.autotp_size",
        S.IMPLEMENTED,
        PRESENT,
        "AutoTP: the tensor-parallel size (EngineConfig.autotp_size; 0 or 1: off); engine.tp_model_init "
        "shards the model's attention and MLP Linears by name (engine/parallel/autotp.py)",
    ),
    Entry("seed", S.IMPLEMENTED, PRESENT, "engine-specific, not a DeepSpeed key: seeds the shuffle of the engine's DistributedSampler (default 0)"),
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
    Entry(
        "vocabulary_size", S.ACCEPTED, PRESENT, "DeepSpeed only uses it for a tensor-core alignment warning"
    ),
    Entry(
        "use_data_before_expert_parallelism", S.ACCEPTED, PRESENT, "only matters with MoE expert parallelism"
    ),
    Entry(
        "seq_parallel_comm_data_type",
        S.ACCEPTED,
        PRESENT,
        "only used by sequence parallelism, which is refused",
    ),
    Entry("elasticity", S.ACCEPTED, PRESENT, "harmless while elasticity.enabled is false"),
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
        S.REFUSED,
        one_of("nvme"),
        "NVMe optimizer offload (ZeRO-Infinity) is not implemented; the memory plan you asked for would "
        "silently not happen",
        'use "cpu" or "none"',
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
        S.REFUSED,
        one_of("nvme"),
        "NVMe parameter offload (ZeRO-Infinity) is not implemented; the memory plan you asked for would "
        "silently not happen",
        'use "cpu" (stage 3) or "none", or remove offload_param',
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
        S.REFUSED,
        above(1),
        "ZeRO++ hierarchical partitioning is not implemented",
        "set it to 1 or remove it",
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
        not_in("fp32", "float32", "float", "torch.float32", "fp16", "float16", "half", "torch.float16", "bf16",
               "bfloat16", "torch.bfloat16"),
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
        "sequence_parallel_size",
        S.REFUSED,
        above(1),
        "sequence parallelism is not implemented; it also changes the data-parallel world size",
        "set sequence_parallel_size to 1 or remove it",
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
        S.WARNED,
        changed_from(
            {
                "block_size": 1048576,
                "queue_depth": 8,
                "thread_count": 1,
                "intra_op_parallelism": 1,
                "single_submit": False,
                "overlap_events": True,
                "use_gds": False,
            }
        ),
        "async I/O only tunes NVMe offload, which is refused",
        "remove it",
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
        "compile",
        S.WARNED,
        NON_EMPTY,
        "DeepCompile options are not read; use torch.compile on the model",
        "remove it",
    ),
    Entry("graph_harvesting", S.WARNED, TRUE, "CUDA-graph harvesting is not implemented", "set it to false"),
    Entry("disable_allgather", S.WARNED, TRUE, "legacy option with no effect", "remove it"),
    Entry(
        "optimizer.legacy_fusion", S.WARNED, TRUE, "legacy fused-optimizer switch with no effect", "remove it"
    ),
)


def _value_text(value: Any) -> str:
    """The value as the user wrote it (JSON), shortened for whole sections."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def check_support(
    config: Mapping[str, Any], origins: Mapping[str, str] | None = None
) -> tuple[list[str], list[tuple[str, str]]]:
    """(refusal messages, (key, warning) pairs) for the canonical config."""
    origins = origins or {}
    problems: list[str] = []
    warned: list[tuple[str, str]] = []
    for entry in TABLE:
        if entry.status not in (Status.REFUSED, Status.WARNED):
            continue
        value = paths.get(config, paths.split(entry.path))
        if value is None or not entry.when.test(value):
            continue
        origin = _origin(entry.path, origins)
        written = f" (from {origin})" if origin else ""
        head = f"{entry.path}: {_value_text(value)}{written}"
        if entry.status is Status.REFUSED:
            problems.append(f"{head} is not supported: {entry.reason}; fix: {entry.fix}")
        else:
            message = f"{head} is accepted but has no effect here: {entry.reason}; {entry.fix}"
            warned.append((entry.path, message))
    return problems, warned


def _origin(path: str, origins: Mapping[str, str]) -> str | None:
    """What the user wrote for `path`, when it (or a section above it) was renamed from another key."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in origins:
            rest = parts[cut:]
            return ".".join([origins[head], *rest])
    return None


def support_table_markdown() -> str:
    """The table docs/config-keys.md embeds (a test checks the file matches)."""
    rows = ["| key | status | when | why | what to do |", "| --- | --- | --- | --- | --- |"]
    for entry in TABLE:
        when = "" if entry.when is PRESENT else f"`{entry.when.text}`"
        cells = [f"`{entry.path}`", entry.status.value, when, entry.reason, entry.fix]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- config-keys:begin -->", "<!-- config-keys:end -->"
DOC_FILE = Path(__file__).resolve().parents[2] / "docs" / "config-keys.md"


def render_doc(text: str) -> str:
    """`text` with the generated table between the markers."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"markers {BEGIN} / {END} not found")
    return pattern.sub(lambda _: f"{BEGIN}\n{support_table_markdown()}{END}", text)


def write_docs(doc_file: Path = DOC_FILE) -> None:
    """Regenerate the table in docs/config-keys.md:
    python -c "from engine.config.support import write_docs; write_docs()"
    """
    doc_file.write_text(render_doc(doc_file.read_text(encoding="utf-8")), encoding="utf-8")
