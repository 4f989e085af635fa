"""Model presets and builders (transformers families)."""

from trainer.models.build import ModelSpec, Task, build_model, model_spec, transformer_blocks
from trainer.models.presets import PRESETS

__all__ = ["PRESETS", "ModelSpec", "Task", "build_model", "model_spec", "transformer_blocks"]
