"""`job.dp_sync: auto | allreduce | diloco`: how the job's data-parallel replicas sync, passed to the
trainer as `--parallel.dp_sync` (trainer/parallel/diloco.py, docs/diloco.md).

`auto` chooses DiLoCo where the links between a stage's replicas cannot carry the step's gradient
all-reduce (2 (n-1)/n x the stage's fp32 parameter bytes per rank, ring) within SYNC_FRACTION of the
step's compute time (runner/planning/step_load.py), else allreduce. The link is the slowest one
between the nodes of any stage's replicas, as `runner check --links` measured and cached it
(runner/planning/links.py), else as `runner profile` measured it between rank neighbours; with no
measured link there, auto keeps allreduce and says how to measure. `--dry-run` prints the choice
and why: bytes per step, the expected sync time per step both ways, the link used.

The choice is made once, before launch, and its flags join the job's args: an elastic run's
re-plans (runner/backends/ssh/elastic_loop.py) keep them, so a run never switches between
allreduce and DiLoCo mid-way (their checkpoints hold different state). A DiLoCo run that shrinks to
one replica trains as that replica (the trainer warns), and a replica that rejoins starts from the
checkpoint's anchor (trainer/checkpoint/state.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from contract.model_size import NotSized
from runner.inventory import Inventory, Node
from runner.inventory.safe_yaml import CONFIG_MAX_BYTES
from runner.inventory.safe_yaml import load as load_yaml
from runner.planning import links as linkmod
from runner.planning.job_settings import integer
from runner.planning.links import LinkFigure, mbit
from runner.planning.step_load import StepLoad, step_load

SYNC_FRACTION = 0.2       # the all-reduce may take at most this share of a step's compute, else DiLoCo
DEFAULT_INNER_STEPS = 50  # trainer/config/schema.py DiLoCoConfig.inner_steps
_KEY_RE = re.compile(r"^[0-9a-f]{16}$")


@dataclass
class DpSyncChoice:
    mode: str                                        # allreduce | diloco
    args: list[str] = field(default_factory=list)    # added to the trainer's
    lines: list[str] = field(default_factory=list)   # what --dry-run prints


def inner_steps(inv: Inventory) -> int:
    """The job's parallel.diloco.inner_steps (its args' last, else its config file's), else the
    trainer's default; a value that is no positive number is left to the trainer to name."""
    value = None
    if inv.job.config:
        doc = load_yaml(inv.job.config, "job.config", CONFIG_MAX_BYTES) or {}  # the runner's one bounded loader
        par = doc.get("parallel") if isinstance(doc, dict) else None
        dl = par.get("diloco") if isinstance(par, dict) else None
        value = dl.get("inner_steps") if isinstance(dl, dict) else None
    args = list(inv.job.args)
    for i, a in enumerate(args):
        name, eq, inline = a.partition("=")
        if name == "--parallel.diloco.inner_steps":
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else value)
    h = integer(value) if value is not None else None
    return h if h is not None and 1 <= h <= 1 << 20 else DEFAULT_INNER_STEPS


def _args(mode: str, h: int) -> list[str]:
    return ["--parallel.dp_sync", mode] + (["--parallel.diloco.inner_steps", str(h)] if mode == "diloco" else [])


def choose(inv: Inventory) -> DpSyncChoice | None:
    """job.dp_sync's choice (None: unset, the trainer config decides)."""
    mode = inv.job.dp_sync
    if mode is None:
        return None
    h = inner_steps(inv)
    if mode != "auto":
        return _fixed(mode, h)
    try:
        load = step_load(inv)
    except NotSized as exc:
        return DpSyncChoice("allreduce", _args("allreduce", h), [f"dp_sync: allreduce (auto: the job is not sized: {exc})"])
    return decide(load, known_links(inv), h)


def without_links(inv: Any, why: str) -> DpSyncChoice | None:
    """job.dp_sync where no link between the job's nodes can be measured before it starts (a Slurm
    allocation): auto keeps allreduce and says why in --dry-run, an explicit mode is applied as is."""
    mode = inv.job.dp_sync
    if mode is None:
        return None
    h = inner_steps(inv)
    if mode == "auto":
        return DpSyncChoice("allreduce", _args("allreduce", h),
                            [f"dp_sync: allreduce (auto: {why}; set job.dp_sync: diloco for slow links)"])
    return _fixed(mode, h)


def _fixed(mode: str, h: int) -> DpSyncChoice:
    """An explicit job.dp_sync (allreduce or diloco): applied as written."""
    return DpSyncChoice(mode, _args(mode, h), [f"dp_sync: {mode} (job.dp_sync)" + (f", inner_steps {h}" if mode == "diloco" else "")])


def decide(load: StepLoad, matrix: linkmod.LinkMatrix, h: int, fraction: float = SYNC_FRACTION) -> DpSyncChoice:
    """The choice for this step load over these links (module doc)."""
    if load.dp < 2:
        return DpSyncChoice("allreduce", _args("allreduce", h),
                            [f"dp_sync: allreduce (auto: dp {load.dp}, no replicas to sync)"])
    worst: tuple[float, int, tuple[str, str], LinkFigure] | None = None
    for k, group in enumerate(load.dp_groups()):
        found = matrix.slowest(group)
        if found is None:
            continue
        pair, lk = found
        t = lk.seconds(load.allreduce_bytes(k), 2 * (load.dp - 1))
        if worst is None or t > worst[0]:
            worst = (t, k, pair, lk)
    if worst is None:
        cross = any(len(set(g)) > 1 for g in load.dp_groups())
        why = ("no measured link between the replicas' nodes; run `runner check --links` and plan again" if cross
               else "the replicas share a node")
        return DpSyncChoice("allreduce", _args("allreduce", h), [f"dp_sync: allreduce (auto: {why})"])
    t, k, (a, b), lk = worst
    mode = "diloco" if t > fraction * load.compute_s else "allreduce"
    nbytes = load.allreduce_bytes(k)
    src = "runner check --links" if (a, b) in matrix.cached or (b, a) in matrix.cached else "runner profile"
    lines = [f"dp_sync: {mode} (auto): stage {k}'s gradient all-reduce sends {nbytes / 1e6:.1f} MB per step per rank "
             f"(dp {load.dp}, ring) over link {a} -> {b} ({mbit(lk.bandwidth_Bps)} Mbit/s, "
             f"{lk.latency_s * 1e3:.2f} ms, measured by {src})",
             f"  sync per step: allreduce {t:.2f} s, diloco {t / h:.3f} s (every {h} steps, fp32); compute "
             f"~{load.compute_s:.2f} s per step ({load.compute_from}); limit {fraction:.0%} = "
             f"{fraction * load.compute_s:.2f} s"]
    return DpSyncChoice(mode, _args(mode, h), lines)


def known_links(inv: Inventory) -> linkmod.LinkMatrix:
    """`runner check --links`'s cached pairs; pairs it lacks from `runner profile`'s neighbour links."""
    nodes = inv.ordered()
    m = linkmod.cached_matrix(nodes)
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            if m.get(a.name, b.name) is None:
                fig = _profiled_link(a, b)
                if fig is not None:
                    m.measured[a.name, b.name] = fig
    return m


def _profiled_link(a: Node, b: Node) -> LinkFigure | None:
    """The newest `runner profile` link a -> b (runner/profile/measure.py's `link-<a>-<b>-<key>.json`)."""
    from runner.planning.profile_cache import cache_dir

    best: tuple[float, LinkFigure] | None = None
    try:
        files = list(cache_dir().glob(f"link-{a.name}-{b.name}-*.json"))
    except OSError:
        return None
    for p in files:
        if not _KEY_RE.match(p.name[len(f"link-{a.name}-{b.name}-"):-len(".json")]):
            continue  # another pair whose names share this prefix
        try:
            doc, mtime = json.loads(p.read_text()), p.stat().st_mtime
        except (OSError, ValueError, RecursionError):
            continue
        bw, lat = (doc.get("bandwidth_Bps"), doc.get("latency_s")) if isinstance(doc, dict) else (None, None)
        if isinstance(bw, (int, float)) and bw > 0 and isinstance(lat, (int, float)) and lat >= 0 \
                and (best is None or mtime > best[0]):
            best = (mtime, LinkFigure(float(bw), float(lat)))
    return best[1] if best else None
