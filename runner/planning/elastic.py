"""Elastic runs (`job.elastic`, `runner up --elastic`): the layout over the nodes a run has now.

When a node is lost the run goes on over the others, and when it answers again (`rejoin`) it is
taken back; each time the layout is chosen again here, before anything restarts:

- the world is the nodes' processes (`slots`, or job.nproc_per_node); tp stays (within a node);
- dp is kept as near the job's as the world allows, pp takes the rest (the fewest stages lost);
- the global batch is kept: batch_size per dp rank = the job's global batch / dp, which must divide
  evenly (and into microbatch_num with a pipeline); the data order and the LR schedule are the
  checkpoint's, so the loss curve equals a resume into the same layout by hand;
- a layout in which a node cannot hold its stage (runner/planning/sizing.py) is passed over;
- `parallel.partition` must be a rule (uniform_transformer, parameters, auto, ...): the trainer, or
  for `auto` the runner from the cached profiles, splits the layers again for the new pp, with the
  new pipeline neighbours' links as `runner check --links` cached them where it did;
- a pure pipeline (dp 1) of 3 stages or more takes its nodes (the master first) in the order whose
  hops are fastest over the links `runner check --links` cached, where it measured every pair and
  that order fits (_link_ordered); else the inventory's order. The layout chosen, its pipeline hops
  are printed with their cached links and check --links' warning for a link too slow for the step
  (link_lines). The links choose no pp or dp.

Torch-free and pure: the layouts and the refusals are decided from the inventory alone (tests and
`up --dry-run` use it without a node). The events of a run (`elastic.jsonl` in its run dir) are
read back by `runner status`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from contract.model_size import NotSized
from contract.regroup import NewLayout, Regroup, dumps
from runner.core.errors import UserError
from runner.inventory import Inventory
from runner.inventory.elastic_spec import ElasticSpec
from runner.planning.sizing import job_settings, model_of, refusal, size_job

ELASTIC_FILE = "elastic.jsonl"  # in the run dir of every node of the current layout
EVENTS_MAX = 1 << 20  # an elastic.jsonl read from a node: a few hundred bytes an event
RULE_PARTITIONS = ("uniform_transformer", "uniform", "parameters", "auto")


@dataclass(frozen=True)
class Layout:
    nodes: tuple[str, ...]   # node rank order: the master first (then the inventory's, or the links', _link_ordered)
    pp: int
    dp: int
    tp: int
    batch_size: int          # per dp rank

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def args(self, job: Layout | None = None) -> list[str]:
        """The trainer args that put the job into this layout (after the job's own: the last wins).
        The batch only where it differs from the job's: a profile cached for the job's args (its
        key holds the batch, not pp or dp) then still answers for the new layout."""
        same = job is not None and job.batch_size == self.batch_size
        return ["--parallel.pp", str(self.pp), "--parallel.dp", str(self.dp)] + \
            ([] if same else ["--train.batch_size", str(self.batch_size)])

    @property
    def shown(self) -> str:
        return f"pp {self.pp} x dp {self.dp} x tp {self.tp} on {len(self.nodes)} node(s) ({', '.join(self.nodes)})"

    def as_dict(self) -> dict:
        return {"nodes": list(self.nodes), "pp": self.pp, "dp": self.dp, "tp": self.tp, "batch_size": self.batch_size}


def spec_of(inv: Inventory, flag: bool) -> ElasticSpec | None:
    """job.elastic, else ElasticSpec() for `up --elastic`, else None (not elastic)."""
    return inv.job.elastic if inv.job.elastic is not None else (ElasticSpec() if flag else None)


def sub_inventory(inv: Inventory, names: list[str] | tuple[str, ...], keep_order: bool = False) -> Inventory:
    """The inventory restricted to `names`, in its own order (keep_order: in names' order, a
    layout's, whose first is its master); the master stays the master while it is among them, else
    the first of them is (node rank 0)."""
    keep = set(names)
    nodes = [n for n in inv.nodes if n.name in keep]
    if keep_order:
        nodes.sort(key=lambda n: list(names).index(n.name))
    if not nodes:
        raise UserError(f"{inv.path}: no node left")
    master = inv.master.name if inv.master.name in keep else nodes[0].name
    nodes = [replace(n, role="master" if n.name == master else "worker") for n in nodes]
    return Inventory(path=inv.path, nodes=nodes, job=replace(inv.job, args=list(inv.job.args)))


def job_layout(inv: Inventory) -> Layout:
    """The layout the job asks for on all of the inventory's nodes."""
    s = job_settings(inv.job)
    world = sum(inv.job.nproc_per_node or n.slots for n in inv.nodes)
    pp, tp = int(s["parallel.pp"]), int(s["parallel.tp"])
    dp = int(s["parallel.dp"] or max(world // (pp * tp), 1))
    return Layout(tuple(n.name for n in inv.ordered()), pp, dp, tp, int(s["train.batch_size"]))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose(inv: Inventory, names: list[str] | tuple[str, ...], want: Layout) -> Layout:
    """The layout over the nodes `names` (of inv) that keeps `want`'s global batch and tp, dp as
    near want.dp as possible (then the most stages). UserError, one line, if none can run."""
    sub = sub_inventory(inv, names)
    s = job_settings(inv.job)
    order = tuple(n.name for n in sub.ordered())
    world = sum(sub.job.nproc_per_node or n.slots for n in sub.nodes)
    tp, micro = want.tp, int(s["train.microbatch_num"] or 0)
    try:
        layers = model_of(s, inv.job)[1].layers
    except (NotSized, UserError, OSError, ValueError):
        layers = None
    why: list[str] = []
    found = []
    if world % tp:
        raise UserError(f"elastic: the {world} processes on {', '.join(order)} do not divide into tp {tp}")
    for dp in _divisors(world // tp):
        pp = world // (tp * dp)
        if want.global_batch % dp:
            why.append(f"dp {dp}: the global batch {want.global_batch} does not divide by it")
            continue
        batch = want.global_batch // dp
        if pp > 1 and micro and batch % micro:
            why.append(f"dp {dp}: batch {batch} a rank does not divide into {micro} microbatches")
            continue
        if layers is not None and pp > layers:
            why.append(f"pp {pp}: more stages than the model's {layers} layers")
            continue
        found.append(Layout(order, pp, dp, tp, batch))
    found.sort(key=lambda lay: (abs(lay.dp - want.dp), -lay.pp))
    for lay in found:
        line = _misfit(sub, lay)
        if line is None:
            return _link_ordered(inv, s, lay)
        why.append(f"pp {lay.pp} x dp {lay.dp}: {line}")
    raise UserError(f"elastic: no layout runs on {', '.join(order)}: " + ("; ".join(why) or "no candidate"))


def _link_ordered(inv: Inventory, s: dict, lay: Layout) -> Layout:
    """lay with its pipeline's nodes in the order whose hops are fastest over the links `runner
    check --links` cached (runner/planning/link_use.py best_order; the master stays first): a pure
    pipeline (dp 1) of three stages or more, every pair measured, and the order fitting each node's
    memory; else lay as it is (the inventory's order)."""
    if lay.dp != 1 or lay.pp < 3 or len(lay.nodes) < 3:
        return lay
    from runner.planning.link_use import best_order
    from runner.planning.step_load import WIRE_BYTES

    try:
        hidden = model_of(s, inv.job)[1].hidden
    except (NotSized, UserError, OSError, ValueError):
        return lay
    micro = max(lay.batch_size // int(s["train.microbatch_num"] or 4), 1)
    got = best_order(sub_inventory(inv, lay.nodes), lay.pp, micro * int(s["data.seq_len"]) * hidden * WIRE_BYTES)
    if got is None:
        return lay
    cand = replace(lay, nodes=tuple(got[0]))
    return cand if _misfit(sub_inventory(inv, cand.nodes, keep_order=True), cand) is None else lay


def link_lines(inv: Inventory, layout: Layout) -> list[str]:
    """What `runner check --links`' cache says about the layout's links (runner/planning/link_use.py):
    its pipeline hops' figures and check --links' warning for any too slow for its step; [] where
    nothing is cached. Printed when a layout is chosen; never refuses one."""
    from runner.planning.link_use import layout_lines

    sub = sub_inventory(inv, layout.nodes, keep_order=True)
    plain = [n.name for n in sub_inventory(inv, layout.nodes).ordered()]
    lines = layout_lines(replace(sub, job=replace(sub.job, args=[*sub.job.args, *layout.args()])), layout.pp)
    if lines and plain != list(layout.nodes):
        lines.insert(1, f"elastic: pipeline order {', '.join(layout.nodes)} (inventory order {', '.join(plain)}): "
                        f"its hops are the fastest of the orders over the cached links")
    return lines


def _misfit(sub: Inventory, lay: Layout) -> str | None:
    """Why a node cannot hold its stage in this layout (runner/planning/sizing.py), or None."""
    if sub.job.command:
        return None
    trial = replace(sub, job=replace(sub.job, args=[*sub.job.args, *lay.args()]))
    try:
        line = refusal(size_job(trial), str(sub.path))
    except NotSized:
        return None
    return line.split(": ", 1)[1].split("; use", 1)[0] if line else None


def check(inv: Inventory, spec: ElasticSpec) -> None:
    """Refuse, before anything starts, an elastic job that could never shrink: a fixed split, tp
    across nodes, a job.command (not the trainer: nothing to re-plan), or a model that no
    `min_nodes` of the nodes can hold (tried on the nodes with the most memory)."""
    where = f"{inv.path}:{spec.line}: job.elastic" if spec.line else "--elastic"
    if inv.job.command:
        raise UserError(f"{where}: job.command is not the trainer, so its layout cannot be planned again; "
                        f"drop job.command or elastic")
    s = job_settings(inv.job)
    part = str(s["parallel.partition"] or "")
    if int(s["parallel.pp"]) > 1 and not part.startswith(RULE_PARTITIONS):
        raise UserError(f"{where}: parallel.partition {part} is a fixed split for {s['parallel.pp']} stages; "
                        f"give `auto` (split again from the nodes' profiles) or a rule "
                        f"({', '.join(RULE_PARTITIONS[:3])}) so a smaller pipeline can be split")
    tp = int(s["parallel.tp"])
    narrow = [n.name for n in inv.nodes if (inv.job.nproc_per_node or n.slots) % tp]
    if tp > 1 and narrow:
        raise UserError(f"{where}: parallel.tp {tp} spans nodes ({narrow[0]} runs "
                        f"{inv.job.nproc_per_node or inv.node(narrow[0]).slots} process(es)); a tp group "
                        f"cannot lose a node: keep tp within a node")
    want = job_layout(inv)
    from runner.planning.sizing import cached_profiles, known_memory

    profiles = cached_profiles(inv.nodes)
    roomy = sorted(inv.nodes, key=lambda n: -(known_memory(n, bool(n.gpus), profiles.get(n.name))[0] or 1 << 62))
    fewest = [n.name for n in roomy[:spec.min_nodes]]
    try:
        choose(inv, fewest, want)
    except UserError as exc:
        raise UserError(f"{where}: min_nodes {spec.min_nodes}: {str(exc).removeprefix('elastic: ')}; "
                        f"raise min_nodes") from None


def replicas_args(inv: Inventory) -> list[str]:
    """`--checkpoint.replicas 1` unless the job keeps copies already: a lost node's part of each
    checkpoint is then on the next node, and the nodes left hold a whole one."""
    s = job_settings(inv.job)
    return [] if int(s.get("checkpoint.replicas") or 0) >= 1 else ["--checkpoint.replicas", "1"]


def render(inv: Inventory, spec: ElasticSpec) -> str:
    """`up --dry-run`'s lines: the spec, and the layout the run would take without each node
    (the last node only, past 8 nodes)."""
    want = job_layout(inv)
    extra = " ".join(replicas_args(inv))
    lines = [f"elastic: min_nodes {spec.min_nodes}, rejoin {'yes' if spec.rejoin else 'no'}; starts as {want.shown}"
             + (f"; {extra} added (the nodes left hold a whole checkpoint)" if extra else "")]
    order = [n.name for n in inv.ordered()]
    for gone in (order if len(order) <= 8 else order[-1:]):
        left = [n for n in order if n != gone]
        if len(left) < spec.min_nodes:
            lines.append(f"  without {gone}: stops ({len(left)} node(s) left, min_nodes {spec.min_nodes})")
            continue
        try:
            lines.append(f"  without {gone}: {choose(inv, left, want).shown}")
        except UserError as exc:
            lines.append(f"  without {gone}: stops ({str(exc).removeprefix('elastic: ')})")
    return "\n".join(lines)


def in_place_on(inv: Inventory) -> bool:
    """The job's args turn on the trainer's in-place regroup (`--elastic.in_place true`,
    docs/checkpoints.md): the runner then writes regroup.json on a loss before it restarts anything.
    Read from job.args only: a config file that turns it on alone leaves the runner on the restart
    path (the trainer waits elastic.wait_s for a file that never comes, then the restart goes on)."""
    on, args = False, list(inv.job.args)
    for i, a in enumerate(args):  # the last one given wins, as the trainer reads them
        name, eq, value = a.partition("=")
        if name == "--elastic.in_place":
            on = (value if eq else (args[i + 1] if i + 1 < len(args) else "")).lower() in ("true", "1", "yes")
    return on


def regroup_spec(inv: Inventory, layout: Layout, epoch: int, port: int, token: str, partition: str,
                 why: str, at_step: int | None = None, timeout_s: float = 60.0) -> Regroup:
    """The regroup.json (contract/regroup.py) that moves the running job into `layout` in place:
    ranks by node in the layout's order (torchrun's: node rank x its processes + local rank), the
    new master's address, a port the runner chose free on it. ValueError (as a rank would refuse
    it) for a layout the file cannot say."""
    ranks, nxt = {}, 0
    for name in layout.nodes:
        n = inv.node(name)
        k = inv.job.nproc_per_node or n.slots
        ranks[name] = list(range(nxt, nxt + k))
        nxt += k
    spec = Regroup(epoch=epoch, token=token, master_addr=inv.node(layout.nodes[0]).rank_addr, master_port=port,
                   world_size=nxt, ranks=ranks, layout=NewLayout(layout.pp, layout.dp, layout.tp, layout.batch_size,
                                                                 partition),
                   at_step=at_step, timeout_s=timeout_s, why=why[:200])
    dumps(spec)  # checked as a rank reads it
    return spec


def event(kind: str, **fields) -> dict:
    """One line of elastic.jsonl: `time` for people, `t` and the other epoch seconds for bench/elastic.py."""
    now = time.time()
    return {"time": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"), "t": now,
            "event": kind, **fields}


def parse_events(text: str) -> list[dict]:
    """The events of an elastic.jsonl as a node sent it: its JSON objects; anything else is passed over
    (a line nested past Python's recursion limit too: RecursionError is not a ValueError)."""
    out = []
    for raw in text.splitlines():
        try:
            e = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(e, dict):
            out.append(e)
    return out


def render_events(events: list[dict]) -> list[str]:
    """`runner status`'s lines for a run's events: one per layout change or loss (the last 200)."""
    out = []
    for e in events[-200:]:
        when, kind = str(e.get("time", "?")), str(e.get("event", "?"))
        if kind == "layout":
            raw = e.get("layout")
            lay = raw if isinstance(raw, dict) else {}  # the job's file: any shape
            listed = lay.get("nodes")
            nodes = listed if isinstance(listed, list) else []
            line = f"layout pp {lay.get('pp')} x dp {lay.get('dp')} x tp {lay.get('tp')} on {', '.join(map(str, nodes))}"
            if e.get("from_step") is not None:
                line += f" from step {e['from_step']}"
            if e.get("steps_lost") is not None:
                line += f" ({e['steps_lost']} step(s) redone)"
            if e.get("split"):
                line += f", split {e['split']}"
        elif kind == "lost":
            line = f"lost {e.get('node')}: {e.get('why')}"
        elif kind == "back":
            line = f"{e.get('node')} reachable again"
        elif kind == "stop":
            line = f"stopped: {e.get('why')}"
        else:
            line = kind
        out.append(f"{when}  {line}"[:400])
    return out
