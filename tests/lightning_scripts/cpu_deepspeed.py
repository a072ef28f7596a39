"""Lightning's DeepSpeed strategies with their two CUDA-only checks lifted, as a CPU user has to.

Lightning 2.6 refuses DeepSpeed on anything but CUDA before DeepSpeed is reached: `setup_environment`
raises unless the accelerator is a CUDAAccelerator, and `setup_distributed` compares the devices' CUDA
indices with the local ranks (CPU devices have none: "[None, None] don't match"). Each subclass drops
exactly those two checks and runs the rest of Lightning's own code unchanged (the bodies below are
Lightning's minus the check); everything after them is the real strategy talking to `deepspeed`.
"""

from __future__ import annotations

from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """lightning.pytorch's DeepSpeedStrategy on CPU processes (gloo)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's, without `isinstance(accelerator, CUDAAccelerator)`

    def setup_distributed(self) -> None:
        reset_seed()  # DeepSpeedStrategy.setup_distributed, without _validate_device_index_selection
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class CPUFabricDeepSpeedStrategy(FabricDeepSpeedStrategy):
    """lightning.fabric's DeepSpeedStrategy on CPU processes (gloo)."""

    def setup_environment(self) -> None:
        FabricDDPStrategy.setup_environment(self)  # without the CUDAAccelerator check

    def _setup_distributed(self) -> None:
        reset_seed()  # DeepSpeedStrategy._setup_distributed, without _validate_device_index_selection
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True
