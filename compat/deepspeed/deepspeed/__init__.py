"""zero-engine under DeepSpeed's import name (see compat/deepspeed/README.md).

Every name here is an alias of the engine's own object; nothing is implemented in this package.
"""

try:
    import engine  # noqa: F401 - checked first, so a missing engine is named before any alias fails
except ImportError as _err:  # the engine is installed from its repository, not by this package
    raise ImportError(
        "this `deepspeed` is zero-engine's compatibility package and needs zero-engine itself: "
        "pip install -e <zero-engine checkout> (then pip install <checkout>/compat/deepspeed)"
    ) from _err

from deepspeed import accelerator, checkpoint, checkpointing, comm, ops, runtime, utils, zero
from engine import add_config_arguments, init_distributed, initialize
from engine.runtime.engine import Engine as DeepSpeedEngine
from engine.unsupported import tp_model_init

__version__ = "0.19.8+zeroengine"
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8

__all__ = [
    "DeepSpeedEngine",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "ops",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]
