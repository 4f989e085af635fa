"""exec_argv of SSH runs (`runner exec NODE [-- CMD...]`): the OpenSSH argv that runs a command
(default: an interactive shell) in the node's running job container, or on the node itself with
`host`.

It goes over the OpenSSH client pinned to the host key paramiko verified (Remote.openssh_argv, the
path bulk transfers take): OpenSSH owns the terminal (raw mode, window size, signals), so a TTY
session behaves as `ssh -t` does. The command is the user's argv, each word quoted for the node's
shell; the container id comes from the node's engine and is checked before it is used.
"""

from __future__ import annotations

import atexit
import re
import shlex
import shutil
import sys

from runner.core import runs
from runner.core.errors import UserError
from runner.planning.plan import LABEL_ROLE, LABEL_RUN
from runner.transport.ssh import Remote

# A shell in the container: bash where the image has it, else sh.
DEFAULT_SHELL = ["/bin/sh", "-c", "command -v bash >/dev/null 2>&1 && exec bash || exec sh"]
CONTAINER_ID_RE = re.compile(r"[0-9a-f]{12,64}")


def exec_argv(backend, run: str | None, node: str, command: list[str], tty: bool, host: bool) -> list[str]:
    n = backend.inventory.node(node)  # one line naming the inventory and its nodes
    with Remote(n, backend.accept_new_host_keys).connect() as r:
        if host:
            remote_cmd = shlex.join(command) if command else None  # none: the login shell
        else:
            cid = running_container(r, run)
            remote_cmd = shlex.join(docker_exec_argv(cid, command, tty))
        return detached_argv(r, ssh_argv(r, remote_cmd, tty))


def detached_argv(r: Remote, argv: list[str]) -> list[str]:
    """argv, its pinned known_hosts kept past the connection's close (the argv runs after it) and
    removed when this process exits."""
    kept = r.keep_openssh_files()
    if kept:
        atexit.register(shutil.rmtree, kept, True)
    return argv


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
