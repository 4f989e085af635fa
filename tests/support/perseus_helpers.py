"""The real Perseus server (Zeus 0.16's pipeline frequency optimizer) on loopback, for tests: run
from its own virtualenv (.venv-perseus, made by scripts/perseus-env.sh) through
runner/agents/perseus_server.py, on a free port it reports in a ready file."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import REPO
from tests.conftest import require
from tests.support.runner_helpers import wait_for

PERSEUS_PYTHON = REPO / ".venv-perseus" / "bin" / "python"


def write_plan(path: Path, plan: list[list[tuple[str, int]]]) -> Path:
    path.write_text(repr(plan) + "\n")
    return path


@dataclass
class Server:
    url: str
    dump: Path
    proc: subprocess.Popen
    log: Path

    def job_dir(self) -> Path:
        """The one job's dump dir (Zeus names it after the job id)."""
        jobs = [p for p in self.dump.iterdir() if p.is_dir()]
        assert len(jobs) == 1, f"expected one job in {self.dump}, found {[p.name for p in jobs]}"
        return jobs[0]

    def results(self) -> list[list[dict]]:
        """Zeus's dump: per round, every rank's ProfilingResult (rank order)."""
        d = self.job_dir()
        n = len(list(d.glob("*.prof.json")))
        return [json.loads((d / f"{i}.prof.json").read_text()) for i in range(n)]

    def schedules(self) -> list[list[dict]]:
        d = self.job_dir()
        n = len(list(d.glob("*.sched.json")))
        return [json.loads((d / f"{i}.sched.json").read_text()) for i in range(n)]


@contextlib.contextmanager
def perseus_server(tmp: Path, plans: list[Path], scheduler: str = "PointSolution") -> Iterator[Server]:
    require("the Perseus server's virtualenv", PERSEUS_PYTHON.exists(),
            f"{PERSEUS_PYTHON} missing (scripts/perseus-env.sh)")
    dump, ready, log = tmp / "perseus-dump", tmp / "perseus.ready", tmp / "perseus-server.log"
    cmd = [str(PERSEUS_PYTHON), "-m", "runner.agents.perseus_server", "--dump-dir", str(dump), "--ready-file", str(ready),
           "--scheduler", scheduler, *[a for p in plans for a in ("--plan", str(p))]]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, f"Perseus server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        yield Server(f"http://127.0.0.1:{int(ready.read_text())}", dump, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
