"""Each node's share of the job's memory, before launch: `runner up --dry-run` prints it next to the
node's memory where that is known, and `runner up` (with or without --dry-run) refuses, before
anything starts, a plan in which a node cannot hold its pipeline stage.

Torch-free. The job's shape comes from its config file, its trainer args and its env, read for the
keys that size a stage (the trainer's defaults and seed-flag spellings for those keys, held equal to
trainer/config/ and trainer/config/flags.py by tests/unit/test_sizing.py); the model from its preset
(contract/presets.py) or, with model.path, from the config.json that job.sync sends there. The
arithmetic is contract/model_size.py + contract/memory.py, the same `trainer --dry-run` prints.

A node's need: for each rank on it, the trainer process before any model (torch and libraries; what
`runner profile` measured on the node, else RUNTIME_BYTES) plus the larger of its stage's estimate
(weights, gradients, AdamW state, the activations of the microbatches in flight, the loss's
scratch) and the whole fp32 model, which every rank of an unsharded layout builds before cutting
its stage, and in a sharded one (tp > 1, or ZeRO-2/3 over dp > 1) each stage's first rank
(rank % (dp x tp) == 0), which sends the others their shards (trainer/parallel/compose.py's
`copies_built_here`). A node's memory: the inventory's `memory:` (the job container's Docker limit), and what
`runner profile` measured inside the job's container (cached under ~/.cache/runner/profiles), the
smaller of the two. A GPU node's stage lives in GPU memory: only a profile's CUDA figure is compared.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from contract.memory import (
    DTYPE_BYTES,
    MemoryEstimate,
    auto_loss_chunks,
    gib,
    in_flight,
    sizing_dtype,
    stage_memory,
)
from contract.model_size import MODEL_TYPES, ModelShape, NotSized, model_shape, stage_loads, with_overrides
from contract.partition import parameter_bounds, uniform_bounds, uniform_items_bounds
from contract.presets import PRESETS
from contract.schedules import SCHEDULES, canonical, stage_to_rank
from runner.core.errors import UserError
from runner.inventory import Inventory, Job, Node, memory_bytes

# The keys that size a stage, as the trainer reads them, range-checked: runner/planning/job_settings.py
# (DEFAULTS, FLAGS, SWITCHES, ENV, YAML re-exported: tests/unit/test_sizing.py holds them to the trainer's).
from runner.planning.job_settings import (  # noqa: F401
    DEFAULTS,
    ENV,
    FLAGS,
    INTS,
    MODEL_SIZE_FIELDS,
    RANGES,
    SIZE_MAX,
    SWITCHES,
    YAML,
    job_settings,
    shown,
)

# The trainer process before any model: measured here as 336 MiB of RSS after importing the trainer
# (torch 2.13 CPU, transformers 5.24, amd64), rounded up for the tokenizer and the data. Used where
# `runner profile` has not measured the node.
RUNTIME_BYTES = 400 << 20
CONFIG_JSON_MAX = 1 << 20  # a model's config.json is a few KiB

MAX_SIZED_STAGES = 1 << 14   # pipeline stages (pp x virtual stages) this arithmetic sizes
MAX_SIZED_TOKENS = 1 << 22   # tokens of one microbatch it sizes (the loss's chunk search is linear in them)


# ------------------------------------------------------------------ the model


def _local_model_dir(path: str, job: Job) -> tuple[Path, Path]:
    """(the config.json on this host that job.sync sends under the container path `path`, the
    sync source it is in)."""
    for spec in job.sync:
        dst = spec.dst.rstrip("/")
        if path == dst or path.startswith(dst + "/"):
            local = Path(spec.src).expanduser() / path[len(dst):].lstrip("/")
            if (local / "snapshots").is_dir() and not (local / "config.json").is_file():
                ref = local / "refs" / "main"
                snaps = sorted(p for p in (local / "snapshots").iterdir() if p.is_dir())
                if ref.is_file():
                    with open(ref, "rb") as f:  # a revision name: 4 KiB is plenty
                        local = local / "snapshots" / f.read(4096).decode().strip()
                elif len(snaps) == 1:
                    local = snaps[0]
            return local / "config.json", Path(spec.src).expanduser()
    raise NotSized(f"model.path {path} is not under a job.sync destination (it is on the nodes): "
                   f"`trainer --dry-run` in the image sizes it")


def model_of(s: dict[str, Any], job: Job) -> tuple[str, ModelShape]:
    """(the model's name, its shape) as the trainer will build it (vocabulary: model.vocab_size, else
    the weights' or the preset's, as `trainer --dry-run` reads it)."""
    model = {k: s[f"model.{k}"] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                          "intermediate_size", "vocab_size")}
    if s["model.path"]:
        name = str(s["model.path"])
        try:  # a name too long, a link loop, a refs/main that is not text: not sized, never a traceback
            config, root = _local_model_dir(name, job)
            out = not config.resolve().is_relative_to(root.resolve())  # as job.sync sends it: no link out
        except (OSError, RuntimeError, UnicodeDecodeError) as e:
            raise NotSized(f"model.path {name[:200]}: {type(e).__name__} reading it on this machine") from None
        if out:
            raise NotSized(f"model.path {name}: {config} links out of the job.sync source {root}")
        try:
            fields = json.loads(config.read_text()) if config.stat().st_size <= CONFIG_JSON_MAX else None
        except (OSError, ValueError) as e:
            raise NotSized(f"model.path {name}: {config} unreadable ({type(e).__name__})") from None
        if fields is None:
            raise NotSized(f"model.path {name}: {config} is over {CONFIG_JSON_MAX >> 10} KiB, not a model's config")
        if not isinstance(fields, dict):
            raise NotSized(f"model.path {name}: {config} is not a JSON object")
        bad = next((k for k in MODEL_SIZE_FIELDS if k in fields and fields[k] is not None
                    and (type(fields[k]) is not int or not 1 <= fields[k] <= SIZE_MAX)), None)
        if bad is not None:
            raise NotSized(f"model.path {name}: {config}: {bad} {shown(fields[bad])} is not an integer in 1..{SIZE_MAX}")
        family = MODEL_TYPES.get(str(fields.get("model_type")))
        if family is None:
            raise NotSized(f"model.path {name}: model_type {fields.get('model_type')!r} is sized by `trainer --dry-run`")
        preset = False
    else:
        name = str(s["model.preset"])
        if name not in PRESETS:
            raise NotSized(f"model.preset {name!r} is unknown (the trainer will say so at start)")
        family, fields, preset = PRESETS[name].family, PRESETS[name].config, True
    fields = with_overrides(family, fields, model, s["model.hf_overrides"] or {}, preset=preset)
    try:
        return name, model_shape(family, fields, eager_attention=s["model.attn_implementation"] == "eager")
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        if isinstance(e, NotSized):
            raise
        raise NotSized(f"{name}: its config lacks a field this arithmetic needs ({e})") from None


def stage_bounds(method: str, layers: int, stages: int, shape: ModelShape | None = None) -> list[int]:
    """Block boundaries of `parallel.partition` where the runner computes them as the trainer does
    (contract/partition.py): uniform_transformer; Merak's uniform (embeddings, each block and the
    head one item each) and parameters (the same items weighted by their parameters, from shape);
    custom in blocks or in Merak's items, embeddings + blocks + head."""
    m = method.strip()
    if m == "uniform_transformer":
        return uniform_bounds(layers, stages)
    if m in ("uniform", "parameters") and layers + 2 < stages:
        raise NotSized(f"parallel.partition {m}: {layers} layers cannot fill {stages} stages (the trainer will say so)")
    if m == "uniform":
        return uniform_items_bounds(layers, stages)
    if m == "parameters" and shape is not None:
        # A tied head is a second copy on the last stage: counted, as the trainer's layout does.
        return parameter_bounds([shape.block_params] * layers, shape.embed_params,
                                shape.norm_params + shape.head_params, stages)
    if m.startswith("custom:"):
        try:
            b = [int(x) for x in m[len("custom:"):].split(",") if x.strip()]
        except ValueError:
            b = []
        if len(b) == stages + 1 and b[0] == 0 and b[-1] == layers + 2:
            b = [0, *(min(max(x - 1, 0), layers) for x in b[1:-1]), layers]  # item i >= 1 is block i - 1
        if len(b) == stages + 1 and b[0] == 0 and b[-1] == layers and all(x < y for x, y in zip(b, b[1:], strict=False)):
            return b
        raise NotSized(f"parallel.partition {m}: not a split of {layers} layers into {stages} stages "
                       f"(the trainer will say why at start)")
    if m == "auto":
        raise NotSized("parallel.partition auto: the split is chosen at launch from `runner profile`, within "
                       "each node's measured memory")
    raise NotSized(f"parallel.partition {m}: its split is computed by the trainer (`trainer --dry-run` shows it)")


# ------------------------------------------------------------------ per node


@dataclass
class NodeSize:
    node: str
    stages: list[int]                    # the pipeline rank of each rank on the node (its stage when one a rank)
    estimate: list[MemoryEstimate]       # per rank
    runtime: int                         # per rank
    builds: list[int]                    # per rank: the whole fp32 model it builds first (0: built on meta)
    have: int | None = None
    have_from: str = ""
    gpu: bool = False

    @property
    def need(self) -> int:
        return sum(self.runtime + max(e.total, b) for e, b in zip(self.estimate, self.builds, strict=True))

    @property
    def fits(self) -> bool | None:
        return None if self.have is None else self.need <= self.have


@dataclass
class Sizing:
    model: str
    shape: ModelShape
    bounds: list[int]
    dtypes: dict[str, str]               # node -> compute dtype
    line: str                            # the layout, as printed
    rank_stages: dict[int, list[int]] = field(default_factory=dict)  # pp rank -> its stages (virtual stages only)
    nodes: list[NodeSize] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        out = [self.line]
        for n in self.nodes:
            stage = n.stages[0] if len(set(n.stages)) == 1 else None
            what = self.describe_rank(stage) if stage is not None else \
                "pp ranks " + ", ".join(map(str, n.stages)) if self.rank_stages else \
                "stages " + ", ".join(map(str, n.stages))
            e = n.estimate[0]
            ranks, rp = (f"{len(n.estimate)} ranks x (", ")") if len(n.estimate) > 1 else ("", "")
            have = f"has {gib(n.have)} ({n.have_from})" if n.have is not None else \
                f"memory not known ({n.have_from})"
            verdict = "" if n.fits is None else (": fits" if n.fits else ": DOES NOT FIT")
            out.append(f"  {n.node}: {what}: needs {gib(n.need)} = {ranks}runtime {gib(n.runtime)} + "
                       f"weights {gib(e.weights)} + gradients {gib(e.gradients)} + optimizer {gib(e.optimizer)} + "
                       f"activations {gib(e.activations)} {self.dtypes[n.node]} ({e.in_flight} in flight) + "
                       f"transient {gib(e.transient)}{rp}{self._build_note(n)}; {have}{verdict}")
        out += [f"  note: {x}" for x in self.notes]
        return "\n".join(out)

    def describe_rank(self, rank: int) -> str:
        """`stage 1 (layers 3-4)`; with virtual stages, the rank's: `stages 1, 4 (layers 1-1; layers 4-4)`."""
        if not self.rank_stages:
            return f"stage {rank} ({self.describe(rank)})"
        mine = self.rank_stages[rank]
        return f"pp rank {rank}'s stages {', '.join(map(str, mine))} ({'; '.join(self.describe(st) for st in mine)})"

    def describe(self, stage: int) -> str:
        a, b = self.bounds[stage], self.bounds[stage + 1]
        parts = (["embeddings"] if stage == 0 else []) + ([f"layers {a}-{b - 1}"] if b > a else []) + \
            (["head"] if stage == len(self.bounds) - 2 else [])
        return " + ".join(parts)

    @staticmethod
    def _build_note(n: NodeSize) -> str:
        over = [b for e, b in zip(n.estimate, n.builds, strict=True) if b > e.total]
        if not over:
            return ""
        who = "" if len(n.estimate) == 1 else f" on {len(over)} of its ranks" if len(over) < len(n.estimate) else \
            " on each rank"
        return f", at least the whole model built first{who}, {gib(over[0])}"

    def misfit(self) -> NodeSize | None:
        return next((n for n in self.nodes if n.fits is False), None)


def cached_profiles(nodes: list[Node]) -> dict[str, dict]:
    """The newest `runner profile` measurement of each node (same name and address) in the cache.
    One listing of the cache for all nodes: a dry run of 10,000 nodes stays a dry run."""
    from runner.planning.profile_cache import cache_dir

    hosts = {n.name: n.host for n in nodes}
    newest: dict[str, tuple[float, dict]] = {}
    try:
        files = list(cache_dir().glob("node-*.json"))
    except OSError:
        return {}
    for p in files:
        name = next((n for n in _candidates(p.name) if n in hosts), None)
        if name is None:
            continue
        try:
            doc, mtime = json.loads(p.read_text()), p.stat().st_mtime
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("host") == hosts[name] and isinstance(doc.get("memory_available"), int) \
                and (name not in newest or mtime > newest[name][0]):
            newest[name] = (mtime, doc)
    return {n: d for n, (_, d) in newest.items()}


def _candidates(filename: str) -> list[str]:
    """Node names a cache file `node-<name>-<key>.json` may belong to (a name may hold '-')."""
    stem = filename[len("node-"):-len(".json")]
    return [stem[:i] for i, ch in enumerate(stem) if ch == "-"]


def known_memory(node: Node, gpu: bool, prof: dict | None, probed: int | None = None,
            label: str = "inventory memory") -> tuple[int | None, str]:
    """The least of what is known of the node's memory: `memory:` (Slurm: slurm.mem), the profile's
    measure, and (`runner up`, once connected) the node's MemAvailable."""
    known: list[tuple[int, str]] = []
    if node.memory and not gpu:
        known.append((memory_bytes(node.memory) or 0, f"{label}: {node.memory}"))
    if probed is not None and not gpu:
        known.append((probed, "probed: the node's MemAvailable"))
    if prof is not None:
        cuda = str(prof.get("memory_source", "")).startswith("CUDA")
        if cuda == gpu:
            known.append((int(prof["memory_available"]), f"runner profile: {prof.get('memory_source', 'measured')}"))
    if not known:
        return None, ("GPU memory: run `runner profile`" if gpu else
                      "set the node's `memory:` or run `runner profile`")
    return min(known)


def size_job(inv: Inventory, probed: dict[str, int] | None = None, memory_field: str = "inventory memory") -> Sizing:
    """The per-node sizing of the inventory's job; NotSized, saying why, for a job this arithmetic
    does not cover. probed: {node: MemAvailable bytes} of nodes asked at launch; memory_field: how
    the nodes' `memory` is named in the lines (slurm.mem for a Slurm job)."""
    s = job_settings(inv.job)
    name, shape = model_of(s, inv.job)
    pp, tp, vs = int(s["parallel.pp"]), int(s["parallel.tp"]), int(s["parallel.virtual_stages"])
    order = inv.ordered()
    nproc = [inv.job.nproc_per_node or n.slots for n in order]
    world = sum(nproc)
    if world % (pp * tp):
        raise NotSized(f"{world} processes do not divide into pp {pp} x tp {tp} (the trainer will say so)")
    dp = int(s["parallel.dp"] or world // (pp * tp))
    micro_num = int(s["train.microbatch_num"] or (4 if pp > 1 else 1))
    batch, seq = int(s["train.batch_size"]), int(s["data.seq_len"])
    micro, n_micro = max(batch // micro_num, 1), micro_num * int(s["train.grad_acc_steps"])
    num_stages = pp * vs if pp > 1 else 1
    if str(s["train.dtype"]) not in ("auto", *DTYPE_BYTES):
        raise NotSized(f"train.dtype {shown(s['train.dtype'])} is none of auto, {', '.join(DTYPE_BYTES)} (the trainer "
                       "will say so)")
    if num_stages > MAX_SIZED_STAGES or micro * seq > MAX_SIZED_TOKENS:
        raise NotSized(f"{num_stages} pipeline stages of {micro} x {seq}-token microbatches: over what this "
                       f"arithmetic sizes ({MAX_SIZED_STAGES} stages, {MAX_SIZED_TOKENS} tokens); `trainer --dry-run` "
                       "sizes it")
    bounds = stage_bounds(str(s["parallel.partition"]), shape.layers, num_stages, shape) if pp > 1 else [0, shape.layers]
    chunks = s["train.loss_chunks"]
    chunks = auto_loss_chunks(micro * seq, shape.vocab) if chunks == "auto" else int(chunks)
    sharding = str(s["parallel.sharding"])
    schedule = canonical(str(s["parallel.pp_schedule"])) if pp > 1 else "none"
    sharded = tp > 1 or (sharding.startswith(("zero2", "zero3")) and dp > 1)
    whole = 4 * shape.params  # the fp32 model a building rank holds before cutting or sharding it
    notes = []
    if s["train.activation_checkpointing"] != "none":
        notes.append(f"train.activation_checkpointing {s['train.activation_checkpointing']}: activations "
                     f"sized without it (an upper bound)")
    sizing = Sizing(name, shape, bounds, {}, "", notes=notes)
    if num_stages > pp:  # virtual stages: each pipeline rank holds several, placed as the schedule places them
        spec = SCHEDULES.get(schedule)
        style = spec.style if spec else "loop"
        for st in range(num_stages):
            sizing.rank_stages.setdefault(stage_to_rank(st, pp, num_stages, style), []).append(st)
    per_rank = world // pp
    profiles = cached_profiles(order)
    rank = 0
    memo: dict[tuple[str, int], MemoryEstimate] = {}  # (dtype, pipeline rank): one estimate however many ranks

    def estimate(dtype: str, r: int, loads) -> MemoryEstimate:
        if (dtype, r) not in memo:
            memo[dtype, r] = combined([stage_memory(loads[st], in_flight=in_flight(schedule, st, num_stages, n_micro),
                                                    dtype=dtype, sharding=sharding, dp=dp, tp=tp)
                                       for st in sizing.rank_stages.get(r, [r])])
        return memo[dtype, r]

    loads_of: dict[str, list] = {}
    for node, k in zip(order, nproc, strict=True):
        gpu = bool(node.gpus) and s["parallel.device"] != "cpu"
        dtype = sizing_dtype(str(s["train.dtype"]), gpu=gpu)
        if dtype not in loads_of:
            loads_of[dtype] = stage_loads(shape, bounds, micro=micro, seq=seq, dtype=dtype, chunks=chunks)
        stages = [(rank + j) // per_rank for j in range(k)]  # each rank's pipeline rank
        builds = [whole if not sharded or (rank + j) % (dp * tp) == 0 else 0 for j in range(k)]
        rank += k
        est = [estimate(dtype, r, loads_of[dtype]) for r in stages]
        prof = profiles.get(node.name)
        have, src = known_memory(node, gpu, prof, (probed or {}).get(node.name), memory_field)
        runtime = 0 if gpu else int(prof["runtime_bytes"]) if prof and prof.get("runtime_bytes") else RUNTIME_BYTES
        sizing.dtypes[node.name] = dtype
        sizing.nodes.append(NodeSize(node.name, stages, est, runtime, builds, have, src, gpu))
    split = f", partition {s['parallel.partition']} (layers {','.join(map(str, bounds))})" if pp > 1 else ""
    sizing.line = (f"sizing: {name} ({shape.family}), {shape.params / 1e6:.2f}M parameters; world {world} = "
                   f"pp {pp} x dp {dp} x tp {tp}, {sharding}{split}; {n_micro} microbatches of {micro} x {seq} "
                   f"tokens{', schedule ' + schedule if pp > 1 else ''}; AdamW (contract/model_size.py, the "
                   f"arithmetic of `trainer --dry-run`)")
    return sizing


def combined(parts: list[MemoryEstimate]) -> MemoryEstimate:
    """One rank's estimate for all its stages (virtual stages): their sums, as `trainer --dry-run`
    totals a rank's."""
    if len(parts) == 1:
        return parts[0]
    return MemoryEstimate(*(sum(getattr(p, f) for p in parts) for f in
                            ("weights", "gradients", "optimizer", "activations", "transient", "in_flight")))


def refusal(sizing: Sizing, path: str) -> str | None:
    """The one line that refuses the launch, or None."""
    n = sizing.misfit()
    if n is None:
        return None
    stage = max(set(n.stages), key=lambda st: n.stages.count(st))
    what = f"pipeline stage {stage} ({sizing.describe(stage)})" if not sizing.rank_stages else sizing.describe_rank(stage)
    split = "`parallel.partition: auto` (stages sized to each node's measured memory)" if not sizing.rank_stages \
        else "a split that gives it fewer layers (`parallel.partition: custom:...`)"
    return (f"{path}: node {n.node} cannot hold {what}: it needs "
            f"{gib(n.need)} and has {gib(n.have or 0)} ({n.have_from}); use {split} "
            f"or a smaller microbatch (--batch_size / --microbatch_num), "
            f"or give the node more memory (--ignore-sizing launches anyway)")


def check_sizing(inv: Inventory, *, show: bool, ignore: bool, probed: dict[str, int] | None = None,
                 memory_field: str = "inventory memory") -> None:
    """Print the sizing (`show`) and refuse a plan whose stage cannot fit unless `ignore`. A
    job.command is not the trainer: nothing to size, nothing printed. probed: the nodes'
    MemAvailable, once `up` has asked them (before anything is pushed or started)."""
    if inv.job.command:
        return
    try:
        sizing = size_job(inv, probed, memory_field)
    except NotSized as e:
        if show:
            print(f"sizing: not estimated here: {e}", flush=True)
        return
    if show:
        print(sizing.render(), flush=True)
    line = refusal(sizing, str(inv.path))
    if line and not ignore:
        raise UserError(line)


SLURM_MEM_UNITS = {"": "m", "K": "k", "M": "m", "G": "g"}  # sbatch --mem: megabytes without a unit


def slurm_nodes(slurm, job: Job, path: str) -> Inventory:
    """A Slurm job's allocation as inventory nodes to size: slurm.nodes alike, each with the job's
    processes per node and slurm.mem as its memory (T in gigabytes)."""
    mem = None
    if slurm.mem:
        m = re.fullmatch(r"(\d+)([KMGT]?)", slurm.mem)
        if m:
            n, unit = int(m[1]), m[2]
            mem = f"{n * 1024}g" if unit == "T" else f"{n}{SLURM_MEM_UNITS[unit]}"
    nproc = job.nproc_per_node or slurm.gpus_per_node or 1
    nodes = [Node(name=f"node-{i}", host="slurm", arch=slurm.arch, slots=nproc, gpus=slurm.gpus_per_node or None,
                  memory=mem, role="master" if i == 0 else "worker") for i in range(slurm.nodes)]
    return Inventory(path=path, nodes=nodes, job=replace(job, nproc_per_node=nproc))
