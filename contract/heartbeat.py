"""Progress heartbeats: each rank's `OUTPUT_DIR/heartbeat/rank<R>.json`, the one format both wings use.

The trainer (trainer/runtime/heartbeat.py) rewrites its rank's file atomically (a temporary file,
then os.replace) from a thread of its own, every `watch.heartbeat_s` seconds: what the rank is doing
(step, phase, stage, microbatch, peer), when it last made progress and when its writer last ran.
The main thread only records the phase in memory (no file, no collective, no device sync: on CUDA
the phase is the host's view). The runner reads the files of every node (SFTP, Slurm's collect
mirror) and decides who is stuck (contract/hang.py).

Two clocks answer two questions, both on the writing node's clock, so a reader compares them
with each other and with its own clock's passing, never across machines:
- `progress_at` moves whenever the rank changes phase or ends a step: it stops when the rank is
  stuck, also when it is stuck waiting in a collective for another rank;
- `alive_at` moves at every write, stuck or not: it stops only when the whole process stops
  (SIGSTOP, swap thrash, a thread holding the GIL in C): the rank a reader blames first.

A reader trusts nothing in these files (a job wrote them): `parse` reads at most MAX_BYTES and
MAX_VALUES values, and `from_dict` checks every field's type and range; a failure is a ValueError
naming the file and the field. Torch-free; imports only contract.bounded_json.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from contract import bounded_json

DIR = "heartbeat"                       # under OUTPUT_DIR
VERSION = 1
MAX_BYTES = 16 << 10                    # a real file: ~900 bytes
MAX_VALUES = 400
NAME_RE = re.compile(r"rank(\d{1,7})\.json")
PHASE_RE = re.compile(r"[a-z][a-z_]{0,31}")
DETAIL_RE = re.compile(r"[A-Za-z0-9_.,:+-]{0,64}")

# What a rank can be doing. A reader accepts any PHASE_RE word (a newer trainer may add phases);
# these are the ones this trainer writes.
PHASES = (
    "init",         # process start to the process group (rendezvous)
    "build",        # model built, parallelised, weights materialised
    "resume",       # a checkpoint read at start
    "compile",      # torch.compile building graphs (the first step; a recompile)
    "data",         # the next batch
    "forward", "backward",  # compute; non-pipeline DDP/FSDP also wait for their reductions in backward
    "recv", "send",          # a pipeline point-to-point wait (peer: the other rank; detail: fwd/bwd)
    "grad_norm",    # the gradient norm and clipping (an all-reduce on sharded or pipelined layouts)
    "optimizer",    # optimizer step, LR schedule, zero_grad
    "log",          # a log step: the device synchronised, step time and memory gathered
    "collective",   # waiting on other ranks in a collective: the step's end (the preemption vote), a
    #                 pipeline's tied-weight gradient sum and gradient-norm all-reduce
    "eval",         # evaluation batches
    "checkpoint",   # a checkpoint written (or an async one finalised)
    "done", "failed",        # the rank's last word: finished, or ended by an error (error: why)
)
# Phases in which a rank waits for another rank (the time a straggler report calls waiting).
WAITING = frozenset({"recv", "send", "collective"})
# Phases with no step's bound: before the first steps, or a process that has ended.
STARTUP = frozenset({"init", "build", "resume", "compile"})
ENDED = frozenset({"done", "failed"})
# Where in a step each phase falls: the rank furthest behind is the one the others wait for.
ORDER = {"init": 0, "build": 0, "resume": 0, "data": 1, "compile": 2, "forward": 2, "recv": 2, "send": 2,
         "backward": 3, "grad_norm": 4, "optimizer": 5, "log": 6, "eval": 7, "collective": 8, "checkpoint": 9}


def path_of(output_dir: str | Path, rank: int) -> Path:
    return Path(output_dir) / DIR / f"rank{rank}.json"


def stacks_staging(output_dir: str | Path, rank: int) -> Path:
    """Where a live rank's faulthandler writes its stacks on the stacks signal (contract/stacks.py)."""
    return Path(output_dir) / DIR / f"stacks-rank{rank}.txt"


@dataclass
class Heartbeat:
    """One rank's file. Times are seconds since the epoch on the writing node's clock."""

    v: int
    rank: int
    world_size: int
    local_rank: int
    node: str                   # NODE_NAME (the inventory's node), else the host name
    host: str                   # socket.gethostname()
    pid: int                    # the rank's process id in its container's pid namespace
    pid_start: int              # its start time (clock ticks since boot, /proc/<pid>/stat field 22)
    step: int                   # the step in progress, 1-based (0 before the first); the last one once ended
    phase: str
    phase_since: float          # when this phase began
    progress_at: float          # the last progress: a phase change or a step's end
    alive_at: float             # this write
    seq: int                    # writes so far
    stage: int | None = None    # pipeline stage of a forward/backward
    mb: int | None = None       # microbatch of a forward/backward
    peer: int | None = None     # global rank at the other end of a recv/send
    detail: str = ""            # e.g. fwd_recv, bwd_send (torch's schedule's own words)
    first: bool = False         # the first time this phase runs in this process (compile, eval, checkpoint)
    budget_s: float | None = None             # how long this phase may go without progress (contract.hang)
    collective_timeout_s: float | None = None  # what this rank's process groups wait before they give up
    steps_timed: int = 0        # steps whose time went into median_step_s
    step_s: float | None = None             # the last step's time on this rank (host clock)
    wait_s: float | None = None             # ... spent waiting in WAITING phases
    median_step_s: float | None = None      # median step time (log windows, device-synchronised)
    max_step_s: float | None = None         # the longest log window's mean step, the first included
    phase_units: int | None = None          # steps' worth of work this phase may hold (log: steps since the
    #                                         last sync; eval: its batches)
    work: int | None = None                 # what this rank computes: forward + backward FLOPs per token
    ckpt_bytes: int | None = None           # what this rank writes per checkpoint (estimate)
    last_ckpt_s: float | None = None        # how long its previous checkpoint took
    heartbeat_s: float = 1.0                # the writer's interval
    error: str = ""                         # with phase failed: why, one line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    @property
    def waiting(self) -> bool:
        return self.phase in WAITING

    def where(self) -> str:
        """`step 7, recv from rank 2 (fwd_recv)`, `step 3, forward (stage 1, microbatch 2)`."""
        what = self.phase
        if self.peer is not None:
            what += f" {'from' if self.phase == 'recv' else 'to'} rank {self.peer}"
        extra = [f"stage {self.stage}" if self.stage is not None else "",
                 f"microbatch {self.mb}" if self.mb is not None else "", self.detail]
        extra = [e for e in extra if e]
        return f"step {self.step}, {what}" + (f" ({', '.join(extra)})" if extra else "")


_INT = (0, 1 << 62)
_FIELDS = {f.name: f for f in fields(Heartbeat)}
_TEXT = {"node": 255, "host": 255, "error": 300}


def _check(name: str, value: Any) -> Any:
    """One field's value as the dataclass declares it, or a ValueError naming it."""
    tp = str(_FIELDS[name].type)
    optional = "None" in tp
    if value is None:
        if optional:
            return None
        raise ValueError(f"'{name}' is missing")
    if tp.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int) or not _INT[0] <= value < _INT[1]:
            raise ValueError(f"'{name}' is not a count")
        return value
    if tp.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"'{name}' is not a number")
        value = float(value)
        if not 0 <= value < 1e12:  # NaN and infinities fail too
            raise ValueError(f"'{name}' is out of range")
        return value
    if tp == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"'{name}' is not true/false")
        return value
    if not isinstance(value, str):
        raise ValueError(f"'{name}' is not text")
    if name == "phase":
        if not PHASE_RE.fullmatch(value):
            raise ValueError("'phase' is not a phase word")
    elif name == "detail":
        if not DETAIL_RE.fullmatch(value):
            raise ValueError("'detail' holds characters a detail does not")
    elif len(value) > _TEXT[name] or not value.isprintable():
        raise ValueError(f"'{name}' is not one printable line of at most {_TEXT[name]} characters")
    return value


def from_dict(d: Any, what: str = "heartbeat") -> Heartbeat:
    """The validated heartbeat, or a ValueError naming `what` and the field. Unknown keys are left
    out (a newer writer), a missing required one is an error."""
    if not isinstance(d, dict):
        raise ValueError(f"{what}: not a JSON object")
    if d.get("v") != VERSION:
        raise ValueError(f"{what}: version {str(d.get('v'))[:20]!r}, this reader knows {VERSION}")
    kwargs = {}
    try:
        for name in _FIELDS:
            if name in d:
                kwargs[name] = _check(name, d[name])
            elif _FIELDS[name].default is MISSING:  # required
                raise ValueError(f"'{name}' is missing")
        beat = Heartbeat(**kwargs)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    if beat.rank >= max(beat.world_size, 1):
        raise ValueError(f"{what}: rank {beat.rank} is not below its world size {beat.world_size}")
    return beat


def parse(data: bytes, what: str = "heartbeat") -> Heartbeat:
    """A heartbeat from a file's bytes (read by whatever transport), within bounds."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{what}: over {MAX_BYTES} bytes; not a heartbeat")
    return from_dict(bounded_json.loads(data, what, MAX_VALUES), what)


def read(path: str | Path) -> Heartbeat:
    """A heartbeat file on this machine: opened without following a link, a regular file only,
    at most MAX_BYTES read (a reader with more rights than the job, the stacks helper as root,
    reads nothing the job points it at)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    return parse(data, str(path))


def read_dir(output_dir: str | Path, max_files: int = 100_000) -> tuple[dict[int, Heartbeat], list[str]]:
    """Every rank's heartbeat under OUTPUT_DIR/heartbeat: ({rank: beat}, [one line per file refused])."""
    beats: dict[int, Heartbeat] = {}
    errors: list[str] = []
    d = Path(output_dir) / DIR
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return beats, errors
    for name in names[:max_files]:
        m = NAME_RE.fullmatch(name)
        if not m:
            continue
        try:
            beat = read(d / name)
        except (OSError, ValueError) as e:
            errors.append(str(e).splitlines()[0][:300])
            continue
        if beat.rank != int(m[1]):
            errors.append(f"{d / name}: holds rank {beat.rank}")
            continue
        beats[beat.rank] = beat
    return beats, errors
