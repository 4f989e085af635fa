"""What Slurm and the run dirs say: the cluster's partitions, a job's state, a run's record.

A Slurm run's state lives in two places any shell with the inventory can read: the scheduler
(`scontrol show job`, while it remembers the job) and the run dir on the shared filesystem
(`slurm/run.json`: the submissions and their job ids; `slurm/<job>/exit-code`, written by the
batch script when torchrun is done). No state on the machine that submitted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from runner.backends.results import CheckReport
from runner.backends.slurm.plan import resolve
from runner.backends.slurm.shell import Shell
from runner.core.errors import UserError
from runner.core.runs import resolve as pick_run
from runner.inventory.slurm import SlurmInventory

TOOLS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo")
# Job states in which tasks may still run (COMPLETING: tasks are done, nodes are cleaning up).
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")


@dataclass
class Partition:
    name: str
    nodes: int
    default: bool
    state: str


def missing_tools(sh: Shell) -> list[str]:
    """Slurm's client tools not found where its commands run."""
    res = sh.run(["sh", "-c", "for t in " + " ".join(TOOLS) + "; do command -v \"$t\" >/dev/null || echo \"$t\"; done"])
    return res.out.split() if res.rc == 0 else list(TOOLS)


def preflight(sh: Shell, inv: SlurmInventory) -> Partition:
    """Slurm's client tools answer, and the partition exists with enough nodes; else one line."""
    missing = missing_tools(sh)
    if missing:
        raise UserError(f"{_tools_error(sh, inv, missing)}; nothing submitted")
    return pick_partition(partitions(sh), inv)


def _tools_error(sh: Shell, inv: SlurmInventory, missing: list[str]) -> str:
    hint = "set slurm.login to a login node" if inv.slurm.login is None else "is it a Slurm login node?"
    where = inv.where("login") if inv.slurm.login else f"{inv.path}: slurm"
    return f"{where}: {', '.join(missing)} not found on {sh.where} ({hint})"


def pick_partition(parts: dict[str, Partition], inv: SlurmInventory) -> Partition:
    """The inventory's partition (or the cluster's default) with room for slurm.nodes; else one line."""
    want = inv.slurm.partition
    if want is None:
        part = next((p for p in parts.values() if p.default), None)
        if part is None:
            raise UserError(f"{inv.where('partition')}: the cluster has no default partition; name one "
                            f"({', '.join(parts)}); nothing submitted")
    elif want not in parts:
        raise UserError(f"{inv.where('partition')}: {want!r} is not a partition of this cluster "
                        f"(partitions: {', '.join(parts) or 'none'}); nothing submitted")
    else:
        part = parts[want]
    if inv.slurm.nodes > part.nodes:
        raise UserError(f"{inv.where('nodes')}: {inv.slurm.nodes} nodes, but partition {part.name} has "
                        f"{part.nodes}; nothing submitted")
    return part


@dataclass
class SlurmCheck:
    """What `runner check` found of a Slurm inventory: where its commands run (`login`: ok, or
    FAIL when the login node cannot be reached; - for this machine), the client tools missing
    there, the partition."""

    where: str
    login: str = "-"
    tools_missing: list[str] = field(default_factory=list)
    partition: str | None = None
    partition_nodes: int | None = None
    partition_state: str | None = None
    nodes_wanted: int = 0
    problems: list[str] = field(default_factory=list)


def check(backend) -> CheckReport:
    """The login node (or this machine), Slurm's client tools there, and the partition: what `up`
    checks before it submits, each problem one line (the report's, not raised)."""
    inv = backend.inventory
    c = SlurmCheck(where=f"login node {inv.slurm.login.host}" if inv.slurm.login else "this machine",
                   nodes_wanted=inv.slurm.nodes)
    try:
        sh = backend.shell()
    except UserError as exc:
        c.login = "FAIL"
        c.problems.append(str(exc))
        return CheckReport("slurm", backend.path, [c], list(c.problems))
    try:
        c.login = "ok" if inv.slurm.login else "-"
        c.tools_missing = missing_tools(sh)
        if c.tools_missing:
            c.problems.append(_tools_error(sh, inv, c.tools_missing))
        else:
            try:
                part = pick_partition(partitions(sh), inv)
                c.partition, c.partition_nodes, c.partition_state = part.name, part.nodes, part.state
                if part.state != "UP":
                    c.problems.append(f"{inv.where('partition')}: partition {part.name} is {part.state}, not UP")
            except UserError as exc:
                c.problems.append(str(exc).removesuffix("; nothing submitted"))
    finally:
        sh.close()
    return CheckReport("slurm", backend.path, [c], list(c.problems))


def partitions(sh: Shell) -> dict[str, Partition]:
    res = sh.run(["scontrol", "show", "partition", "-o"], timeout=60)
    if res.rc != 0:
        why = (res.err or res.out).strip().splitlines()[-1:] or [f"exit {res.rc}"]
        raise UserError(f"the Slurm controller does not answer on {sh.where}: {why[0]}; nothing submitted")
    out = {}
    for line in res.out.splitlines():
        kv = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "PartitionName" in kv:
            out[kv["PartitionName"]] = Partition(kv["PartitionName"], int(kv.get("TotalNodes", "0") or 0),
                                                 kv.get("Default") == "YES", kv.get("State", "?"))
    return out


def test_only(sh: Shell, inv: SlurmInventory, script: str) -> None:
    """`sbatch --test-only`: Slurm's own verdict on the request (account, time, gres...), no job made."""
    res = sh.run(["sbatch", "--test-only"], stdin=script.encode(), timeout=60)
    if res.rc != 0:
        lines = [ln.strip() for ln in (res.err + res.out).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "error" in ln.lower() or "failure" in ln.lower()), lines[-1] if lines else "")
        raise UserError(f"{inv.path}: slurm: the cluster refuses the job ({why}); nothing submitted")


@dataclass
class JobState:
    job_id: str
    state: str           # RUNNING, PENDING, COMPLETED, ... or GONE (the controller forgot it)
    exit_code: int | None
    nodes: str = ""
    run_time: str = ""
    reason: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


def job_state(sh: Shell, job_id: str, run_dir: str | None = None) -> JobState:
    res = sh.run(["scontrol", "show", "job", "-o", job_id], timeout=60)
    kv = dict(f.split("=", 1) for f in res.out.split() if "=" in f) if res.rc == 0 else {}
    if kv.get("JobState"):
        code = kv.get("ExitCode", "")
        exit_code = int(code.split(":")[0]) if code.split(":")[0].isdigit() else None
        return JobState(job_id, kv["JobState"], exit_code, kv.get("NodeList", ""), kv.get("RunTime", ""),
                        kv.get("Reason", ""))
    exit_code = read_exit_code(sh, run_dir, job_id) if run_dir else None
    return JobState(job_id, "GONE", exit_code)


def read_exit_code(sh: Shell, run_dir: str, job_id: str) -> int | None:
    raw = sh.read_bytes(f"{run_dir}/slurm/{job_id}/exit-code")
    return int(raw.strip()) if raw and raw.strip().isdigit() else None


# ---- run records ---------------------------------------------------------------------------

def workdir(sh: Shell, inv: SlurmInventory) -> str:
    w = inv.slurm.workdir
    return resolve(w, sh.home()) if w.startswith("~") else w


def read_record(sh: Shell, run_dir: str) -> dict:
    raw = sh.read_bytes(f"{run_dir}/slurm/run.json")
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def write_record(sh: Shell, run_dir: str, record: dict) -> None:
    sh.put_bytes(f"{run_dir}/slurm/run.json", json.dumps(record, indent=1).encode())


def list_runs(sh: Shell, wd: str) -> list[str]:
    """Run ids under <workdir>/runs that are Slurm runs (have slurm/run.json), oldest first."""
    res = sh.run(["sh", "-c", 'cd "$1" 2>/dev/null && for d in */; do [ -f "$d/slurm/run.json" ] && echo "${d%/}"; done; true',
                  "runner-ls", f"{wd}/runs"])
    return sorted(r for r in res.out.splitlines() if RUN_RE.fullmatch(r))


def resolve_run(sh: Shell, wd: str, wanted: str | None) -> str:
    """The Slurm run `wanted` names (an id or a unique prefix; the latest when None), by the SSH
    runner's rule (runner/core/runs.py)."""
    runs = list_runs(sh, wd)
    where = f"{wd}/runs on {sh.where}"
    if not runs:
        raise UserError(f"no Slurm runs in {where}")
    return pick_run(runs, wanted, where)


def node_names(sh: Shell, run_dir: str, job_id: str) -> list[str]:
    """The job's nodes in node-rank order (written by the batch script)."""
    raw = sh.read_bytes(f"{run_dir}/slurm/{job_id}/nodes")
    return raw.decode(errors="replace").split() if raw else []

