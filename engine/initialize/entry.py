"""`engine.initialize(...)`: DeepSpeed's entry point, same keywords, same 4-tuple."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

import torch

from engine import activation_checkpointing, comm
from engine.accelerator import get_accelerator
from engine.config import EngineConfig, load_config, run_checks
from engine.initialize import parallel_setup, rank_agreement
from engine.initialize.data import build_dataloader
from engine.initialize.param_groups import normalize_param_groups
from engine.monitor import monitors
from engine.monitor.log import get_logger
from engine.optim import build_optimizer, build_scheduler
from engine.parallel.groups import ParallelGroups
from engine.precision import Precision, cpu_precision
from engine.runtime.engine import Engine
from engine.zero import owners, partitioned_init, unwritten
from engine.zero.base import ZeroStage
from engine.zero.flat import ForwardOnly, Stage0, Stage1, Stage2
from engine.zero.stage3 import Stage3

logger = get_logger()

# The only place that maps a stage number to its implementation.
_STAGES: dict[
    int, Callable[[torch.nn.Module, torch.optim.Optimizer, EngineConfig, Precision, ParallelGroups], ZeroStage]
] = {
    0: Stage0,
    1: Stage1,
    2: Stage2,
    3: Stage3,
}


def _build_stage(
    cfg: EngineConfig,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer | None,
    precision: Precision,
    parallel: ParallelGroups,
) -> ZeroStage:
    if opt is not None:
        run_checks.check_optimizer_for_stage(cfg, type(opt).__name__)
        return _STAGES[cfg.zero.stage](model, opt, cfg, precision, parallel)
    # No optimizer: an evaluation-only engine (DeepSpeed's ZeRO inference; HF builds one to evaluate
    # before training). Stage 3 keeps its parameters partitioned; at stages 0-2 they are whole on every
    # rank and there is nothing to partition. The Engine refuses backward and step with a named error.
    if comm.get_rank() == 0:
        logger.info(
            'no optimizer (none passed to initialize, no "optimizer" section): an evaluation-only '
            "engine at zero_optimization.stage %d; backward() and step() need an optimizer",
            cfg.zero.stage,
        )
    if cfg.zero.stage == 3:
        return Stage3(model, None, cfg, precision, parallel)
    return ForwardOnly(model, cfg.zero.stage, parallel)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's --deepspeed and --deepspeed_config flags, and their deprecated spellings --deepscale
    and --deepscale_config (no --local_rank: ranks read the environment, see zrun)."""
    group = parser.add_argument_group("engine", "ZeRO engine configuration")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable the engine (accepted for DeepSpeed compatibility)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="path to the JSON config")
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="deprecated spelling of --deepspeed (accepted for DeepSpeed compatibility)",
    )
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated spelling of --deepspeed_config")
    return parser


def _device() -> torch.device:
    accelerator = get_accelerator()  # DS_ACCELERATOR, else CUDA when available, else CPU
    device = accelerator.device(comm.get_local_rank())
    accelerator.set_device(comm.get_local_rank())
    return device


def _build_optimizer(
    cfg: EngineConfig, module: torch.nn.Module, optimizer: Any, model_parameters: Iterable[Any] | None
) -> torch.optim.Optimizer | None:
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        normalize_param_groups(optimizer.param_groups, module)  # same checks as config optimizers
        return optimizer
    groups = normalize_param_groups(model_parameters, module)
    if callable(optimizer):
        return optimizer(groups)
    if cfg.optimizer is not None:
        return build_optimizer(cfg.optimizer, groups)
    return None


def _build_scheduler(cfg: EngineConfig, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any) -> Any:
    if lr_scheduler is not None:
        return lr_scheduler(optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
    if cfg.scheduler is not None:
        if optimizer is None:
            # DeepSpeed builds the schedule only with an optimizer: HF Trainer's ZeRO inference
            # (evaluate before train) deletes "optimizer" from the training config but keeps "scheduler".
            logger.info(
                "scheduler.type %r not built: this engine has no optimizer (evaluation only; "
                "backward()/step() would say so)",
                cfg.scheduler.type,
            )
            return None
        return build_scheduler(cfg.scheduler, optimizer)
    return None


def _local_setup(
    model: torch.nn.Module, source: Any, mpu: Any, optimizer: Any, lr_scheduler: Any
) -> tuple[ParallelGroups | None, EngineConfig, torch.device]:
    """(the model-parallel groups made before initialize, the config, this rank's device): this rank's
    own work before the ranks first agree, with no collective in it, so that a rank that fails here
    still reaches rank_agreement.agree and the others hear of its error."""
    known_groups = parallel_setup.groups_before_config(mpu)
    known_sp = parallel_setup.sequence_parallel_before_config(mpu)
    given = frozenset(name for name, obj in (("optimizer", optimizer), ("scheduler", lr_scheduler)) if obj is not None)
    cfg = load_config(
        source,
        world_size=comm.get_world_size(),
        world_size_source=comm.world_size_source(),
        model_parallel_size=known_groups.tp_size if known_groups else None,
        sequence_parallel_size=known_sp,
        given_objects=given,
    )
    comm.set_collectives(cfg.collectives)
    device = _device()
    run_checks.check_offload(cfg, device.type)
    run_checks.check_stage(cfg, _STAGES)
    owners.check_not_held(model)
    activation_checkpointing.check_engine_options(cfg)
    monitors.check_packages(cfg)
    return known_groups, cfg, device


def _place_model(
    cfg: EngineConfig, model: torch.nn.Module, device: torch.device, parallel: ParallelGroups
) -> Precision:
    """The model whole (below stage 3), on `device`, in the training dtype and with rank 0's initial
    state on every rank; returns the precision it was cast by."""
    unwritten.check_written(model, partitioned_init.local_shard)  # before any stage reads a value built under Init
    if cfg.zero.stage != 3 and (gathered := partitioned_init.materialize(model)):
        logger.info(
            "stage %d: %d parameters built under engine.zero.Init were gathered whole again "
            "(only stage 3 keeps parameters partitioned)",
            cfg.zero.stage,
            gathered,
        )
    model.to(device)
    precision = Precision(cfg)
    cpu_precision.warn_if_slow(precision.model_dtype, device)
    precision.cast_module(model)
    # DeepSpeed semantics: rank 0's initial state wins, whatever each rank's seed was; with tensor
    # parallelism the first rank of each data-parallel group (its tensor-parallel slices differ).
    comm.broadcast_coalesced(
        [t.data for t in model.parameters()] + list(model.buffers()),
        src=parallel.dp_src(),
        process_group=parallel.dp_group,
    )
    return precision


def _dataloader(
    cfg: EngineConfig,
    training_data: torch.utils.data.Dataset | None,
    collate_fn: Callable[..., Any] | None,
    parallel: ParallelGroups,
) -> torch.utils.data.DataLoader | None:
    if training_data is None:
        return None
    # Every rank of a tensor-parallel group reads the same samples: its data-parallel position's.
    return build_dataloader(
        training_data,
        cfg.train_micro_batch_size_per_gpu,
        parallel.dp_rank,
        parallel.dp_size,
        collate_fn,
        cfg.dataloader_drop_last,
        seed=cfg.seed if cfg.seed is not None else 0,
    )


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    config_params: Any = None,
) -> tuple[Engine, torch.optim.Optimizer | None, torch.utils.data.DataLoader | None, Any]:
    """Build an Engine for `model`; returns (engine, optimizer, dataloader, lr_scheduler).

    The config is a path, dict or base64 JSON in DeepSpeed's format (or args.deepspeed_config /
    args.config; DeepSpeed's deprecated args.deepscale_config is moved onto args.deepspeed_config). Rank 0's parameters and buffers are broadcast so every rank starts identical.
    """
    if model is None:
        raise ValueError("initialize() needs model=<torch.nn.Module>")
    source = run_checks.config_source(args, config, config_params)
    owns_group = comm.acquire_process_group(distributed_port, dist_init_required)
    try:
        # Local work first, then one exchange every rank takes part in, failed or not, before any
        # other collective (see [Note: why initialize agrees first] in engine/initialize/rank_agreement.py).
        local_error: Exception | None = None
        try:
            known_groups, cfg, device = _local_setup(model, source, mpu, optimizer, lr_scheduler)
        except Exception as err:  # noqa: BLE001 - re-raised by agree(), after the other ranks hear of it
            local_error = err
        rank_agreement.agree(model, local_error)
        parallel = parallel_setup.resolve_groups(known_groups, cfg.autotp_size, model, cfg)
        activation_checkpointing.configure_from_engine(cfg, parallel)
        precision = _place_model(cfg, model, device, parallel)
        opt = _build_optimizer(cfg, model, optimizer, model_parameters)
        scheduler = _build_scheduler(cfg, opt, lr_scheduler)
        stage = _build_stage(cfg, model, opt, precision, parallel)
    except BaseException:
        if owns_group:
            # Every rank that failed tears its group down; the next initialize makes a new one on
            # fresh keys (see [Note: one rendezvous store per process] in engine/comm/lifecycle.py).
            comm.release_process_group()
        raise
    loader = _dataloader(cfg, training_data, collate_fn, parallel)
    engine = Engine(
        model,
        cfg,
        stage,
        opt,
        scheduler,
        device,
        loader,
        precision=precision,
        owns_process_group=owns_group,
        parallel=parallel,
    )
    if cfg.compile.at_initialize:  # the config's compile section (engine/runtime/compile.py)
        try:
            engine.compile()
        except BaseException:
            engine.destroy()  # the module given back whole, the process group released
            raise
    # DeepSpeed returns its ZeRO optimizer, not the torch one it was given (engine/runtime/zero_optimizer.py).
    return engine, engine.optimizer, loader, scheduler
