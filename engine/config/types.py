"""Typed, frozen views of a validated DeepSpeed-format config.

The rest of the engine reads these dataclasses, never raw dict keys. Every field documents its
default and, where it matters, why. `engine/config/build.py` is the only code that builds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engine.config.autotp_specs import AutoTPSpecs


def _frozen_mapping(data: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(data or {}))


@dataclass(frozen=True)
class OptimizerConfig:
    """`optimizer` section: a name from DeepSpeed's list (case-insensitive) and its keyword params."""

    type: str
    """Optimizer name as written by the user, e.g. "Adam", "AdamW", "SGD", "Lamb"."""
    params: Mapping[str, Any] = field(default_factory=_frozen_mapping)
    """Keyword arguments with DeepSpeed's names (lr, betas, eps, weight_decay, adam_w_mode, ...)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler` section: a DeepSpeed schedule name (or torch.optim.lr_scheduler class) and params."""

    type: str
    params: Mapping[str, Any] = field(default_factory=_frozen_mapping)


@dataclass(frozen=True)
class FP16Config:
    """`fp16` section; DeepSpeed's keys and defaults. loss_scale 0 means dynamic scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class BF16Config:
    """`bf16` (alias `bfloat16`) section."""

    enabled: bool = False


@dataclass(frozen=True)
class OffloadConfig:
    """`zero_optimization.offload_optimizer` / `offload_param`. device "none" means no offload. The
    NVMe keys (nvme_path, buffer_count, ...) are validated and refused or accepted by the support table
    (engine/config/support.py); nothing here reads them."""

    device: str = "none"
    pin_memory: bool = False
    ratio: float = 1.0
    """offload_optimizer only: fraction of optimizer state offloaded (stage 3 only below 1.0)."""
    nvme_path: str | None = None
    """device "nvme": the folder the swap files go in (engine/offload/)."""
    buffer_count: int = 4
    """device "nvme": host buffers the swapped state streams through (DeepSpeed's default 4)."""
    pipeline_read: bool = False
    """offload_optimizer, device "nvme": read the next sub-group while this one is computed."""
    pipeline_write: bool = False
    """offload_optimizer, device "nvme": wait for a sub-group's write only when its buffer is needed."""


ARENA_AUTO = -1
"""ZeroConfig.stage3_arena_bytes for "auto": size the arena from the model."""


DEEPSPEED_BUCKET_SIZE = 500_000_000
"""DeepSpeed's default reduce_bucket_size and allgather_bucket_size, in elements (runtime/zero/config.py):
what "auto" means, what the engine falls back to without a measured link, and the estimator's default."""


@dataclass(frozen=True)
class ZeroConfig:
    """`zero_optimization` section. Element counts, not bytes, as in DeepSpeed."""

    stage: int = 0
    reduce_scatter: bool = True
    reduce_bucket_size: int | None = None
    """Elements per gradient-reduction bucket; None (absent): sized from the measured link at start
    (engine/zero/flat/bucket_sizes.py). DeepSpeed's default is DEEPSPEED_BUCKET_SIZE (5e8)."""
    allgather_partitions: bool = True
    allgather_bucket_size: int | None = None
    """Elements of stages 1-2's parameter all-gathers in flight after a step; None (absent): sized from
    the measured link at start, as reduce_bucket_size is (engine/zero/flat/bucket_sizes.py)."""
    ignore_unused_parameters: bool = True
    """DeepSpeed's default. False, at stages 1-2 (where DeepSpeed reads it): a step where a trainable parameter
    got no gradient on some rank is refused, naming it (engine/zero/flat/unused.py)."""
    overlap_comm: bool = False
    """None in the JSON resolves to True for stage 3 and False otherwise, as DeepSpeed does."""
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    sub_group_size: int = 1_000_000_000
    """Elements of optimizer state swapped and stepped at a time with NVMe offload (DeepSpeed's 1e9)."""
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: int = 0
    """Stage-3 blocks under this many elements are merged with their following siblings into one unit
    until it reaches this size (fewer, larger collectives); 0 (DeepSpeed's default) merges nothing."""
    memory_efficient_linear: bool = True
    """Stage 3: F.linear saves stage-3 weights themselves for backward, not views that keep their
    gathered unit alive (engine/zero/stage3/memory_efficient_linear.py), as DeepSpeed's key of the same name."""
    stage3_arena_bytes: int = 0
    """Our key (DeepSpeed has none): bytes of the pre-touched arena that stage 3 takes gathered units
    and gradient buckets from on CPU (engine/zero/stage3/memory.py); ARENA_AUTO ("auto" in the JSON)
    sizes it from the units and stage3_max_live_parameters; 0 (the default) turns it off: on GPT-M it
    saved no time and its worst-case size added 60-90 MiB of peak RSS (benchmarks/results/arena_M.md)."""
    leaf_module: Mapping[str, tuple[str, ...]] | None = None
    """Stage-3 gather units named by the user: {"classes": [...], "names": [...], "name_suffixes": [...]}
    (class names, module names, module-name suffixes); like engine.zero.set_z3_leaf_modules."""
    zero_hpz_partition_size: int = 1
    """ZeRO++ secondary (hierarchical) partition size; 1 = off. Stage 3 keeps a secondary shard of each unit
    gathered in a forward over groups of this many consecutive ranks (engine/zero/stage3/secondary.py)."""
    zero_quantized_weights: bool = False
    """ZeRO++ quantized weight all-gather (changes numerics); refused for now."""
    zero_quantized_gradients: bool = False
    """ZeRO++ quantized gradient reduction (changes numerics); refused for now."""
    mics_shard_size: int = -1
    """MiCS shard group size; -1 = off. Values > 0 are refused for now."""


@dataclass(frozen=True)
class MonitorConfig:
    """`csv_monitor` and `tensorboard`: files under output_path/job_name (DeepSpeed's keys and defaults)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig:
    """`wandb`: wandb.init(project=, group=, entity=team) on rank 0 (DeepSpeed's keys and defaults)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclass(frozen=True)
class CometConfig:
    """`comet`: comet_ml.start(...) on rank 0 (DeepSpeed's keys and defaults)."""

    enabled: bool = False
    samples_log_interval: int = 100
    """Log an event when at least this many samples passed since it was last logged."""
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """`flops_profiler` (DeepSpeed's keys and defaults): profile the step `profile_step` and print the
    per-module table (engine/profiling)."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    """Extra forward passes per step from activation recomputation (0.0: none; 1.0: every layer)."""
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """`activation_checkpointing`: how engine.checkpointing.checkpoint keeps a checkpoint's inputs until
    its recompute (ZeRO-R, paper section 6; engine/activation_checkpointing/). DeepSpeed's keys and defaults."""

    partition_activations: bool = False
    """P_a: each tensor-parallel rank keeps 1/TP of every checkpointed input, all-gathered before the
    recompute. Without tensor parallelism it is said once and inputs are kept whole."""
    contiguous_memory_optimization: bool = False
    """M_D: checkpoints are copied into one pre-allocated arena (engine/ops/arena.py) sized for
    number_checkpoints of them, so long-lived checkpoints do not interleave with short-lived buffers."""
    cpu_checkpointing: bool = False
    """P_a+cpu: on a CUDA device checkpoints go to pinned host memory; no effect when training on CPU."""
    number_checkpoints: int | None = None
    """Checkpoints alive at once in one forward (usually the number of layers); sizes the arena."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at the start and end of each checkpoint's forward and recompute."""
    profile: bool = False
    """Log each checkpoint's forward and recompute+backward time."""


@dataclass(frozen=True)
class TensorParallelConfig:
    """`tensor_parallel` section: what AutoTP training reads of it (engine.tp_model_init)."""

    autotp_size: int = 1
    """`autotp_size`: the tensor-parallel size; 1 = off (DeepSpeed's 0, its default, is read as 1)."""
    specs: AutoTPSpecs | None = None
    """The layer specs of `partition_config` / `preset_model` (engine/config/autotp_specs.py); None when
    the section has neither, and the engine's own name rules decide what is sharded."""


@dataclass(frozen=True)
class CompileConfig:
    """The `compile` section as DeepSpeed 0.14 read it (engine/runtime/compile.py): torch.compile's backend
    and arguments for engine.compile(), and whether initialize compiles."""

    enabled: bool = False
    """True: engine.initialize compiles the model (engine.compile() with the two keys below)."""
    disable: bool = True
    """axolotl's spelling of the same switch: false compiles at initialize."""
    backend: str = "inductor"
    kwargs: Mapping[str, Any] = field(default_factory=_frozen_mapping)

    @property
    def at_initialize(self) -> bool:
        return self.enabled or not self.disable


@dataclass(frozen=True)
class EngineConfig:
    """The whole validated config with batch sizes resolved against the data-parallel world size."""

    train_batch_size: int
    """Global samples per optimizer step = micro x gradient_accumulation_steps x world size."""
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int
    """Data-parallel world size the batch sizes were resolved against."""
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    gradient_clipping: float = 1.0
    """Max global grad norm; 0 disables. DeepSpeed 0.19.8 clips at 1.0 when the key is absent."""
    check_for_nan_in_loss_and_grad: bool = False
    """Not a DeepSpeed key (Megatron-LM's name): an fp32/bf16 step whose global gradient norm is inf/nan
    raises NonFiniteGradientError on every rank, before anything is updated. False: the step is skipped
    with a warning and counted in skipped_steps, as fp16's loss scaler skips an overflow (fp16 always
    does that, whatever this says: overflow is how its dynamic loss scale finds its level)."""
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    communication_data_type: str | None = None
    """"fp32" | "fp16" | "bf16" | None (= the gradients' own dtype, as DeepSpeed)."""
    grad_accum_dtype: str | None = None
    """`data_types.grad_accum_dtype`: dtype gradients are accumulated and kept in until the optimizer
    step reads them (the full-size buffer of stages 0-1, the gradient shard of stages 2-3); None = the
    parameter's dtype, as in DeepSpeed."""
    comms_logger: bool = False
    """`comms_logger.enabled`: log bytes sent per collective type at every step log line."""
    steps_per_print: int | None = None
    """Log a progress line every N optimizer steps; None = never. DeepSpeed's code default is None
    (its docs still say 10); we match the code, which is what users' runs do."""
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    """Log rank 0's memory_report() and peak RSS with every progress line."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: bool = False
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    comet: CometConfig = field(default_factory=CometConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    """The `activation_checkpointing` section; None when the config has none (engine.initialize then
    leaves engine.checkpointing as the user configured it)."""
    dataloader_drop_last: bool = False
    seed: int | None = None
    """Not a DeepSpeed key: seeds the engine DataLoader's DistributedSampler shuffle (None: 0)."""
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    sequence_parallel_size: int = 1
    """Ranks that split each sample's tokens (DeepSpeed-Ulysses; engine/parallel/sequence_groups.py): the
    config's key, or the groups UlyssesSPAttentionHF.register_with_transformers (or mpu=) made. Batch sizes
    count world_size = ranks // sequence_parallel_size replicas; ZeRO partitions over every rank."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    aio: Mapping[str, Any] = field(default_factory=_frozen_mapping)
    """DeepSpeed's `aio` section as written: the NVMe swap files' I/O settings (engine/ops/aio.py's
    AioConfig.from_section reads it)."""
    collectives: str = "engine"
    """Not a DeepSpeed key: how reduce-scatter and all-gather run (engine/comm/collectives.py): "engine" (the default,
    a direct exchange between ranks), "ring" (pipelined rings), or "native" (torch's own collectives)."""
    raw: Mapping[str, Any] = field(default_factory=_frozen_mapping, repr=False, compare=False)
    """The validated JSON, read-only, for diagnostics and checkpoint manifests only."""

    @property
    def autotp_size(self) -> int:
        """`tensor_parallel.autotp_size`: the tensor-parallel size of AutoTP training (engine.tp_model_init);
        1 = off (DeepSpeed's 0, its default, is read as 1)."""
        return self.tensor_parallel.autotp_size
