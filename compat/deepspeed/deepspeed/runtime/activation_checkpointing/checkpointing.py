"""`deepspeed.runtime.activation_checkpointing.checkpointing` IS engine.checkpointing (see
deepspeed/checkpointing.py)."""

import sys

import engine.activation_checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing
