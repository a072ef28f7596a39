"""What a run with NVMe offload sets up before its optimizer swap (engine/offload/optimizer_swap.py): the
settings read from the config, this rank's swap folder, and stage 3's memory-mapped gradients. Each is
made on every rank or refused on all: a failure on one rank is raised on every rank, so none waits in
a collective for a rank that stopped."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch

from engine import comm
from engine.config.errors import ConfigError
from engine.config.types import EngineConfig
from engine.offload import AioConfig, SwapDir

KEY = "zero_optimization.offload_optimizer"


@dataclass(frozen=True)
class NvmeSettings:
    nvme_path: str
    buffer_count: int
    pipeline_read: bool
    pipeline_write: bool
    sub_group_size: int
    aio: AioConfig
    params: bool = False
    """offload_param.device "nvme" too (stage 3): every fp32 master, the only persistent copy of a
    trainable parameter there, lives on disk and each gather reads its unit's from the file."""
    grads: bool = False
    """Stage 3: each target's gradient is a memory-mapped swap file, released from memory after its
    reduction and discarded after the step reads it (engine/offload/mapped_file.py, [Note: state the step touches in place])."""


def nvme_settings(config: EngineConfig) -> NvmeSettings | None:
    """The NVMe optimizer offload asked for, or None."""
    offload = config.zero.offload_optimizer
    params = config.zero.offload_param.device == "nvme"
    if params and (config.zero.stage != 3 or offload.device != "nvme"):
        raise ConfigError(
            'zero_optimization.offload_param.device "nvme": parameters go to NVMe at stage 3 together with the '
            f'optimizer state (offload_optimizer.device "nvme"); here stage {config.zero.stage} with '
            f'offload_optimizer.device "{offload.device}": set both, or use offload_param "cpu"/"none"'
        )
    if offload.device != "nvme":
        return None
    if not offload.nvme_path:
        raise ConfigError(f'{KEY}.nvme_path: required with device "nvme": the folder the swap files go in')
    if offload.buffer_count < 1:
        raise ConfigError(f"{KEY}.buffer_count: {offload.buffer_count}; at least 1 buffer is needed")
    return NvmeSettings(
        str(offload.nvme_path),
        int(offload.buffer_count),
        bool(offload.pipeline_read),
        bool(offload.pipeline_write),
        max(int(config.zero.sub_group_size), 1),
        AioConfig.from_section(dict(config.aio)),
        params,
    )


def agreed(make: Any, what: str) -> Any:
    """make() on every rank; if it failed anywhere, every rank raises (naming the ranks that failed)."""
    error: BaseException | None = None
    try:
        result = make()
    except (OSError, ValueError, RuntimeError) as err:  # SwapPathError and the aio errors are OSError/RuntimeError
        error, result = err, None
    failed = [(r, msg) for r, msg in enumerate(comm.all_gather_object(None if error is None else str(error))) if msg]
    if failed:
        if error is not None:
            raise error
        rank, message = failed[0]
        raise RuntimeError(f"{what} failed on rank {rank}: {message}")
    return result


def open_swap_dir(settings: NvmeSettings) -> SwapDir:
    """This rank's swap folder of a new run (one run id, rank 0's), made on every rank or refused on all."""
    run_id = comm.all_gather_object(uuid.uuid4().hex[:12])[0]
    return agreed(
        lambda: SwapDir.create(settings.nvme_path, comm.get_rank(), run_id, f"{KEY}.nvme_path"),
        "creating the NVMe swap folder",
    )


def map_gradients(swap_dir: SwapDir, sizes: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """One gradient per (numel, dtype), each a memory-mapped swap file `grad.<i>` reading as zeros and
    holding no memory yet ([Note: state the step touches in place]); made on every rank or refused on all."""
    return agreed(
        lambda: [
            swap_dir.mapped(f"grad.{i}", n, dtype).tensor if n else torch.zeros(0, dtype=dtype)
            for i, (n, dtype) in enumerate(sizes)
        ],
        "creating the gradient swap files",
    )
