"""The Perseus server for a job: Zeus's pipeline frequency optimizer (zeus 0.16.0), its app unmodified.

Runs on the master node, in a container of the job's image, in the server's own environment (pydantic<2: `.venv-perseus` on this host, made by
scripts/perseus-env.sh; `/opt/perseus` on PYTHONPATH in the trainer image), never in the runner's
or the trainer's: it imports zeus, and nothing of the project.

    python -m runner.agents.perseus_server --dump-dir DIR --plan plan.py [--scheduler PointSolution]
        [--host 127.0.0.1] [--port 0] [--ready-file FILE] [--log-level INFO]
    python -m runner.agents.perseus_server --check      # imports the server, prints versions, exits

What it adds to `uvicorn zeus.optimizer.pipeline_frequency.server.router:app`:
- the listening socket is bound first and its port written to --ready-file (port 0: a free one),
  so a caller waits on a file rather than polling a port;
- the package `zeus.optimizer.pipeline_frequency` is entered without running its `__init__`,
  which imports Zeus's own client (torch, httpx, NVML) that the server never uses;
- `PlanSequence`, a scheduler of this project registered in Zeus's scheduler module before the
  app is imported: each plan file is served for one round, in order, then every rank's next
  request gets an error saying `[profiling-done]` (what the Perseus artifact's PointSolution did
  with a directory of plans; Zeus 0.16's `PointSolution` repeats one plan for ever);
- logs go to stderr and to <dump dir>/server.log.

- `PointSolution` (and `PointSolution3D`) replaced in that module by schedulers of the same name
  that take the plan as a value: Zeus's own reads the file again when a job registers and
  `eval`s it, so a plan swapped on the master after the server checked it (the job shares the run
  dir) ran its code in the server.

A plan file is a Python literal: one list per rank of (instruction, frequency) pairs in the
rank's instruction order, e.g. `[[("forward", 1410), ("backward", 1410)], [...]]`. It is read
once (`read_plan`): a regular file of at most PLAN_MAX_BYTES, refused from its size before a byte
is read; parsed by `parse_literal`, a strict subset of Python's literal syntax (lists, tuples,
quoted names, numbers, True/False/None, comments) whose memory is that of the value it builds
(`ast.literal_eval` of 4 MiB of `1,1,...` took 2 GB); then `check_plan`: instruction names from
INSTRUCTIONS, integer frequencies in FREQUENCY_MHZ. The runner sends the master `plan_bytes` of
the checked value (a canonical re-serialisation, nothing else of the file), and the server checks
what it reads again before any scheduler sees it. Nothing here evaluates code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import stat
import sys
import types
from pathlib import Path

SCHEDULERS = ("PointSolution", "PointSolution3D", "PlanSequence")
PLAN_MAX_BYTES = 4 << 20
INSTRUCTIONS = ("forward", "backward")  # the trainer's plan kinds (trainer/profiling/perseus_rounds.py)
FREQUENCY_MHZ = (1, 10000)             # a GPU clock; anything else is not a plan
MAX_DEPTH = 3                          # plan > rank > pair
PKG = "zeus.optimizer.pipeline_frequency"
log = logging.getLogger("perseus_server")
Plan = list[list[tuple[str, int]]]

_TOKEN = re.compile(r"""\s+|\#[^\n]*|(?P<open>[\[(])|(?P<close>[\])])|(?P<comma>,)"""
                    r"""|(?P<str>'[A-Za-z0-9_ -]{0,64}'|"[A-Za-z0-9_ -]{0,64}")"""
                    r"""|(?P<num>-?\d{1,12}(?:\.\d{1,12})?)(?![\w.])|(?P<const>True|False|None)(?!\w)""")
_END = ("end", "")
_CONSTS = {"True": True, "False": False, "None": None}


def read_plan_bytes(path: str) -> bytes:
    """A plan file's bytes: a regular file, refused from its size before anything is read (a
    1.5 GB sparse file took 1.6 GB when it was read first), at most PLAN_MAX_BYTES + 1 read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"plan {path}: cannot read it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"plan {path}: not a regular file")
        if st.st_size > PLAN_MAX_BYTES:
            raise ValueError(f"plan {path}: {st.st_size} bytes, over the {PLAN_MAX_BYTES} bytes a plan may hold")
        data = f.read(PLAN_MAX_BYTES + 1)
    if len(data) > PLAN_MAX_BYTES:
        raise ValueError(f"plan {path}: over the {PLAN_MAX_BYTES} bytes a plan may hold")
    return data


class _NotLiteral(Exception):
    """The text stops being a plain literal here."""


def parse_literal(text: str, name: str) -> object:
    """The value of a literal made of lists, tuples, quoted names, numbers, True/False/None and
    comments, in Python's syntax; ValueError `not a Python literal` for anything else. Nothing is
    evaluated, nesting stops at MAX_DEPTH, and memory is what the value itself takes."""
    pos = [0]
    toks = _tokens(text, pos)
    try:
        value, tok = _value(toks, next(toks, _END), 0)
        if tok != _END:
            raise _NotLiteral
    except _NotLiteral:
        line = text.count("\n", 0, pos[0]) + 1
        raise ValueError(f"plan {name}: must be a list with one list of (instruction, frequency) pairs per rank: "
                         f"not a Python literal of lists, tuples, quoted names and numbers (line {line})") from None
    return value


def _tokens(text: str, pos: list[int]):
    """(kind, text) of each token, whitespace and comments skipped; pos[0]: how far reading got."""
    while pos[0] < len(text):
        m = _TOKEN.match(text, pos[0])
        if m is None:
            raise _NotLiteral
        pos[0] = m.end()
        if m.lastgroup:
            yield m.lastgroup, m[0]


def _value(toks, tok: tuple[str, str], depth: int) -> tuple[object, tuple[str, str]]:
    """The value starting at tok, and the token after it."""
    kind, text = tok
    if kind == "str":
        return text[1:-1], next(toks, _END)
    if kind == "num":
        return (float(text) if "." in text else int(text)), next(toks, _END)
    if kind == "const":
        return _CONSTS[text], next(toks, _END)
    if kind != "open" or depth >= MAX_DEPTH:
        raise _NotLiteral
    closing = ("close", "]" if text == "[" else ")")
    items: list[object] = []
    comma = False
    tok = next(toks, _END)
    while tok != closing:
        if items and not comma:
            raise _NotLiteral
        item, tok = _value(toks, tok, depth + 1)
        items.append(item)
        comma = tok[0] == "comma"
        if comma:
            tok = next(toks, _END)
    if text == "[":
        return items, next(toks, _END)
    return (items[0] if len(items) == 1 and not comma else tuple(items)), next(toks, _END)


def check_plan(plan: object, name: str, world_size: int | None = None) -> Plan:
    """plan as a plan: one list per rank of (instruction, frequency) pairs, instructions from
    INSTRUCTIONS, frequencies integers in FREQUENCY_MHZ; ValueError saying what is wrong."""
    lo, hi = FREQUENCY_MHZ
    if not isinstance(plan, (list, tuple)) or not plan:
        raise ValueError(f"plan {name}: must be a list with one list of (instruction, frequency) pairs per rank")
    out = []
    for r, entry in enumerate(plan):
        if not isinstance(entry, (list, tuple)):
            raise ValueError(f"plan {name}: rank {r}'s entry is a {type(entry).__name__}, not a list of pairs")
        pairs = []
        for j, pair in enumerate(entry):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
                    and type(pair[1]) is int and pair[1] > 0):
                raise ValueError(f"plan {name}: rank {r} item {j} is {_short(pair)}, not an (instruction, "
                                 "frequency) pair")
            if pair[0] not in INSTRUCTIONS:
                raise ValueError(f"plan {name}: rank {r} item {j}: unknown instruction {pair[0]!r} (one of "
                                 f"{', '.join(INSTRUCTIONS)})")
            if not lo <= pair[1] <= hi:
                raise ValueError(f"plan {name}: rank {r} item {j}: frequency {pair[1]} not in {lo}..{hi} MHz")
            pairs.append((pair[0], pair[1]))
        out.append(pairs)
    if world_size is not None and len(out) != world_size:
        raise ValueError(f"plan {name} holds {len(out)} ranks' plans but the job has {world_size} ranks")
    return out


def _short(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_plan(data: bytes, name: str, world_size: int | None = None) -> Plan:
    """A plan file's bytes, checked: UTF-8, a plain literal, a plan."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"plan {name}: not UTF-8 (byte {e.start})") from None
    return check_plan(parse_literal(text, name), name, world_size)


def read_plan(path: str, world_size: int | None = None) -> Plan:
    """A plan file's per-rank lists of (instruction, frequency), read once and checked; ValueError
    saying what is wrong."""
    return parse_plan(read_plan_bytes(path), path, world_size)


def plan_bytes(plan: Plan) -> bytes:
    """The canonical form of a checked plan: what the runner writes on the master."""
    return (repr(plan) + "\n").encode()


def _enter_package() -> types.ModuleType:
    """Zeus's scheduler module, with the pipeline_frequency package entered past its __init__."""
    import zeus.optimizer

    if PKG not in sys.modules:
        mod = types.ModuleType(PKG)
        mod.__path__ = [os.path.join(os.path.dirname(zeus.optimizer.__file__), "pipeline_frequency")]
        sys.modules[PKG] = mod
    from zeus.optimizer.pipeline_frequency.server import scheduler

    return scheduler


def register_schedulers() -> types.ModuleType:
    """Zeus's scheduler module (where ZEUS_PFO_SCHEDULER names are looked up) with PlanSequence
    added and PointSolution / PointSolution3D replaced by schedulers that take checked values."""
    scheduler = _enter_package()
    if getattr(scheduler, "PlanSequence", None) is not None:
        return scheduler
    from zeus.optimizer.pipeline_frequency.common import FrequencySchedule

    class PointSolution(scheduler.FrequencyScheduler):
        """Serves one plan every round, as Zeus's PointSolution does, from the value the server
        checked (Zeus's reads its file again when a job registers and `eval`s it)."""

        def __init__(self, job_info, rank_infos, pfo_settings, plan: list, name: str = "plan") -> None:
            super().__init__(job_info, rank_infos, pfo_settings)
            checked = check_plan(plan, name, self.world_size)
            self.schedule = [FrequencySchedule(rank=r, frequencies=f) for r, f in enumerate(checked)]

        def _run(self):
            yield self.schedule

    class PlanSequence(scheduler.FrequencyScheduler):
        """Serves each plan for one round, in order; then ends profiling with [profiling-done]."""

        def __init__(self, job_info, rank_infos, pfo_settings, plans: list, names: list | None = None) -> None:
            super().__init__(job_info, rank_infos, pfo_settings)
            names = names or [f"plan {n + 1}" for n in range(len(plans))]
            self.plans = [check_plan(p, n, self.world_size) for p, n in zip(plans, names, strict=True)]
            if not self.plans:
                raise ValueError("PlanSequence needs at least one plan file")

        def _run(self):
            for n, plan in enumerate(self.plans):
                log.info("PlanSequence: plan %d of %d", n + 1, len(self.plans))
                yield [FrequencySchedule(rank=r, frequencies=f) for r, f in enumerate(plan)]
            # Zeus reports a scheduler's exception to every rank's next schedule request.
            raise RuntimeError(f"[profiling-done] all {len(self.plans)} plans ran")

    scheduler.PointSolution = PointSolution
    scheduler.PointSolution3D = scheduler.make_3d_parallel(PointSolution, "PointSolution3D")
    scheduler.PlanSequence = PlanSequence
    return scheduler


def _settings_env(args: argparse.Namespace, plans: list[Plan]) -> dict[str, str]:
    """Zeus's settings: the schedulers get the checked plans as values (JSON in this process's own
    environment, read once when the app is imported), never a path to read again."""
    if args.scheduler == "PlanSequence":
        sched_args: dict = {"plans": plans, "names": list(args.plan)}
    else:
        if len(args.plan) != 1:
            raise SystemExit(f"perseus_server: {args.scheduler} takes exactly one --plan (got {len(args.plan)})")
        sched_args = {"plan": plans[0], "name": args.plan[0]}
    return {"ZEUS_PFO_SCHEDULER": args.scheduler, "ZEUS_PFO_SCHEDULER_ARGS": json.dumps(sched_args),
            "ZEUS_PFO_DUMP_DIR": str(Path(args.dump_dir).resolve()), "ZEUS_PFO_DUMP_DATA": "true",
            "ZEUS_PFO_LOG_LEVEL": args.log_level}


def _logging(dump_dir: str | None, level: str) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if dump_dir:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(dump_dir) / "server.log"))
    root = logging.getLogger()
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)  # before the router's logging.basicConfig, which then adds nothing
    root.setLevel(level)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"perseus_server: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock


def check() -> int:
    import fastapi
    import pydantic
    import zeus

    register_schedulers()
    # The settings the app reads at import: our scheduler is found by name and its arguments bind.
    os.environ.update({"ZEUS_PFO_SCHEDULER": "PlanSequence", "ZEUS_PFO_SCHEDULER_ARGS": '{"plans": []}',
                       "ZEUS_PFO_DUMP_DATA": "false", "ZEUS_PFO_LOG_LEVEL": "WARNING"})
    from zeus.optimizer.pipeline_frequency.server import router  # noqa: F401 - the app imports

    print(f"zeus {zeus.__version__} pydantic {pydantic.VERSION} fastapi {fastapi.__version__}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.agents.perseus_server", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="import the server and its schedulers, print versions")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one, written to --ready-file)")
    p.add_argument("--dump-dir", help="where Zeus dumps ranks, schedules and results per job (and server.log)")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="PointSolution")
    p.add_argument("--plan", action="append", default=[], help="plan file (PlanSequence: one per round, in order)")
    p.add_argument("--ready-file", help="written with the port once the socket listens")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = p.parse_args(argv)
    if args.check:
        return check()
    if not args.dump_dir or not args.plan:
        p.error("--dump-dir and --plan are required")
    try:  # each plan read once, here: what the schedulers serve is this checked value
        plans = [read_plan(p) for p in args.plan]
    except ValueError as e:
        raise SystemExit(f"perseus_server: {e}") from None
    os.environ.update(_settings_env(args, plans))
    _logging(args.dump_dir, args.log_level)
    sock = _bind(args.host, args.port)
    register_schedulers()
    import uvicorn
    from zeus.optimizer.pipeline_frequency.server.router import app

    port = sock.getsockname()[1]
    log.info("Perseus server (zeus %s, %s over %s) on http://%s:%d, dump %s", sys.modules["zeus"].__version__,
             args.scheduler, ", ".join(args.plan), args.host, port, args.dump_dir)
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp"
        Path(tmp).write_text(f"{port}\n")
        os.replace(tmp, args.ready_file)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level=args.log_level.lower()))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
