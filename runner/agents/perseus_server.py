"""The Perseus server for a job: Zeus's pipeline frequency optimizer (zeus 0.16.0), unmodified.

Runs in the server's own environment (pydantic<2: `.venv-perseus` on this host, made by
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

A plan file is a Python literal: one list per rank of (instruction, frequency) pairs in the
rank's instruction order, e.g. `[[("forward", 1410), ("backward", 1410)], [...]]`. PlanSequence
reads it with ast.literal_eval; Zeus's PointSolution `eval`s it (the runner checks every plan
file with literal_eval before it reaches a node).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import socket
import sys
import types
from pathlib import Path

SCHEDULERS = ("PointSolution", "PointSolution3D", "PlanSequence")
PLAN_MAX_BYTES = 4 << 20
PKG = "zeus.optimizer.pipeline_frequency"
log = logging.getLogger("perseus_server")


def read_plan(path: str, world_size: int | None = None) -> list[list[tuple[str, int]]]:
    """A plan file's per-rank lists of (instruction, frequency); ValueError saying what is wrong."""
    p = Path(path)
    data = p.read_bytes()[:PLAN_MAX_BYTES + 1]
    if len(data) > PLAN_MAX_BYTES:
        raise ValueError(f"plan {path}: larger than {PLAN_MAX_BYTES} bytes")
    try:
        plan = ast.literal_eval(data.decode())
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as e:
        raise ValueError(f"plan {path}: not a Python literal ({type(e).__name__}: {e})") from None
    if not isinstance(plan, (list, tuple)) or not plan:
        raise ValueError(f"plan {path}: must be a list with one list of (instruction, frequency) pairs per rank")
    out = []
    for r, entry in enumerate(plan):
        if not isinstance(entry, (list, tuple)):
            raise ValueError(f"plan {path}: rank {r}'s entry is a {type(entry).__name__}, not a list of pairs")
        pairs = []
        for j, pair in enumerate(entry):
            ok = (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
                  and isinstance(pair[1], int) and not isinstance(pair[1], bool) and pair[1] > 0)
            if not ok:
                raise ValueError(f"plan {path}: rank {r} item {j} is {pair!r}, not an (instruction, frequency) pair")
            pairs.append((pair[0], pair[1]))
        out.append(pairs)
    if world_size is not None and len(out) != world_size:
        raise ValueError(f"plan {path} holds {len(out)} ranks' plans but the job has {world_size} ranks")
    return out


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
    """Add PlanSequence to Zeus's scheduler module (where ZEUS_PFO_SCHEDULER names are looked up)."""
    scheduler = _enter_package()
    if hasattr(scheduler, "PlanSequence"):
        return scheduler
    from zeus.optimizer.pipeline_frequency.common import FrequencySchedule

    class PlanSequence(scheduler.FrequencyScheduler):
        """Serves each plan file for one round, in order; then ends profiling with [profiling-done]."""

        def __init__(self, job_info, rank_infos, pfo_settings, plan_paths: list[str]) -> None:
            super().__init__(job_info, rank_infos, pfo_settings)
            self.plans = [read_plan(p, self.world_size) for p in plan_paths]
            if not self.plans:
                raise ValueError("PlanSequence needs at least one plan file")

        def _run(self):
            for n, plan in enumerate(self.plans):
                log.info("PlanSequence: plan %d of %d", n + 1, len(self.plans))
                yield [FrequencySchedule(rank=r, frequencies=f) for r, f in enumerate(plan)]
            # Zeus reports a scheduler's exception to every rank's next schedule request.
            raise RuntimeError(f"[profiling-done] all {len(self.plans)} plans ran")

    scheduler.PlanSequence = PlanSequence
    return scheduler


def _settings_env(args: argparse.Namespace) -> dict[str, str]:
    if args.scheduler == "PlanSequence":
        sched_args = {"plan_paths": [str(Path(p).resolve()) for p in args.plan]}
    else:
        if len(args.plan) != 1:
            raise SystemExit(f"perseus_server: {args.scheduler} takes exactly one --plan (got {len(args.plan)})")
        sched_args = {"solution_path": str(Path(args.plan[0]).resolve())}
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
    os.environ.update({"ZEUS_PFO_SCHEDULER": "PlanSequence", "ZEUS_PFO_SCHEDULER_ARGS": '{"plan_paths": []}',
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
    for plan in args.plan:
        read_plan(plan)  # a plan that cannot be read fails here, not at the first job's registration
    os.environ.update(_settings_env(args))
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
