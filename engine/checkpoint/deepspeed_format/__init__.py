"""DeepSpeed's own checkpoints, loaded by engine.load_checkpoint as they are (no converter run first).

safe_load.py reads one of DeepSpeed's files with torch.load(weights_only=True), DeepSpeed's pickled
classes mapped to plain stand-ins; layout.py describes a tag directory's files (stages 0-3, fp32 /
bf16 / fp16, any data-parallel size) as the engine's named pieces; reader.py serves those pieces to
engine/checkpoint/store.py's load, which reshards them like the engine's own checkpoints.
"""

from engine.checkpoint.deepspeed_format.layout import is_deepspeed_tag_dir
from engine.checkpoint.deepspeed_format.reader import DeepSpeedReader, open_reader

__all__ = ["DeepSpeedReader", "is_deepspeed_tag_dir", "open_reader"]
