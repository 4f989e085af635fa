"""Why a `torch.load(weights_only=True)` refused a file, in one line: for a checkpoint's rank
files and shard values (trainer/checkpoint/safe_read.py) and model.path's pickled weights
(trainer/models/build.py). torch's own text advises loading the file unsafely instead; the
reason given here never does."""

from __future__ import annotations

import re


def why_not_data(e: BaseException) -> str:
    """What a failed weights_only load found, without torch's advice to load it unsafely instead."""
    text = str(e)
    m = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", text)
    if m:
        return f"it names {m[1]}, which is not data"
    lines = [ln for ln in text.splitlines() if ln.strip() and "weights_only" not in ln and "Weights only" not in ln]
    return " ".join((lines[0] if lines else text).split())[:200]
