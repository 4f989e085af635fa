"""`runner exec NODE [-- CMD...]`: a command (default: an interactive shell) in the node's running
job container, or on the node itself with `--host`; its exit code is the runner's.

It goes over the OpenSSH client pinned to the host key paramiko verified (Remote.openssh_argv, the
path bulk transfers take): OpenSSH owns the terminal (raw mode, window size, signals), so a TTY
session behaves as `ssh -t` does. The command is the user's argv, each word quoted for the node's
shell; the container id comes from the node's engine and is checked before it is used.

On a Slurm inventory the command joins the run's job on that node through `srun --jobid J
--overlap` (run here, or on `slurm.login` over the same pinned OpenSSH), inside the job's
allocation on that node (not in its container: pyxis and Slurm's OCI support start a new
container per step, they cannot enter a running one).
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import subprocess
import sys

from runner.backends import SCHEDULERS, choose
from runner.core import runs
from runner.core.errors import UserError
from runner.inventory.choice import load
from runner.planning.plan import LABEL_ROLE, LABEL_RUN
from runner.transport.ssh import Remote

# A shell in the container: bash where the image has it, else sh.
DEFAULT_SHELL = ["/bin/sh", "-c", "command -v bash >/dev/null 2>&1 && exec bash || exec sh"]
CONTAINER_ID_RE = re.compile(r"[0-9a-f]{12,64}")


def register(sub: argparse._SubParsersAction) -> None:
    from runner.inventory.choice import add_inventory_args

    p = sub.add_parser("exec", help="a command (default: a shell) in a node's running job container, or on the node",
                       description="Run CMD in NODE's running container of the run (default: the latest run with "
                                   "one there), or on the node itself with --host. Without CMD: an interactive "
                                   "shell. The exit code is CMD's.")
    add_inventory_args(p)
    p.add_argument("node", help="node name from the inventory (Slurm: a node of the run's job)")
    p.add_argument("command", nargs="*", metavar="-- CMD", help="command and its arguments, after `--`")
    p.add_argument("--run", metavar="RUN", help="run id or prefix (default: the latest run running on NODE)")
    p.add_argument("--host", action="store_true", help="on the node itself, not in its job container")
    tty = p.add_mutually_exclusive_group()
    tty.add_argument("-t", "--tty", dest="tty", action="store_true", default=None,
                     help="allocate a terminal for CMD (default: only for the interactive shell, when stdin is one)")
    tty.add_argument("-T", "--no-tty", dest="tty", action="store_false", help="never allocate a terminal")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="auto",
                   help="ssh nodes or a Slurm cluster (default auto, as for `runner up`)")
    split_at_dashes(p)
    p.set_defaults(func=cmd_exec)


def split_at_dashes(p: argparse.ArgumentParser) -> None:
    """Everything after the first `--` is CMD, whatever options come between NODE and it
    (argparse alone gives a second positional nothing once a first one has been matched)."""
    base = type(p)

    class _ExecParser(base):
        def parse_known_args(self, args=None, namespace=None):
            args = list(sys.argv[1:] if args is None else args)
            cut = args.index("--") if "--" in args else len(args)
            ns, rest = super().parse_known_args(args[:cut], namespace)
            if cut < len(args):
                if ns.command:
                    self.error(f"the command goes after `--` only (got {shlex.join(ns.command)} before it)")
                ns.command = args[cut + 1:]
            return ns, rest

    p.__class__ = _ExecParser


def wants_tty(args) -> bool:
    if args.tty is not None:
        return args.tty
    return not args.command and sys.stdin.isatty()


def cmd_exec(args) -> int:
    if choose(args) == "slurm":
        return _slurm_exec(args)
    inv = load(args, with_job=False)
    node = inv.node(args.node)  # one line naming the inventory and its nodes
    tty = wants_tty(args)
    with Remote(node, args.accept_new_host_keys).connect() as r:
        if args.host:
            remote_cmd = shlex.join(args.command) if args.command else None  # none: the login shell
        else:
            cid = running_container(r, args.run)
            remote_cmd = shlex.join(docker_exec_argv(cid, args.command, tty))
        return interactive(ssh_argv(r, remote_cmd, tty))


def running_container(r: Remote, wanted: str | None) -> str:
    """The id of the node's running rank container of run `wanted` (a prefix; default: the latest
    run that has one running on this node)."""
    from runner.backends.ssh.node_runs import run_containers

    found = {}
    for c in run_containers(r, None, all_=False):
        rid = c.labels.get(LABEL_RUN)
        if LABEL_ROLE not in c.labels and runs.is_run_name(rid):
            found[rid] = c
    name = r.node.name
    if not found:
        raise UserError(f"node {name}: no running job container (see `runner ls`; "
                        "--host runs on the node itself)")
    try:
        rid = runs.resolve(found, wanted, f"the running containers on {name}")
    except UserError as exc:
        raise UserError(f"node {name}: {exc}") from None
    cid = str(found[rid].id)
    if not CONTAINER_ID_RE.fullmatch(cid):
        raise UserError(f"node {name}: its engine gave {cid[:80]!r} as a container id; refusing to use it")
    return cid


def docker_exec_argv(container_id: str, command: list[str], tty: bool) -> list[str]:
    return ["docker", "exec", "-i", *(["-t"] if tty else []), container_id, *(command or DEFAULT_SHELL)]


def ssh_argv(r: Remote, remote_cmd: str | None, tty: bool) -> list[str]:
    """The pinned OpenSSH argv; -t asks for a terminal (-tt when ours is not one but -t was given)."""
    flag = ("-t" if sys.stdin.isatty() else "-tt") if tty else "-T"
    argv = r.openssh_argv()
    return [*argv[:-1], flag, argv[-1], *([remote_cmd] if remote_cmd is not None else [])]


def interactive(argv: list[str]) -> int:
    """argv on our terminal, its exit code ours. Ctrl-C goes to it (same process group), not to us:
    the runner waits for it to end."""
    try:
        p = subprocess.Popen(argv)
    except FileNotFoundError:
        raise UserError(f"{argv[0]}: not found on this machine (install the OpenSSH client)") from None
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return p.wait()
    except KeyboardInterrupt:  # SIGTERM to the runner (runner/core/errors.py): the session ends with it
        p.terminate()
        p.wait()
        raise
    finally:
        signal.signal(signal.SIGINT, old)


# ---- Slurm -----------------------------------------------------------------------------------

def srun_argv(job_id: str, node: str, command: list[str], tty: bool) -> list[str]:
    """One task on `node` inside the running job's allocation, beside its tasks (--overlap)."""
    return ["srun", f"--jobid={job_id}", "--overlap", f"--nodelist={node}", "--nodes=1", "--ntasks=1",
            *(["--pty"] if tty else []), "--", *(command or ["/bin/sh", "-c", 'exec "${SHELL:-/bin/sh}"'])]


def _slurm_exec(args) -> int:
    from runner.backends.slurm.jobs import job_state, node_names, resolve_run, workdir
    from runner.backends.slurm.shell import LoginShell, open_shell
    from runner.backends.slurm.status import last_job
    from runner.inventory.slurm import load_slurm_inventory

    if args.host:
        raise UserError("--host is for SSH nodes; on Slurm, `runner exec` already runs on the node, in the job's "
                        "allocation")
    inv = load_slurm_inventory(args.inventory, with_job=False)
    sh = open_shell(inv, args.accept_new_host_keys)
    try:
        wd = workdir(sh, inv)
        run_id = resolve_run(sh, wd, args.run)
        run_dir = f"{wd}/runs/{run_id}"
        job_id, _ = last_job(sh, run_dir)
        st = job_state(sh, job_id, run_dir) if job_id else None
        if st is None or st.state != "RUNNING":
            raise UserError(f"run {run_id}: Slurm job {job_id or '-'} is {st.state if st else 'not submitted'}; "
                            "`runner exec` needs it RUNNING (see `runner status`)")
        nodes = node_names(sh, run_dir, job_id)
        if args.node not in nodes:
            raise UserError(f"run {run_id}: {args.node!r} is not a node of Slurm job {job_id} "
                            f"(nodes: {', '.join(nodes[:10]) or 'none yet'})")
        tty = wants_tty(args)
        argv = srun_argv(job_id, args.node, args.command, tty)
        if isinstance(sh, LoginShell):
            return interactive(ssh_argv(sh.remote, shlex.join(argv), tty))
        return interactive(argv)
    finally:
        sh.close()
