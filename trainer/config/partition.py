"""Which units (transformer layers, T5 blocks, Wide-ResNet bottlenecks) go to which pipeline stage.

Pure functions: a method string and a few counts in, half-open unit ranges out. The methods
are the ones Merak users know (`uniform`, `uniform_transformer`, `parameters`,
`custom:a,b,...`) plus `weighted:w0,w1,...` for pipelines whose nodes differ in speed (a Pi 5
next to a Pi 4 should take proportionally more layers), and `auto`: `runner up` measures every
node (`runner profile`) and passes the split that minimises the slowest stage as an explicit
`custom:` value (runner/profile/split.py), which the run's config.yaml then records. Without a
profile (plain torchrun) `auto` means `parameters`, said in one log line.

The embeddings always live on the first stage and the final norm + head on the last; the
methods that balance "items" (`uniform`, `parameters`) count them as one item each so that
the first and last stage take fewer transformer layers when those parts are heavy.

`custom:` boundaries are read in units (last boundary = the unit count) or in Merak's items
(last boundary = the model's item count, trainer/models/layout.py: the `Counting` of its family);
a spec ending at neither names both counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from contract.partition import balanced_bounds, items_to_layer_bounds, uniform_bounds
from contract.schedules import stage_to_rank
from trainer.config.schema import ConfigError

METHODS = ("uniform_transformer", "uniform", "parameters", "custom:a,b,...", "weighted:w0,w1,...", "auto")
AUTO_FALLBACK = "parameters"  # `auto` with no profile of the nodes


class PartitionError(ConfigError, ValueError):
    """A partition spec that cannot be honoured; the message is one line a user can act on."""


@dataclass(frozen=True)
class Counting:
    """How a model's `custom:` numbers may be counted: in units, or in Merak's items.

    `item_starts[i]` is the unit boundary item i starts at, None where no stage can start (inside
    a unit, between two embeddings); `item_labels[i]` says what the item holds."""

    name: str                              # the model, for messages ("t5-3b")
    units: int
    noun: str                              # layers | blocks | bottlenecks
    item_starts: tuple[int | None, ...]
    item_labels: tuple[str, ...]

    @property
    def items(self) -> int:
        return len(self.item_starts)

    def both(self) -> str:
        """`t5-3b has 74 Merak items or 48 blocks`."""
        return f"{self.name} has {self.items} Merak items or {self.units} {self.noun}"

    def nearest_legal(self, item: int) -> tuple[int | None, int | None]:
        before = next((i for i in range(item - 1, 0, -1) if self.item_starts[i] is not None), None)
        after = next((i for i in range(item + 1, self.items) if self.item_starts[i] is not None), None)
        return before, after


def generic_counting(num_layers: int, name: str = "the model") -> Counting:
    """Merak's counting of a transformer with one embedding item and one head item (L + 2)."""
    return Counting(name, num_layers, "layers", (0, *range(num_layers), num_layers),
                    ("embeddings", *(f"layer {i}" for i in range(num_layers)), "head"))


@dataclass(frozen=True)
class StageRange:
    stage: int
    start: int  # first layer index (inclusive)
    end: int  # last layer index + 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def partition_layers(method: str, num_layers: int, num_stages: int, *,
                     layer_params: int | list[int] = 0, embed_params: int = 0, head_params: int = 0,
                     key: str = "parallel.partition", counting: Counting | None = None) -> list[StageRange]:
    """Split `num_layers` units over `num_stages` stages with `method`. `layer_params`: one count
    for every unit, or one per unit (T5's decoder blocks outweigh its encoder blocks); `counting`:
    the model's Merak items for `custom:` (default: embeddings + layers + head)."""
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
        bounds = items_to_layer_bounds(_balanced_bounds([1] * (num_layers + 2), num_stages), num_layers)
    elif method == "parameters":
        per_unit = list(layer_params) if isinstance(layer_params, (list, tuple)) else [layer_params] * num_layers
        if len(per_unit) != num_layers or any(w <= 0 for w in per_unit):
            raise PartitionError(f"{key}: 'parameters' needs the per-layer parameter count")
        weights = [embed_params] + per_unit + [head_params]
        bounds = items_to_layer_bounds(_balanced_bounds(weights, num_stages), num_layers)
    elif method.startswith("custom:"):
        bounds = _custom_bounds(method[len("custom:"):], num_layers, num_stages, key,
                                counting or generic_counting(num_layers))
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
    try:
        return balanced_bounds(weights, num_parts)
    except ValueError as e:
        raise PartitionError(str(e)) from None


def _parse_ints(text: str, what: str, method: str, key: str, cast=int) -> list:
    try:
        return [cast(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise PartitionError(f"{key}: {method}:{text} must be comma-separated {what}") from None


def merak_items_to_units(bounds: list[int], counting: Counting, key: str = "parallel.partition") -> list[int] | None:
    """Item boundaries -> unit boundaries (None: `bounds` does not end at the item count). A
    boundary at an item no stage can start at is refused, naming the nearest legal ones."""
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != counting.items or counting.items == counting.units:
        return None
    spec = "custom:" + ",".join(map(str, bounds))
    if any(hi <= lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=False)):
        raise PartitionError(f"{key}: {spec} ends at {counting.name}'s Merak item count {counting.items} but its "
                             f"boundaries must be strictly increasing")
    units = [0]
    for b in bounds[1:-1]:
        start = counting.item_starts[b]
        if start is None:
            lo, hi = counting.nearest_legal(b)
            legal = " or ".join(str(x) for x in (lo, hi) if x is not None)
            raise PartitionError(f"{key}: {spec}: item {b} ({counting.item_labels[b]}) cannot start a stage "
                                 f"(it continues item {b - 1}, {counting.item_labels[b - 1]}); the nearest "
                                 f"legal boundaries are {legal}")
        units.append(start)
    units.append(counting.units)
    return units


def _endings(counting: Counting) -> str:
    """The two last boundaries `custom:` accepts, for error messages."""
    return (f"{counting.units} ({counting.noun}) or {counting.items} (Merak's items); "
            f"{counting.both()}")


def describe_custom(method: str, num_layers: int, num_stages: int, counting: Counting | None = None) -> str | None:
    """The line that says a `custom:` spec was read as Merak item boundaries, or that `auto` fell
    back to `parameters` (None otherwise), logged with the stage plan so nobody wonders why 74
    means 48 blocks or which split `auto` made."""
    if method.strip() == "auto":
        return (f"auto: no profile of the nodes reached this run (plain torchrun; `runner up` measures them and "
                f"passes the split as custom:...), so the split is `{AUTO_FALLBACK}`")
    if not method.strip().startswith("custom:"):
        return None
    counting = counting or generic_counting(num_layers)
    try:
        bounds = [int(x) for x in method.strip()[len("custom:"):].split(",") if x.strip()]
        units = merak_items_to_units(bounds, counting)
    except (ValueError, PartitionError):
        return None
    if units is None or len(bounds) != num_stages + 1:
        return None
    return (f"{method.strip()} ends at {bounds[-1]}, {counting.name}'s Merak item count "
            f"({', '.join(_item_groups(counting))}): read as item boundaries, i.e. {counting.noun} "
            f"custom:{','.join(map(str, units))}")


def _item_groups(counting: Counting) -> list[str]:
    """Item ranges by what they hold, for the note: `item 0 shared embedding`, `items 25-72 decoder 0-23`."""
    out, i = [], 0
    labels, starts = counting.item_labels, counting.item_starts
    while i < len(labels):
        group = labels[i].split(" ")[0]
        j = i
        while group in ("encoder", "decoder", "layer", "bottleneck") and j + 1 < len(labels) \
                and labels[j + 1].split(" ")[0] == group:
            j += 1
        units = [s for s in starts[i:j + 1] if s is not None]
        if i == j or not units:
            out.append(f"item {i} {labels[i]}")
        else:
            word = {"layer": "layers", "bottleneck": "bottlenecks"}.get(group, group)
            each = (j - i + 1) // len(units)
            first, last = labels[i].split(" ")[1], labels[j].split(" ")[1]
            out.append(f"items {i}-{j} {word} {first}-{last}" + (f" ({each} items each)" if each > 1 else ""))
        i = j + 1
    return out


def _custom_bounds(text: str, num_layers: int, num_stages: int, key: str, counting: Counting) -> list[int]:
    bounds = _parse_ints(text, "integers", "custom", key)
    if len(bounds) != num_stages + 1:
        raise PartitionError(f"{key}: custom:{text} has {len(bounds)} boundaries but {num_stages} stages need "
                             f"{num_stages + 1}: first 0, last {_endings(counting)}")
    merak = merak_items_to_units(bounds, counting, key)
    if merak is not None:
        return merak
    if bounds[0] != 0 or bounds[-1] != num_layers:
        raise PartitionError(f"{key}: custom:{text} must start at 0 and end at {_endings(counting)}")
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


def format_ranges(ranges: list[StageRange], pp: int, *, style: str = "loop", params: list[int] | None = None,
                  describe: Callable[[int, int], str] | None = None, first: str = "embeddings",
                  last: str = "norm + head", noun: str = "layers") -> str:
    """Human-readable plan, one line per stage, printed at start. `describe(start, end)` names a
    unit range (`encoder 15-23 + decoder 0-3`); `first`/`last` what the first and last stage hold
    besides their units."""
    n = len(ranges)
    lines = []
    for r in ranges:
        parts = []
        if r.stage == 0:
            parts.append(first)
        if r.num_layers:
            if describe is not None:
                parts.append(describe(r.start, r.end))
            else:
                parts.append(f"layers {r.start}-{r.end - 1}" if r.num_layers > 1 else f"layer {r.start}")
        if r.stage == n - 1:
            parts.append(last)
        extra = f", {params[r.stage] / 1e6:.2f}M params" if params else ""
        lines.append(f"stage {r.stage} (pp rank {stage_to_rank(r.stage, pp, n, style)}): "
                     f"{' + '.join(parts)} ({r.num_layers} {noun}{extra})")
    return "\n".join(lines)
