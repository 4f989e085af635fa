"""What the planners take from `runner check --links`'s cache (runner/planning/links.py), besides
`job.dp_sync: auto` (runner/planning/dp_sync.py):

- `parallel.partition: auto` (runner/profile/measure.py, runner/profile/auto.py): the link between
  two rank neighbours is check --links' figure where it cached that pair (either direction), in
  preference to `runner profile`'s own probe, which then measures no link for that pair. The split's
  transfer time per stage (runner/profile/split.py) is computed from it, and `up` prints one line
  naming the links taken and when they were measured. `runner profile --refresh` measures every
  link again and plans with its own figures.
- the elastic planner (runner/planning/elastic.py, runner/backends/ssh/elastic_loop.py): a new
  layout's pipeline hops between nodes are printed with their cached figures when it is chosen, and
  check --links' own rule (links.warnings) names a link of the new layout too slow for the step.
  With partition auto, the re-plan's split (above) takes the new neighbours' cached link: a pair
  `runner profile` never measured (it measures rank neighbours only) costs no probe on recovery.

A cached pair is valid as check --links keys it: both nodes' names and rank addresses (a node
given another address is not found, and measured again); its age is printed, not judged.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from runner.inventory import Inventory, Node
from runner.planning import links as linkmod
from runner.planning.links import LinkFigure, mbit

SOURCE = "runner check --links"
MAX_PERMUTED = 6  # nodes after the master whose pipeline orders are compared (6! = 720)


def cached_pair(a: Node, b: Node) -> tuple[LinkFigure, float | None] | None:
    """a <-> b as check --links cached it (it measures one direction per pair), with when."""
    return linkmod.load_dated(a, b) or linkmod.load_dated(b, a)


def neighbour_docs(order: list[Node]) -> list[dict | None]:
    """Per rank-neighbour pair (order[i], order[i + 1]): the cached figure as a `runner profile`
    link document, marked `from` so the plan can say where it came from; None where not cached."""
    out: list[dict | None] = []
    for a, b in zip(order, order[1:], strict=False):
        got = cached_pair(a, b)
        out.append(None if got is None else {"latency_s": got[0].latency_s, "bandwidth_Bps": got[0].bandwidth_Bps,
                                             "from": SOURCE, "measured_at": got[1]})
    return out


def when(at: float | None, now: float | None = None) -> str:
    """`cached 2026-12-06 14:02 UTC, 35 min ago`."""
    if at is None:
        return "cached"
    age = max((time.time() if now is None else now) - at, 0.0)
    ago = f"{age / 3600:.1f} h ago" if age >= 3600 else f"{age / 60:.0f} min ago"
    return f"cached {datetime.fromtimestamp(at, timezone.utc):%Y-%m-%d %H:%M} UTC, {ago}"


def _cell(a: str, b: str, fig: LinkFigure) -> str:
    return f"{a} -> {b} {mbit(fig.bandwidth_Bps)} Mbit/s {fig.latency_s * 1e3:.2f} ms"


def partition_line(names: list[str], links: list[dict | None], now: float | None = None) -> str | None:
    """partition auto's one line naming the neighbour links it took from check --links (None: none).
    names: the profile's nodes in rank order; links[i]: between names[i] and names[i + 1]."""
    used = [(names[i], names[i + 1], lk) for i, lk in enumerate(links)
            if isinstance(lk, dict) and lk.get("from") == SOURCE]
    if not used:
        return None
    dates = [float(lk["measured_at"]) for *_, lk in used if isinstance(lk.get("measured_at"), (int, float))]
    shown = ", ".join(_cell(a, b, LinkFigure(float(lk["bandwidth_Bps"]), float(lk["latency_s"]))) for a, b, lk in used)
    rest = len(links) - len(used)
    return (f"parallel.partition auto: links from {SOURCE} ({when(min(dates) if dates else None, now)}): {shown}"
            + (f"; {rest} other link(s) from runner profile" if rest else ""))


def pipeline_hops(inv: Inventory, pp: int) -> list[tuple[int, str, str]]:
    """(stage, node, next stage's node) for each pair of distinct nodes that pipeline neighbours
    span, ranks laid out as the trainer's mesh does (runner/planning/step_load.py)."""
    order = inv.ordered()
    return _hops([n.name for n in order], {n.name: inv.job.nproc_per_node or n.slots for n in order}, pp)


def _hops(names: list[str], nproc: dict[str, int], pp: int) -> list[tuple[int, str, str]]:
    """pipeline_hops of the nodes in this rank order."""
    ranks = [x for x in names for _ in range(nproc[x])]
    if pp < 2 or len(ranks) % pp:
        return []
    per, hops = len(ranks) // pp, []
    for g in range(per * (pp - 1)):
        hop = (g // per, ranks[g], ranks[g + per])
        if hop[1] != hop[2] and hop not in hops:
            hops.append(hop)
    return hops


def best_order(inv: Inventory, pp: int, boundary_bytes: float) -> tuple[list[str], tuple[float, ...]] | None:
    """A pure pipeline's node order (master first) whose hops are fastest for one microbatch's
    activations over the cached links: the slowest hop first, then the next (as the split compares
    stages), ties to the inventory's order. None where the inventory's order is already that, where
    a pair of the nodes was not measured (an unknown link is never preferred to a known one), or
    past MAX_PERMUTED nodes after the master. Also the chosen order's hop times, slowest first."""
    from itertools import permutations

    order = inv.ordered()
    if pp < 3 or len(order) < 3 or len(order) - 1 > MAX_PERMUTED:  # two nodes: one hop, whichever the order
        return None
    figs: dict[frozenset[str], LinkFigure] = {}
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            got = cached_pair(a, b)
            if got is None:
                return None
            figs[frozenset((a.name, b.name))] = got[0]
    nproc = {n.name: inv.job.nproc_per_node or n.slots for n in order}
    best: tuple[tuple[float, ...], list[str]] | None = None
    for rest in permutations([n.name for n in order[1:]]):  # the inventory's order first: it wins ties
        names = [order[0].name, *rest]
        cost = tuple(sorted((figs[frozenset((a, b))].seconds(boundary_bytes) for _, a, b in _hops(names, nproc, pp)),
                            reverse=True))
        if best is None or cost < best[0]:
            best = (cost, names)
    assert best is not None
    return None if best[1] == [n.name for n in order] else (best[1], best[0])


def layout_lines(inv: Inventory, pp: int, now: float | None = None) -> list[str]:
    """What the elastic planner prints for a layout (inv: its nodes with its trainer args): its
    pipeline hops with their cached figures, then check --links' warning for any link of the layout
    too slow for its step. Nothing where the cache holds none of its hops."""
    from contract.model_size import NotSized
    from runner.core.errors import UserError
    from runner.planning.step_load import step_load

    by_name = {n.name: n for n in inv.nodes}
    hops = pipeline_hops(inv, pp)
    got = {(a, b): cached_pair(by_name[a], by_name[b]) for _, a, b in hops}
    if not any(got.values()):
        return []
    dates = [g[1] for g in got.values() if g is not None and g[1] is not None]
    cells = [f"stage {k}->{k + 1} " + (_cell(a, b, g[0]) if (g := got[a, b]) else f"{a} -> {b} not measured")
             for k, a, b in hops]
    lines = [f"elastic: pipeline hops over links from {SOURCE} ({when(min(dates) if dates else None, now)}): "
             + "; ".join(cells)]
    try:
        load = step_load(inv)
    except (NotSized, UserError):  # partition auto: the split, planned at launch, weighs the links instead
        return lines
    return lines + [f"elastic: {w}" for w in linkmod.warnings(linkmod.cached_matrix(inv.ordered()), load)]
