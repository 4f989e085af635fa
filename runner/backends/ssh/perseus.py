"""`job.perseus`: a Perseus server (Zeus's pipeline frequency optimizer) beside the job.

    job:
      args: [--num_prof_steps, "4", ...]     # the steps each plan runs (the trainer needs it)
      perseus:
        plan: plans/plan.py                 # one plan file (PointSolution: served every round), or
                                            # [a.py, b.py, ...] (PlanSequence: one round each, then done)
        scheduler: PointSolution            # default: PointSolution for one file, PlanSequence for a list
        port: auto                          # the server's port on the master (auto: a free one)

A plan file is a Python literal: one list per rank of (instruction, frequency) pairs
(runner/agents/perseus_server.py; `trainer perseus-plans` writes them). Each is read once when
the inventory loads (runner/inventory/perseus_spec.py: bounded before reading, parsed as plain
data without evaluating anything, known instructions, frequencies in range) and must hold one list
per rank of the job (the nodes' slots or job.nproc_per_node, summed), so `runner up --dry-run`
refuses it. What reaches the master (<run dir>/perseus/plans/) is the checked value written out
again (`plan_bytes`), never a second read of the file; the server checks it again and evaluates
nothing (docs/security.md, "Perseus plan files").

At launch the server starts first, on the master, as a second container of the job's image
(labelled with the run and the node, so `runner down` stops it with the ranks; it needs no GPU):
the trainer image carries the server's own environment in /opt/perseus (pydantic 1: one small
layer, see the Dockerfile), so nothing else is pushed. It listens on the master's rank address,
and every rank gets `PERSEUS_URL=http://<master addr>:<port>` (the trainer's --perseus_url). Its
dump (ranks, every round's schedules and results, server.log) is <run dir>/perseus/dump on the
master, collected with the run.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import replace

from runner.backends.ssh.node_runs import create_container
from runner.core.errors import JobFailed, UserError
from runner.inventory.perseus_spec import PerseusSpec
from runner.planning.plan import LABEL_ROLE, OUT, NodePlan, Plan
from runner.transport.rendezvous import pick_master_port, wait_listening

log = logging.getLogger("runner.up")

PERSEUS_DIR = "perseus"                   # under the run dir: plans/ and dump/
SERVER_PATH = "/opt/perseus"              # the server's environment in the trainer image


# ---------------------------------------------------------------- plan (pure)

def url(addr: str, port: int | str) -> str:
    return f"http://{'[' + addr + ']' if ':' in addr else addr}:{port}"


def plan_names(spec: PerseusSpec) -> list[str]:
    """The plan files' names on the master: ordered, plain, ending in .py (Zeus requires it)."""
    out = []
    for i, (path, _) in enumerate(spec.plans):
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(path)).removesuffix(".py")
        out.append(f"{i:02d}-{stem}.py")
    return out


def attach(plan: Plan, port: int | str | None) -> None:
    """Every rank's container gets the server's URL (PERSEUS_URL: the trainer's --perseus_url)."""
    u = url(plan.master_addr, port if port is not None else "<auto>")
    for np_ in plan.nodes:
        np_.env["PERSEUS_URL"] = u


def server_plan(plan: Plan, spec: PerseusSpec, port: int | str) -> NodePlan:
    """The server's container on the master, as a NodePlan (same image, user, run dir; no GPU)."""
    m = plan.nodes[0]
    base = f"{OUT}/{PERSEUS_DIR}"
    cmd = ["python", "-m", "runner.agents.perseus_server", "--host", plan.master_addr, "--port", str(port),
           "--dump-dir", f"{base}/dump", "--scheduler", spec.scheduler]
    for name in plan_names(spec):
        cmd += ["--plan", f"{base}/plans/{name}"]
    env = {"PYTHONPATH": SERVER_PATH, "PYTHONUNBUFFERED": "1"}
    if m.user and "HOME" in m.env:
        env.update(HOME=m.env["HOME"], USER=m.env.get("USER", ""))
    labels = {k: v for k, v in m.labels.items() if not k.endswith(".rank")}
    labels[LABEL_ROLE] = "perseus"
    return replace(m, container=f"{m.container}-perseus", command=cmd, env=env, labels=labels, secret_keys=[],
                   secrets_file=None, gpus=None, mounts={OUT: m.run_dir}, writable=frozenset({OUT}), go_file=None,
                   cpus=None, memory=None)


def render(plan: Plan, spec: PerseusSpec, port: int | str = "<auto>") -> str:
    m = plan.nodes[0]
    sp = server_plan(plan, spec, port)
    names = ", ".join(f"{os.path.basename(p)} -> {n}" for (p, _), n in zip(spec.plans, plan_names(spec), strict=True))
    return "\n".join([
        f"[{m.node}/perseus] Perseus server ({spec.scheduler}) beside the job: container {sp.container}, "
        f"image {m.image or '<probed at launch>'} ({SERVER_PATH})",
        f"    plans     {names} in {m.run_dir}/{PERSEUS_DIR}/plans",
        f"    dump      {m.run_dir}/{PERSEUS_DIR}/dump (collected with the run)",
        f"    command   {' '.join(sp.command)}",
        f"    every rank: PERSEUS_URL={m.env.get('PERSEUS_URL')}"])


# ---------------------------------------------------------------- launch (I/O)

def choose_port(master, spec: PerseusSpec, run_id: str, master_port: int) -> int:
    """spec.port checked free now, or the first free port (never the job's master port)."""
    listening = master.listening_ports() | {master_port}
    if spec.port == "auto":
        return pick_master_port(listening, f"{run_id}/perseus")
    if int(spec.port) in listening:
        raise UserError(f"master {master.node.name}: job.perseus.port {spec.port} is in use; choose another or auto")
    return int(spec.port)


def start(cl, plan: Plan, spec: PerseusSpec, port: int, timeout: float) -> None:
    """Stage the plan files on the master, start the server, wait until it listens."""
    m = plan.nodes[0]
    r = cl[m.node]
    r.makedirs(f"{m.run_dir}/{PERSEUS_DIR}/plans")
    r.makedirs(f"{m.run_dir}/{PERSEUS_DIR}/dump")
    for (_, data), name in zip(spec.plans, plan_names(spec), strict=True):
        r.put_bytes(f"{m.run_dir}/{PERSEUS_DIR}/plans/{name}", data)
    sp = server_plan(plan, spec, port)
    create_container(r, sp).start()
    try:
        wait_listening(r, sp, port, timeout)
    except JobFailed as exc:
        raise UserError(f"job.perseus: the Perseus server on {m.node} stopped before listening ({exc}); the job's "
                        f"image must carry the server's environment in {SERVER_PATH} (see the Dockerfile)") from None
    log.info("[%s/perseus] Perseus server listening on %s", m.node, url(plan.master_addr, port))
