"""`regroup.json`: how the runner tells the ranks that survive a node loss (or welcome one back) to
leave their process group and meet in a new one, without their processes ending (issue 58).

The runner writes the file into the run dir (OUTPUT_DIR) of every node of the NEW layout, atomically
(a temporary name, then a rename over SFTP), and nowhere else: a node left out never reads where
the others meet. A watcher thread in each rank stats it about every 100 ms
(trainer/runtime/regroup.py); a file whose epoch is above the one the rank runs in makes it cut its
old group's connections, so that the step in flight returns with an error at once, and the rank
then meets the others on `master_addr:master_port`, a TCPStore the new rank 0 hosts, under a key
prefix no member of an older epoch knows (`store_prefix`: the epoch and the runner's random token).

    {"version": 1, "epoch": 2, "token": "9f3c2a1b", "master_addr": "10.0.0.1", "master_port": 29613,
     "world_size": 2, "ranks": {"node-0": [0], "node-1": [1]},
     "layout": {"pp": 2, "dp": 1, "tp": 1, "batch_size": 16, "partition": "uniform_transformer"},
     "at_step": null, "timeout_s": 60, "why": "lost node-2"}

- `ranks`: each node's new global ranks, by local rank (a node's processes keep their local rank);
  together they are 0..world_size-1, each once.
- `layout`: the new parallel degrees (pp x dp x tp = world_size), the batch per dp rank and the
  partition rule the trainer splits the layers with (runner/planning/elastic.py's Layout).
- `at_step`: null when a node is lost (abandon the step in flight now); a step number when a node
  comes back (finish that step, then switch: no step is abandoned).

Each rank answers in `regroup-status.local<L>.json` beside it (L: its local rank): the epoch and how
far it got (seen, left, joined, resumed, failed), with epoch seconds, so the runner knows when the
new layout trains or that it must fall back to restarting the containers. A node coming back
answers `ready` first, for the epoch it was started to join, once its process has imported torch
and waits for the file: the runner writes the file only then, so the running ranks keep training
through the newcomer's start-up and pause only for the switch itself.

Torch-free (both wings read it); every reader here is bounded and checks every field, so a file
someone else wrote is refused in one line (ValueError) rather than acted on.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.bounded_json import loads

REGROUP_FILE = "regroup.json"
# "ready": a node coming back (started to join) has imported torch and waits for its epoch's file
STATUS_STATES = ("ready", "seen", "left", "joined", "resumed", "failed")
# the times a status may carry: each state's, and a newcomer's process start (`started`, before `ready`)
STATUS_TIMES = ("started", *STATUS_STATES)
MAX_BYTES = 64 << 10     # a real file: a few hundred bytes a node
MAX_NODES = 4096
MAX_WORLD = 1 << 16
VERSION = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")      # a node name, as the inventory allows
_ADDR = re.compile(r"[A-Za-z0-9.:_%-]{1,253}")                # a host name or an IPv4/IPv6 address
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


@dataclass(frozen=True)
class NewLayout:
    pp: int
    dp: int
    tp: int
    batch_size: int
    partition: str

    def as_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp, "batch_size": self.batch_size,
                "partition": self.partition}


@dataclass(frozen=True)
class Regroup:
    epoch: int
    token: str
    master_addr: str
    master_port: int
    world_size: int
    ranks: dict[str, list[int]]
    layout: NewLayout
    at_step: int | None = None
    timeout_s: float = 60.0
    why: str = ""
    version: int = field(default=VERSION)

    @property
    def store_prefix(self) -> str:
        """The key prefix of the new group in its store: a process of an older epoch (a node that
        came back from a cut, still running) does not know it, so it can never take a rank here."""
        return f"regroup/{self.epoch}/{self.token}"

    def rank_of(self, node: str, local_rank: int) -> int | None:
        """This process's rank in the new group, None when its node (or this local rank) is left out."""
        mine = self.ranks.get(node)
        return mine[local_rank] if mine is not None and 0 <= local_rank < len(mine) else None

    def nodes_in_rank_order(self) -> list[str]:
        return sorted(self.ranks, key=lambda n: min(self.ranks[n]))

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "epoch": self.epoch, "token": self.token, "master_addr": self.master_addr,
                "master_port": self.master_port, "world_size": self.world_size,
                "ranks": {n: list(r) for n, r in self.ranks.items()}, "layout": self.layout.as_dict(),
                "at_step": self.at_step, "timeout_s": self.timeout_s, "why": self.why}


def dumps(spec: Regroup) -> str:
    """The file's text (checked as a reader would: the runner never writes what a rank refuses)."""
    text = json.dumps(spec.as_dict(), indent=1) + "\n"
    parse(text, "regroup.json")
    return text


def _int(doc: dict[str, Any], key: str, what: str, lo: int, hi: int) -> int:
    v = doc.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{what}: '{key}' is {str(v)[:40]}, not a whole number from {lo} to {hi}")
    return v


def _text(doc: dict[str, Any], key: str, what: str, pattern: re.Pattern[str], default: str | None = None) -> str:
    v = doc.get(key, default)
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise ValueError(f"{what}: '{key}' is {str(v)[:40]!r}, not a valid {key}")
    return v


def _ranks(doc: dict[str, Any], what: str, world: int) -> dict[str, list[int]]:
    raw = doc.get("ranks")
    if not isinstance(raw, dict) or not 1 <= len(raw) <= MAX_NODES:
        raise ValueError(f"{what}: 'ranks' must map 1 to {MAX_NODES} node names to their new ranks")
    out: dict[str, list[int]] = {}
    for node, ranks in raw.items():
        if not _NAME.fullmatch(node):
            raise ValueError(f"{what}: 'ranks' names the node {node[:40]!r}, not a node name")
        if not isinstance(ranks, list) or not ranks or any(type(r) is not int for r in ranks):
            raise ValueError(f"{what}: 'ranks.{node}' must be a non-empty list of whole numbers")
        out[node] = list(ranks)
    every = sorted(r for rs in out.values() for r in rs)
    if every != list(range(world)):
        raise ValueError(f"{what}: 'ranks' must hold each rank 0..{world - 1} once (world_size {world}), "
                         f"got {every[:16]}{' ...' if len(every) > 16 else ''}")
    return out


def _layout(doc: dict[str, Any], what: str, world: int) -> NewLayout:
    raw = doc.get("layout")
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: 'layout' must be an object with pp, dp, tp, batch_size and partition")
    w = f"{what}: layout"
    lay = NewLayout(_int(raw, "pp", w, 1, world), _int(raw, "dp", w, 1, world), _int(raw, "tp", w, 1, world),
                    _int(raw, "batch_size", w, 1, 1 << 30),
                    _text(raw, "partition", w, re.compile(r"[\x21-\x7e]{1,200}")))
    if lay.pp * lay.dp * lay.tp != world:
        raise ValueError(f"{what}: layout pp {lay.pp} x dp {lay.dp} x tp {lay.tp} is not world_size {world}")
    return lay


def parse(data: str | bytes, what: str) -> Regroup:
    """A Regroup from the file's text, every field checked; ValueError, one line naming `what`."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{what}: {len(data)} bytes, over the {MAX_BYTES} a regroup file may be; not read")
    try:
        doc = loads(data, what, max_values=4 * MAX_WORLD)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: not JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what}: not a JSON object")
    version = doc.get("version")
    if version != VERSION:
        raise ValueError(f"{what}: version {str(version)[:20]}; this trainer reads version {VERSION}")
    world = _int(doc, "world_size", what, 1, MAX_WORLD)
    at_step = doc.get("at_step")
    if at_step is not None and (type(at_step) is not int or at_step < 0):
        raise ValueError(f"{what}: 'at_step' is {str(at_step)[:40]!r}, not null or a step number")
    timeout = doc.get("timeout_s", 60.0)
    if type(timeout) not in (int, float) or not math.isfinite(timeout) or not 1 <= timeout <= 3600:
        raise ValueError(f"{what}: 'timeout_s' is {str(timeout)[:40]!r}, not a number of seconds from 1 to 3600")
    why = doc.get("why", "")
    if not isinstance(why, str) or len(why) > 400 or not _PRINTABLE.fullmatch(why):
        raise ValueError(f"{what}: 'why' must be at most 400 printable characters")
    return Regroup(epoch=_int(doc, "epoch", what, 1, 1 << 40), token=_text(doc, "token", what, _TOKEN),
                   master_addr=_text(doc, "master_addr", what, _ADDR),
                   master_port=_int(doc, "master_port", what, 1, 65535), world_size=world,
                   ranks=_ranks(doc, what, world), layout=_layout(doc, what, world), at_step=at_step,
                   timeout_s=float(timeout), why=why)


def read(path: Path) -> Regroup:
    """The regroup file at `path`, read within MAX_BYTES (ValueError naming it; OSError as raised)."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_BYTES + 1)
    return parse(data, str(path))


def status_name(local_rank: int) -> str:
    return f"regroup-status.local{local_rank}.json"


def status_text(epoch: int, state: str, times: dict[str, float], rank: int | None = None,
                step: int | None = None, error: str = "") -> str:
    """One rank's answer for `epoch`: the state it reached, epoch seconds of each state reached, its
    new rank and, once it trains again, the step it resumed from."""
    if state not in STATUS_STATES:
        raise ValueError(f"regroup status: state {state!r} is not one of {', '.join(STATUS_STATES)}")
    return json.dumps({"epoch": epoch, "state": state, "times": times, "rank": rank, "step": step,
                       "error": error[:400]}) + "\n"


def parse_status(data: str | bytes, what: str) -> dict[str, Any]:
    """A rank's status file, bounded and checked (ValueError naming `what`)."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{what}: over {MAX_BYTES} bytes; not read")
    doc = loads(data, what, max_values=1000)
    if not isinstance(doc, dict) or doc.get("state") not in STATUS_STATES or type(doc.get("epoch")) is not int:
        raise ValueError(f"{what}: not a regroup status (epoch, state)")
    times = doc.get("times")
    if not isinstance(times, dict) or any(k not in STATUS_TIMES or type(v) not in (int, float)
                                          for k, v in times.items()):
        raise ValueError(f"{what}: 'times' must map states to epoch seconds")
    return doc
