"""`runner exec`: a command in a node's running job container (or on the node), over the pinned
OpenSSH path, its exit code passed through; a TTY session driven through a pseudo-terminal.

One held job on node-0 of the session sandbox (a one-node inventory: the cheapest job there is)
serves every case; it is finished and downed at the end."""

from __future__ import annotations

import os
import pty
import re
import select
from pathlib import Path

import pytest
import yaml

from runner.backends.slurm.node_exec import srun_argv
from tests.support.runner_helpers import (
    finish_run,
    node_workdir,
    runner,
    runner_cmd,
    up_detached,
    wait_for,
    write_job,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]


@pytest.fixture(scope="module")
def held(sandbox, pushed, tmp_path_factory):
    """(one-node inventory, run id) of a job held running on node-0 until the module ends."""
    tmp = tmp_path_factory.mktemp("exec")
    doc = yaml.safe_load(Path(sandbox).read_text())
    doc["nodes"] = doc["nodes"][:1]
    inv = tmp / "one.yaml"
    inv.write_text(yaml.safe_dump(doc))
    run_id = up_detached(inv, write_job(tmp, hold=True))
    # The job's own start: its probe file (up --detach returns once the container runs).
    wait_for((node_workdir(inv, "node-0") / "runs" / run_id / "probe-node-0.json").exists, 120)
    yield inv, run_id
    finish_run(inv, run_id)
    runner("down", run_id, "-i", str(inv))


def test_command_in_the_container_exit_code_and_output_exact(held):
    inv, run_id = held
    script = ('printf "%s %s\\n" "$RUN_ID" "$NODE_NAME"; test -f /out/probe-node-0.json && echo probe-file; '
              'test -d /out && echo in-container; echo to-stderr >&2; exit 7')
    p = runner("exec", "node-0", "-i", str(inv), "--", "sh", "-c", script)
    assert (p.returncode, p.stdout, p.stderr) == (7, f"{run_id} node-0\nprobe-file\nin-container\n", "to-stderr\n")
    # Every word reaches the command as it was given: nothing is read by a shell on the way.
    p = runner("exec", "node-0", "-i", str(inv), "--run", run_id[:10], "--", "printf", "%s|", "a b", "$HOME", "it's",
               ";", "`id`")
    assert (p.returncode, p.stdout) == (0, "a b|$HOME|it's|;|`id`|"), p.stderr


def test_host_runs_on_the_node_not_in_the_container(held):
    inv, _ = held
    p = runner("exec", "node-0", "--host", "-i", str(inv), "--", "sh", "-c",
               'echo "${RUN_ID-no-run-id}"; test -d /out || echo on-host; exit 5')  # /out: the run dir's mount
    assert (p.returncode, p.stdout) == (5, "no-run-id\non-host\n"), p.stderr


def test_tty_session_through_a_pseudo_terminal(held):
    """No command: an interactive shell in the container, on a terminal of its own (`tty` names a
    pts), driven as a user types; its exit code is the runner's."""
    inv, _ = held
    pid, fd = pty.fork()
    if pid == 0:  # the child: the runner on the pseudo-terminal's slave side
        os.execvpe(runner_cmd()[0], [*runner_cmd("exec", "node-0", "-i", str(inv))], os.environ)
    os.write(fd, b'echo "$((6*7))-$NODE_NAME"; tty; exit 3\n')
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 120)
        assert ready, f"no end of the session; so far: {out[-2000:]!r}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the runner ended and closed the terminal
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    # The shell's terminal escapes (bash's bracketed paste on, off) are not the session's lines.
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace")).replace("\r", "").splitlines()
    assert os.waitstatus_to_exitcode(status) == 3, out
    assert "42-node-0" in lines, out  # the command's output (the typed line reads $((6*7))-$NODE_NAME)
    assert any(re.fullmatch(r"/dev/pts/\d+", ln) for ln in lines), out


def test_bad_node_and_bad_run_are_one_line(held):
    inv, _ = held
    p = runner("exec", "node-9", "-i", str(inv), "--", "true")
    assert p.returncode == 2 and p.stderr == f"runner: error: {inv}: no node named 'node-9' (nodes: node-0)\n"
    p = runner("exec", "node-0", "-i", str(inv), "--run", "19990101", "--", "true")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("runner: error: node node-0: 19990101: no such run in the running containers on node-0")


def test_slurm_srun_argv():
    """On Slurm: one task on the node inside the running job (srun --overlap), a pty only when asked."""
    assert srun_argv("42", "c1", ["nvidia-smi", "-L"], tty=False) == [
        "srun", "--jobid=42", "--overlap", "--nodelist=c1", "--nodes=1", "--ntasks=1", "--", "nvidia-smi", "-L"]
    assert srun_argv("42", "c1", [], tty=True) == [
        "srun", "--jobid=42", "--overlap", "--nodelist=c1", "--nodes=1", "--ntasks=1", "--pty", "--",
        "/bin/sh", "-c", 'exec "${SHELL:-/bin/sh}"']
