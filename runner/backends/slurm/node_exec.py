"""exec_argv of Slurm runs (`runner exec NODE [-- CMD...]`): the command joins the run's job on that
node through `srun --jobid J --overlap` (run here, or on `slurm.login` over the OpenSSH client
pinned to the key paramiko verified), inside the job's allocation on that node (not in its
container: pyxis and Slurm's OCI support start a new container per step, they cannot enter a
running one)."""

from __future__ import annotations

import atexit
import shlex
import shutil
import sys

from runner.backends.slurm.jobs import job_state, node_names, resolve_run, workdir
from runner.backends.slurm.shell import LoginShell
from runner.backends.slurm.status import last_job
from runner.core.errors import Unsupported, UserError


def srun_argv(job_id: str, node: str, command: list[str], tty: bool) -> list[str]:
    """One task on `node` inside the running job's allocation, beside its tasks (--overlap)."""
    return ["srun", f"--jobid={job_id}", "--overlap", f"--nodelist={node}", "--nodes=1", "--ntasks=1",
            *(["--pty"] if tty else []), "--", *(command or ["/bin/sh", "-c", 'exec "${SHELL:-/bin/sh}"'])]


def exec_argv(backend, run: str | None, node: str, command: list[str], tty: bool, host: bool) -> list[str]:
    if host:
        raise Unsupported("--host is for SSH nodes; on Slurm, `runner exec` already runs on the node, in the job's "
                        "allocation")
    inv = backend.inventory
    sh = backend.shell()
    try:
        wd = workdir(sh, inv)
        run_id = resolve_run(sh, wd, run)
        run_dir = f"{wd}/runs/{run_id}"
        job_id, _ = last_job(sh, run_dir)
        st = job_state(sh, job_id, run_dir) if job_id else None
        if st is None or st.state != "RUNNING":
            raise UserError(f"run {run_id}: Slurm job {job_id or '-'} is {st.state if st else 'not submitted'}; "
                            "`runner exec` needs it RUNNING (see `runner status`)")
        nodes = node_names(sh, run_dir, job_id)
        if node not in nodes:
            raise UserError(f"run {run_id}: {node!r} is not a node of Slurm job {job_id} "
                            f"(nodes: {', '.join(nodes[:10]) or 'none yet'})")
        argv = srun_argv(job_id, node, command, tty)
        if not isinstance(sh, LoginShell):
            return argv
        flag = ("-t" if sys.stdin.isatty() else "-tt") if tty else "-T"
        ssh = sh.remote.openssh_argv()
        kept = sh.remote.keep_openssh_files()  # the argv runs once this connection is closed
        if kept:
            atexit.register(shutil.rmtree, kept, True)
        return [*ssh[:-1], flag, ssh[-1], shlex.join(argv)]
    finally:
        sh.close()
