"""`get_accelerator()`: DeepSpeed's device abstraction (`deepspeed.accelerator.get_accelerator`), for
CPU and CUDA, and the one place the engine decides which device it trains on.

HF transformers asks it for the current device while loading a ZeRO-3 checkpoint
(`get_accelerator().current_device_name()`), and the engine's own choices go through it too
(initialize's device, comm's default backend), so DS_ACCELERATOR=cpu on a GPU machine trains on the
CPU over gloo, as it does in DeepSpeed, and the accelerator never disagrees with the engine.

Selection: DS_ACCELERATOR ("cpu" or "cuda") when set, else CUDA when torch can use it, else CPU.
It is made once per process, like DeepSpeed's.
"""

from __future__ import annotations

import os
import resource
from contextlib import nullcontext
from typing import Any

import torch

SUPPORTED = ("cpu", "cuda")
"""DS_ACCELERATOR values this engine runs on."""


class AcceleratorError(ValueError):
    """DS_ACCELERATOR names a device this process cannot use."""


class Accelerator:
    """The methods DeepSpeed's accelerator classes share; subclasses bind them to one device type."""

    _name: str
    _communication_backend_name: str

    def device_name(self, device_index: int | str | None = None) -> str:
        raise NotImplementedError

    def current_device(self) -> int:
        raise NotImplementedError

    def current_device_name(self) -> str:
        raise NotImplementedError

    def device(self, device_index: int | str | None = None) -> torch.device:
        raise NotImplementedError

    def set_device(self, device_index: int | str) -> None:
        raise NotImplementedError

    def device_count(self) -> int:
        raise NotImplementedError

    def is_available(self) -> bool:
        raise NotImplementedError

    def synchronize(self, device_index: int | None = None) -> None:
        raise NotImplementedError

    def empty_cache(self) -> None:
        raise NotImplementedError

    def is_bf16_supported(self) -> bool:
        raise NotImplementedError

    def is_fp16_supported(self) -> bool:
        raise NotImplementedError

    def memory_allocated(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    def total_memory(self, device_index: int | None = None) -> int:
        raise NotImplementedError

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        raise NotImplementedError

    def is_synchronized_device(self) -> bool:
        raise NotImplementedError

    # ------------------------------------------------------------------- shared by both devices
    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)  # seeds every device's generator as well as the CPU's

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        del align_bytes
        return tensor

    def range_push(self, msg: str) -> None:
        del msg

    def range_pop(self) -> None:
        pass

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def __repr__(self) -> str:
        return f"<engine accelerator {self._name}>"


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class CpuAccelerator(Accelerator):
    """The CPU: one device per process, gloo collectives, memory counted as the process's RSS."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def device_name(self, device_index: int | str | None = None) -> str:
        del device_index  # torch has one CPU device; DeepSpeed's CPU accelerator ignores the index too
        return "cpu"

    def current_device(self) -> int:
        return _local_rank()

    def current_device_name(self) -> str:
        return "cpu"

    def device(self, device_index: int | str | None = None) -> torch.device:
        del device_index
        return torch.device("cpu")

    def set_device(self, device_index: int | str) -> None:
        del device_index

    def device_count(self) -> int:
        """Ranks on this host as the launcher gave them (LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE), else 1."""
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            if int(os.environ.get(name, "0") or 0) > 0:
                return int(os.environ[name])
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        del device_index  # CPU ops complete before they return

    def empty_cache(self) -> None:
        pass

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True  # the engine's fp16 runs on CPU (loss scaling in fp32 masters), so it is supported here

    def memory_allocated(self, device_index: int | None = None) -> int:
        del device_index
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        # Linux reports the peak in KiB, updated lazily: never below the RSS read just now.
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, self.memory_allocated(device_index))

    def total_memory(self, device_index: int | None = None) -> int:
        del device_index
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        del device_index  # the kernel's peak RSS cannot be reset

    def is_synchronized_device(self) -> bool:
        return True

    def stream(self, stream: Any) -> Any:
        del stream
        return nullcontext()


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs through torch.cuda, NCCL collectives."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def device_name(self, device_index: int | str | None = None) -> str:
        # HF passes os.environ["LOCAL_RANK"] (a string) here.
        return "cuda" if device_index is None else f"cuda:{int(device_index)}"

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device(self, device_index: int | str | None = None) -> torch.device:
        return torch.device("cuda") if device_index is None else torch.device("cuda", int(device_index))

    def set_device(self, device_index: int | str) -> None:
        torch.cuda.set_device(int(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        major, _ = torch.cuda.get_device_capability()
        return major >= 7  # DeepSpeed's rule: fp16 below compute capability 7 is deprecated

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def is_synchronized_device(self) -> bool:
        return False

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        del align_bytes
        return tensor.pin_memory()


def choose(requested: str | None) -> Accelerator:
    """The accelerator for a DS_ACCELERATOR value (None: unset, detect)."""
    if requested is None or requested == "":
        return CudaAccelerator() if torch.cuda.is_available() else CpuAccelerator()
    name = requested.strip().lower()
    if name not in SUPPORTED:
        raise AcceleratorError(
            f"DS_ACCELERATOR={requested!r}: this engine runs on {' or '.join(SUPPORTED)}; "
            "set one of those or unset DS_ACCELERATOR (then CUDA is used when available)"
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise AcceleratorError(
            "DS_ACCELERATOR='cuda' but torch cannot use CUDA in this process "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            "set DS_ACCELERATOR=cpu or unset it"
        )
    return CudaAccelerator() if name == "cuda" else CpuAccelerator()


_accelerator: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """This process's accelerator (chosen on the first call; see the module docstring)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = choose(os.environ.get("DS_ACCELERATOR"))
    return _accelerator


def set_accelerator(accelerator: Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's set_accelerator)."""
    global _accelerator
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator() needs an engine.accelerator.Accelerator, got {type(accelerator).__name__}")
    _accelerator = accelerator
