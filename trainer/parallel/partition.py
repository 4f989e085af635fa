"""Which transformer layers go to which pipeline stage.

Pure functions: a method string and a few counts in, half-open layer ranges out. The methods
are the ones Merak users know (`uniform`, `uniform_transformer`, `parameters`,
`custom:a,b,...`) plus `weighted:w0,w1,...` for pipelines whose nodes differ in speed (a Pi 5
next to a Pi 4 should take proportionally more layers), and `auto`: `runner up` measures every
node (`runner profile`) and passes the split that minimises the slowest stage as an explicit
`custom:` value (runner/partition_auto.py), which the run's config.yaml then records. Without a
profile (plain torchrun) `auto` means `parameters`, said in one log line.

The embeddings always live on the first stage and the final norm + head on the last; the
methods that balance "items" (`uniform`, `parameters`) count them as one item each so that
the first and last stage take fewer transformer layers when those parts are heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.partition import uniform_bounds
from trainer.config import ConfigError

METHODS = ("uniform_transformer", "uniform", "parameters", "custom:a,b,...", "weighted:w0,w1,...", "auto")
AUTO_FALLBACK = "parameters"  # `auto` with no profile of the nodes


class PartitionError(ConfigError, ValueError):
    """A partition spec that cannot be honoured; the message is one line a user can act on."""


@dataclass(frozen=True)
class StageRange:
    stage: int
    start: int  # first layer index (inclusive)
    end: int  # last layer index + 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def partition_layers(method: str, num_layers: int, num_stages: int, *,
                     layer_params: int = 0, embed_params: int = 0, head_params: int = 0,
                     key: str = "parallel.partition") -> list[StageRange]:
    """Split `num_layers` transformer layers over `num_stages` stages with `method`."""
    if num_stages < 1:
        raise PartitionError(f"{key}: need at least 1 stage, got {num_stages}")
    if num_layers < num_stages and not method.startswith(("uniform", "parameters")):
        raise PartitionError(f"{key}: {num_layers} layers cannot fill {num_stages} pipeline stages; "
                             f"use fewer stages or more layers")
    method = method.strip()
    if method == "auto":  # no profile reached this process: the runner would have passed custom:...
        method = AUTO_FALLBACK
    if method == "uniform_transformer":
        bounds = uniform_bounds(num_layers, num_stages)
    elif method == "uniform":
        # Merak's `uniform`: embeddings, every layer and the head each count as one item.
        bounds = _items_to_layer_bounds(_balanced_bounds([1] * (num_layers + 2), num_stages), num_layers)
    elif method == "parameters":
        if layer_params <= 0:
            raise PartitionError(f"{key}: 'parameters' needs the per-layer parameter count")
        weights = [embed_params] + [layer_params] * num_layers + [head_params]
        bounds = _items_to_layer_bounds(_balanced_bounds(weights, num_stages), num_layers)
    elif method.startswith("custom:"):
        bounds = _custom_bounds(method[len("custom:"):], num_layers, num_stages, key)
    elif method.startswith("weighted:"):
        bounds = _weighted_bounds(method[len("weighted:"):], num_layers, num_stages, key)
    else:
        raise PartitionError(f"{key}: unknown partition method {method!r}; choose one of {', '.join(METHODS)}")
    ranges = [StageRange(i, bounds[i], bounds[i + 1]) for i in range(num_stages)]
    for r in ranges:
        # A stage with no layer is fine only when it holds the embeddings or the head.
        if r.num_layers < 0 or (r.num_layers == 0 and 0 < r.stage < num_stages - 1):
            raise PartitionError(f"{key}: {method!r} leaves stage {r.stage} without layers "
                                 f"({num_layers} layers, {num_stages} stages); use fewer stages")
    return ranges


def check_partition_syntax(method: str, key: str = "parallel.partition") -> None:
    """The method's name and numbers, without a model or a stage count: config validation runs it
    also with pp=1, where the partition is unused but a typo in it is still a mistake."""
    m = method.strip()
    if m in ("uniform_transformer", "uniform", "parameters", "auto"):
        return
    if m.startswith("custom:"):
        bounds = _parse_ints(m[len("custom:"):], "integers", "custom", key)
        if len(bounds) < 2 or bounds[0] != 0 or any(hi <= lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=False)):
            raise PartitionError(f"{key}: {m} must be strictly increasing layer boundaries starting at 0 "
                                 f"(e.g. custom:0,4,8)")
        return
    if m.startswith("weighted:"):
        weights = _parse_ints(m[len("weighted:"):], "positive numbers", "weighted", key, cast=float)
        if not weights or any(not w > 0 for w in weights):
            raise PartitionError(f"{key}: {m} weights must be positive numbers, one per stage (e.g. weighted:2,1)")
        return
    raise PartitionError(f"{key}: unknown partition method {method!r}; choose one of {', '.join(METHODS)}")


def _balanced_bounds(weights: list[int], num_parts: int) -> list[int]:
    """Contiguous split of `weights` into `num_parts` non-empty parts minimising the heaviest part.

    Dynamic programming over (items, parts); ties go to the split whose earlier parts are
    larger, which keeps `uniform` consistent with `uniform_transformer` on round numbers.
    """
    n = len(weights)
    if num_parts > n:
        raise PartitionError(f"parallel.partition: {n} items cannot fill {num_parts} stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-part weight splitting the first i items into k parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(i - 1, k - 2, -1):  # last part = items j..i-1
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    i = n
    for k in range(num_parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def _items_to_layer_bounds(item_bounds: list[int], num_layers: int) -> list[int]:
    # Item 0 is the embeddings and item L+1 the head, so item i >= 1 is layer i-1.
    inner = [min(max(b - 1, 0), num_layers) for b in item_bounds[1:-1]]
    return [0, *inner, num_layers]


def _parse_ints(text: str, what: str, method: str, key: str, cast=int) -> list:
    try:
        return [cast(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise PartitionError(f"{key}: {method}:{text} must be comma-separated {what}") from None


def merak_items_to_layers(bounds: list[int], num_layers: int) -> list[int] | None:
    """Merak's custom boundaries count graph items, not transformer layers: item 0 is the
    embeddings, items 1..L the layers, then the head as one item (BERT: L+2 in all, Perseus'
    bert-huge `custom:0,8,14,20,26`) or final norm + LM head as two (GPT: L+3, Perseus' gpt3-xl
    `custom:0,8,14,21,27`). Stage s then starts at layer bounds[s] - 1. None: not that counting."""
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] not in (num_layers + 2, num_layers + 3):
        return None
    inner = [b - 1 for b in bounds[1:-1]]
    if any(not 0 < b < num_layers for b in inner):
        return None
    return [0, *inner, num_layers]


def _endings(num_layers: int) -> str:
    """The two last boundaries `custom:` accepts, for error messages."""
    return (f"the layer count {num_layers} (custom:0,...,{num_layers}) or Merak's item count {num_layers + 2} "
            f"(embeddings + {num_layers} layers + head) or {num_layers + 3} (embeddings + layers + final norm "
            f"+ head)")


def describe_custom(method: str, num_layers: int, num_stages: int) -> str | None:
    """The line that says a `custom:` spec was read as Merak item boundaries, or that `auto` fell
    back to `parameters` (None otherwise), logged with the stage plan so nobody wonders why 27
    means 24 layers or which split `auto` made."""
    if method.strip() == "auto":
        return (f"auto: no profile of the nodes reached this run (plain torchrun; `runner up` measures them and "
                f"passes the split as custom:...), so the split is `{AUTO_FALLBACK}`")
    if not method.strip().startswith("custom:"):
        return None
    try:
        bounds = [int(x) for x in method.strip()[len("custom:"):].split(",") if x.strip()]
    except ValueError:
        return None
    layers = merak_items_to_layers(bounds, num_layers)
    if layers is None or len(bounds) != num_stages + 1:
        return None
    extra = bounds[-1] - num_layers
    return (f"{method.strip()} ends at {bounds[-1]} = {num_layers} layers + {extra}: read as Merak item boundaries "
            f"(item 0 embeddings, items 1-{num_layers} layers, then {'head' if extra == 2 else 'final norm, head'}), "
            f"i.e. layer boundaries custom:{','.join(map(str, layers))}")


def _custom_bounds(text: str, num_layers: int, num_stages: int, key: str) -> list[int]:
    bounds = _parse_ints(text, "integers", "custom", key)
    merak = merak_items_to_layers(bounds, num_layers)
    if merak is not None and len(bounds) == num_stages + 1:
        bounds = merak
    if len(bounds) != num_stages + 1:
        raise PartitionError(f"{key}: custom:{text} has {len(bounds)} boundaries but {num_stages} stages need "
                             f"{num_stages + 1}: first 0, last {_endings(num_layers)}")
    if bounds[-1] in (num_layers + 2, num_layers + 3) and bounds[0] == 0:
        raise PartitionError(f"{key}: custom:{text} ends at Merak's item count {bounds[-1]} but its inner "
                             f"boundaries must lie between items 2 and {num_layers} (item 0 is the embeddings, "
                             f"items 1-{num_layers} the layers), strictly increasing")
    if bounds[0] != 0 or bounds[-1] != num_layers:
        raise PartitionError(f"{key}: custom:{text} must start at 0 and end at {_endings(num_layers)}")
    if any(hi <= lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=False)):
        raise PartitionError(f"{key}: custom:{text} boundaries must be strictly increasing "
                             f"(every stage needs at least one layer)")
    return bounds


def _weighted_bounds(text: str, num_layers: int, num_stages: int, key: str) -> list[int]:
    weights = _parse_ints(text, "positive numbers", "weighted", key, cast=float)
    if len(weights) != num_stages:
        raise PartitionError(f"{key}: weighted:{text} has {len(weights)} weights but there are {num_stages} "
                             f"stages; give one weight per stage")
    if any(w <= 0 for w in weights):
        raise PartitionError(f"{key}: weighted:{text} weights must be positive")
    # Largest-remainder rounding of the proportional shares, at least one layer per stage.
    total = sum(weights)
    shares = [w / total * num_layers for w in weights]
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) < num_layers:
        i = max(range(num_stages), key=lambda s: (shares[s] - counts[s], weights[s]))
        counts[i] += 1
    while sum(counts) > num_layers:
        i = min((s for s in range(num_stages) if counts[s] > 1), key=lambda s: (shares[s] - counts[s], -s))
        counts[i] -= 1
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def stage_to_rank(stage: int, pp: int, num_stages: int, style: str = "loop") -> int:
    """Pipeline rank that runs `stage`: round-robin ('loop') or zig-zag ('v', for ZBV/DualPipeV)."""
    if style == "v":
        virt = stage // pp
        return stage % pp if virt % 2 == 0 else pp - 1 - stage % pp
    return stage % pp


def format_ranges(ranges: list[StageRange], pp: int, *, style: str = "loop",
                  params: list[int] | None = None) -> str:
    """Human-readable plan, one line per stage, printed at start."""
    n = len(ranges)
    lines = []
    for r in ranges:
        parts = []
        if r.stage == 0:
            parts.append("embeddings")
        if r.num_layers:
            parts.append(f"layers {r.start}-{r.end - 1}" if r.num_layers > 1 else f"layer {r.start}")
        if r.stage == n - 1:
            parts.append("norm + head")
        extra = f", {params[r.stage] / 1e6:.2f}M params" if params else ""
        lines.append(f"stage {r.stage} (pp rank {stage_to_rank(r.stage, pp, n, style)}): "
                     f"{' + '.join(parts)} ({r.num_layers} layers{extra})")
    return "\n".join(lines)
