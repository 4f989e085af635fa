"""Model presets and builders (transformers families).

Names are imported lazily so that importing the package does not pull in torch: a bad config fails
in a fraction of a second. The presets live in contract/presets.py (the runner sizes jobs from them).

May import: torch, transformers, contract, trainer.config, and trainer.config.partition (the
Counting a layout describes itself in); never the rest of trainer.parallel, the loop or the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"ModelSpec": "build", "Task": "build", "build_model": "build", "model_spec": "build",
         "transformer_blocks": "build"}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"trainer.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'trainer.models' has no attribute {name!r}")
