"""The pipeline split both wings compute: the runner plans and prints it (`parallel.partition auto`
beside the uniform split), the trainer runs it."""

from __future__ import annotations


def uniform_bounds(num_layers: int, num_stages: int) -> list[int]:
    """`uniform_transformer`: layer boundaries [0, ..., num_layers] with equal counts per stage,
    earlier stages taking the remainder (as picotron does)."""
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds
