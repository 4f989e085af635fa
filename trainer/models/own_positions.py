"""The trainer's forwards skip transformers' packed-sequence check: one device->host sync per
forward, for an answer the trainer already knows.

transformers' `create_causal_mask` (Llama, Qwen, ... since 4.5x) looks for several sequences
packed into one row whenever it has position ids and no attention mask: it diffs the position ids
on the device and branches on `.all()` of the result (masking_utils.find_packed_sequence_indices),
which waits for the device every forward (torch's sync debug mode names it; on an H100 the step's
host time then cannot run ahead of the GPU). The trainer never passes position ids: the model
makes its own, 0..S-1 for every row, so the check's answer is always "not packed" (None). Inside
`own_positions()` the check answers that without looking; everywhere else (a user's own
forward with packed position ids) it runs as transformers wrote it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


@contextlib.contextmanager
def own_positions() -> Iterator[None]:
    """Forwards inside this block pass no position ids (the model's own, never packed)."""
    _install()
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def _install() -> None:
    try:
        from transformers import masking_utils
    except ImportError:
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_own_positions", False):
        return  # another transformers (no such check), or installed already

    def find_packed_sequence_indices(position_ids):
        if getattr(_state, "on", False):
            return None
        return original(position_ids)

    find_packed_sequence_indices._own_positions = True
    find_packed_sequence_indices.__wrapped__ = original
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
