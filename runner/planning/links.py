"""The links between a job's nodes as `runner check --links` measured them: the matrix it prints,
the warnings where a link cannot carry what a step sends over it, and the cache the planners read
(`job.dp_sync: auto`, and whoever else wants a measured link: the elastic planner, partition auto).

A link is measured from a to b (a sends, b acknowledges; runner/profile/links.py) over TCP between
the nodes' rank addresses, as gloo's point-to-point sends ride; one direction per pair (from the
node earlier in rank order), used for both directions where the other was not measured.

Cached one file per pair, under the profiles' directory (runner/planning/profile_cache.py):
`links-<a>-<b>-<key>.json`, the key made of both nodes' names and rank addresses, so a subset of the
nodes (an elastic layout) finds its pairs, and a node given another address is measured again.

A link is too slow for a flow when sending that flow's bytes per step (plus its latency once per
message) takes more than SLOW_FRACTION of the step's compute time (runner/planning/step_load.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runner.inventory import Node
from runner.planning import profile_cache
from runner.planning.step_load import Flow, StepLoad

SLOW_FRACTION = 0.2  # a step's traffic over one link may take at most this share of its compute time
KIND = "links"


@dataclass(frozen=True)
class LinkFigure:
    bandwidth_Bps: float   # bytes/s
    latency_s: float       # one way (half the median round trip)

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        """Time to send nbytes in `messages` messages over this link."""
        return nbytes / self.bandwidth_Bps + messages * self.latency_s


@dataclass
class LinkMatrix:
    nodes: list[str]
    measured: dict[tuple[str, str], LinkFigure] = field(default_factory=dict)  # (from, to)
    cached: set[tuple[str, str]] = field(default_factory=set)

    def get(self, a: str, b: str) -> LinkFigure | None:
        """a -> b as measured, else b -> a (one direction per pair is measured), else None."""
        return self.measured.get((a, b)) or self.measured.get((b, a))

    def slowest(self, nodes: list[str]) -> tuple[tuple[str, str], LinkFigure] | None:
        """The slowest measured link between any two distinct nodes of `nodes`: ((from, to) as
        measured, its figure)."""
        found = [((a, b) if (a, b) in self.measured else (b, a), lk) for i, a in enumerate(nodes)
                 for b in nodes[i + 1:] if a != b and (lk := self.get(a, b)) is not None]
        return min(found, key=lambda x: x[1].bandwidth_Bps) if found else None


def pairs(names: list[str]) -> list[tuple[str, str]]:
    """Every unordered pair once, the earlier node (rank order) first."""
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def rounds(names: list[str]) -> list[list[tuple[str, str]]]:
    """pairs(names) grouped into rounds in which no node appears twice (the circle method): the
    pairs of one round are measured at once without sharing a node's link."""
    items: list[str | None] = list(names) + ([None] if len(names) % 2 else [])
    n, out = len(items), []
    for _ in range(n - 1):
        rnd = []
        for i in range(n // 2):
            a, b = items[i], items[n - 1 - i]
            if a is not None and b is not None:
                rnd.append((a, b) if names.index(a) < names.index(b) else (b, a))
        out.append(rnd)
        items = [items[0], items[-1], *items[1:-1]]
    return [r for r in out if r]


# ------------------------------------------------------------------ the cache


def pair_key(a: Node, b: Node) -> str:
    return profile_cache.link_key(f"{a.name}@{a.rank_addr}", f"{b.name}@{b.rank_addr}")


def save(a: Node, b: Node, fig: LinkFigure) -> None:
    profile_cache.save(KIND, f"{a.name}-{b.name}", pair_key(a, b),
                       {"from": a.name, "to": b.name, "bandwidth_Bps": fig.bandwidth_Bps, "latency_s": fig.latency_s,
                        "measured_at": time.time()})


def load(a: Node, b: Node) -> LinkFigure | None:
    got = load_dated(a, b)
    return got[0] if got else None


def load_dated(a: Node, b: Node) -> tuple[LinkFigure, float | None] | None:
    """a -> b as cached, with when it was measured (epoch seconds; None in a file that lacks it)."""
    doc = profile_cache.load(KIND, f"{a.name}-{b.name}", pair_key(a, b))
    if not isinstance(doc, dict):
        return None
    bw, lat, at = doc.get("bandwidth_Bps"), doc.get("latency_s"), doc.get("measured_at")
    if not (isinstance(bw, (int, float)) and bw > 0 and isinstance(lat, (int, float)) and lat >= 0):
        return None  # a file edited or half-written by hand: measured again
    when = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) and 0 < at < 1e11 else None
    return LinkFigure(float(bw), float(lat)), when


def cached_matrix(nodes: list[Node]) -> LinkMatrix:
    """What the cache holds for these nodes (either direction of each pair)."""
    m = LinkMatrix([n.name for n in nodes])
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            for x, y in ((a, b), (b, a)):
                fig = load(x, y)
                if fig is not None:
                    m.measured[x.name, y.name] = fig
                    m.cached.add((x.name, y.name))
    return m


# ------------------------------------------------------------------ what is printed


def mbit(bps: float) -> str:
    return f"{bps * 8 / 1e6:.1f}"


def render(m: LinkMatrix) -> str:
    """One row per sending node, one column per receiving one: `Mbit/s / latency ms`."""
    width = max(12, *(len(n) for n in m.nodes)) + 2
    head = "from \\ to".ljust(width) + "".join(n.ljust(width + 6) for n in m.nodes).rstrip()
    lines = ["links (Mbit/s, one-way latency ms; measured from the row's node to the column's over TCP between "
             "the nodes):", head]
    for a in m.nodes:
        cells = []
        for b in m.nodes:
            lk = m.measured.get((a, b))
            if a == b:
                cell = "-"
            elif lk is None and (lk := m.measured.get((b, a))) is not None:
                cell = f"({mbit(lk.bandwidth_Bps)} / {lk.latency_s * 1e3:.2f})"  # the other direction's figure
            elif lk is None:
                cell = "not measured"
            else:
                cell = f"{mbit(lk.bandwidth_Bps)} / {lk.latency_s * 1e3:.2f}"
            cells.append(cell.ljust(width + 6))
        lines.append(a.ljust(width) + "".join(cells).rstrip())
    return "\n".join(lines)


def warnings(m: LinkMatrix, load: StepLoad, fraction: float = SLOW_FRACTION) -> list[str]:
    """One line per link too slow for a flow of the step (the slowest flow per link and kind)."""
    worst: dict[tuple[str, str, str], tuple[float, Flow, LinkFigure]] = {}
    for f in load.flows:
        lk = m.get(f.src, f.dst)
        if lk is None:
            continue
        t = lk.seconds(f.bytes, f.messages)
        key = (min(f.src, f.dst), max(f.src, f.dst), f.kind)
        if key not in worst or t > worst[key][0]:
            worst[key] = (t, f, lk)
    out = []
    for t, f, lk in sorted(worst.values(), key=lambda x: -x[0]):
        if t > fraction * load.compute_s:
            what = "activations and their gradients" if f.kind == "pipeline" else "the gradient all-reduce"
            out.append(f"warning: link {f.src} -> {f.dst} ({mbit(lk.bandwidth_Bps)} Mbit/s) is too slow for stage "
                       f"{f.stage}'s {f.kind} traffic: {what}, {f.bytes / 1e6:.1f} MB per step, take {t:.2f} s, "
                       f"over {fraction:.0%} of the step's ~{load.compute_s:.2f} s compute ({load.compute_from})"
                       + ("; job.dp_sync: auto would choose DiLoCo" if f.kind == "data-parallel" else ""))
    return out
