"""`engine.offload_states()` / `reload_states()` / `empty_partition_cache()`: DeepSpeed's way for RL loops to
move a training engine's states aside while something else (a vLLM engine colocated on the same devices, a
reward model) needs the memory, then bring them back bitwise.

    engine.step()
    engine.offload_states(include=["optim_states", "hp_params", "lp_grads"], device="nvme")
    ...generate, score...
    engine.reload_states()
    engine(batch) ...

Where the states already live in host memory (training on the CPU), `device="cpu"` has nothing to move and
records only that the states are set aside. `device="nvme"` (which DeepSpeed refuses here) is real: each
storage behind the named states (the stage lists them: `resident_states()`, engine/zero/offload_states.py) is
written to a swap file under the config's nvme_path (or `nvme_path=`), then shrunk to nothing, so its RAM goes
back to the OS; `reload_states()` grows it back and reads it in. Every view of a storage (a parameter in its
flat buffer, a master, the optimizer's key) stays the same object, so nothing has to be re-pointed and training
after the round trip is bitwise the run without it.

Between the two, the engine refuses every call that would read the states (StatesOffloadedError, naming
reload_states), and the model's parameters whose storage was moved hold empty placeholders (reading them gives
an empty tensor, never freed memory). A CUDA engine's device="cpu" (states to pinned host memory) is not built
yet: it has not run on a GPU here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine import comm
from engine.config.types import EngineConfig
from engine.monitor.log import get_logger
from engine.offload import AioConfig, SwapDir
from engine.offload.swap_file import SwapFile
from engine.ops.aio import AioContext
from engine.ops.heap import return_freed_memory
from engine.unsupported import UnsupportedFeatureError
from engine.zero.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum, offload_device, state_kinds

if TYPE_CHECKING:
    from engine.runtime.window import TrainingWindow
    from engine.zero.base import ZeroStage

logger = get_logger()


class StatesOffloadedError(RuntimeError):
    """The engine's states were moved aside by offload_states() and not brought back yet."""


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    file: SwapFile


@dataclass
class OffloadedStates:
    """What offload_states() moved, and how to bring it back."""

    kinds: list[OffloadStateTypeEnum]
    device: OffloadDeviceEnum
    moved: list[_Moved] = field(default_factory=list)
    placeholders: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    """Each parameter whose storage moved, with the view it had (given back by reload)."""
    swap_dir: SwapDir | None = None
    context: AioContext | None = None

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.moved)


def _bytes_of(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """The storage's bytes as a 1-D uint8 tensor (a view: the same memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _nvme_path(config: EngineConfig, given: str | None) -> str:
    if given is not None:
        return given
    for section in ("offload_optimizer", "offload_param"):
        path = getattr(getattr(config.zero, section, None), "nvme_path", None)
        if path:
            return str(path)
    raise ValueError(
        "offload_states(device='nvme'): no folder for the swap files: set zero_optimization.offload_optimizer."
        "nvme_path (or offload_param.nvme_path) in the config, or call offload_states(..., nvme_path='/path')"
    )


class StateOffloadMixin:
    """Engine methods that move its states aside and back (see the module docstring)."""

    engine_config: EngineConfig
    device: torch.device
    module: torch.nn.Module
    _window: TrainingWindow
    _offloaded: OffloadedStates | None

    def _live_stage(self) -> ZeroStage:
        raise NotImplementedError  # the Engine's

    def offload_states(
        self,
        include: Iterable[OffloadStateTypeEnum | str] | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
        nvme_path: str | None = None,
    ) -> None:
        """Move the named states (default: all) to `device`; every rank calls it, after a step (outside an
        accumulation window). `pin_memory`/`non_blocking` concern a GPU's copies; transfers here are waited for."""
        del pin_memory, non_blocking
        stage = self._live_stage()
        kinds, where = state_kinds(include), offload_device(device)
        if self._offloaded is not None:
            raise StatesOffloadedError(
                f"offload_states(): the states are offloaded already ({', '.join(k.value for k in self._offloaded.kinds)}"
                f" to {self._offloaded.device.value}); call engine.reload_states() first"
            )
        if not self._window.is_empty:
            raise RuntimeError(
                "offload_states() inside an accumulation window (a backward's gradients are waiting for "
                "engine.step()): call it after the step"
            )
        if where is OffloadDeviceEnum.none:
            return
        if OffloadStateTypeEnum.contiguous_grad_buffer in kinds:
            stage.release_scratch()  # scratch between steps: dropped, not kept
        if where is OffloadDeviceEnum.cpu:
            if self.device.type != "cpu":
                raise UnsupportedFeatureError(
                    f"offload_states(device='cpu') of an engine on {self.device} (states to pinned host memory): not "
                    "implemented yet (it has not run on a GPU here); use device='nvme'"
                )
            logger.info("offload_states(device='cpu'): the states already live in host memory; nothing to move")
            self._offloaded = OffloadedStates(kinds, where)
            return
        self._offloaded = self._to_nvme(stage, kinds, _nvme_path(self.engine_config, nvme_path))

    def _to_nvme(self, stage: ZeroStage, kinds: list[OffloadStateTypeEnum], folder: str) -> OffloadedStates:
        resident = stage.resident_states()
        storages = _storages(t for kind in kinds for t in resident.get(kind, []))
        stuck = [s for s in storages if not s.resizable()]
        if stuck:
            raise UnsupportedFeatureError(
                f"offload_states(device='nvme'): {len(stuck)} of the storages behind {[k.value for k in kinds]} cannot be "
                "freed in place (they are memory-mapped swap files or carved from the stage-3 arena): leave those "
                "states out of include, or train without NVMe offload / with zero_optimization.stage3_arena_bytes 0"
            )
        run_id = comm.all_gather_object(uuid.uuid4().hex[:12])[0]
        done = OffloadedStates(kinds, OffloadDeviceEnum.nvme)
        done.swap_dir = SwapDir.create(folder, comm.get_rank(), f"states-{run_id}", "offload_states nvme_path")
        done.context = AioContext(AioConfig.from_section(dict(self.engine_config.aio)))
        try:
            for i, storage in enumerate(storages):
                nbytes = storage.nbytes()
                swap = done.swap_dir.file(f"state.{i}", nbytes, torch.uint8, done.context)
                swap.write(_bytes_of(storage, nbytes)).wait()
                done.moved.append(_Moved(storage, nbytes, swap))
        except BaseException:
            done.swap_dir.close()  # nothing was freed yet: the states stay as they were
            done.context.close()
            raise
        moved = {m.storage.data_ptr() for m in done.moved}
        for p in self.module.parameters():
            if p.numel() and p.untyped_storage().data_ptr() in moved:
                done.placeholders.append((p, p.data))
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for m in done.moved:
            m.storage.resize_(0)
        return_freed_memory()
        logger.info(
            "offload_states: %.1f MiB of %s written to %s and freed",
            done.nbytes / 2**20,
            ", ".join(k.value for k in kinds),
            done.swap_dir.path,
        )
        return done

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what offload_states() moved (nothing when nothing was moved)."""
        del non_blocking
        done, self._offloaded = self._offloaded, None
        if done is None or not done.moved:
            return
        assert done.swap_dir is not None and done.context is not None
        try:
            for m in done.moved:
                m.storage.resize_(m.nbytes)
                m.file.read(_bytes_of(m.storage, m.nbytes)).wait()
            for p, view in done.placeholders:
                p.data = view
        except BaseException:
            self._offloaded = done  # still aside (the files stay): reload_states() may be called again
            raise
        done.swap_dir.close()
        done.context.close()

    def empty_partition_cache(self) -> None:
        """Stage 3: release every gathered parameter, kept ones too (DeepSpeed's); other stages keep parameters
        whole, so there is nothing to release."""
        stage = self._live_stage()
        release: Any = getattr(stage, "empty_partition_cache", None)
        if release is not None:
            release()
