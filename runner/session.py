"""Shared plumbing for the commands: inventory arguments, parallel SSH, and node probing."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from runner.errors import UserError
from runner.fanout import DEFAULT_PARALLEL, add_parallel_arg, parallel
from runner.inventory import Inventory, Node, load_inventory
from runner.paths import node_paths
from runner.plan import Facts
from runner.rendezvous import AUTO_PORT_BASE, AUTO_PORT_OFFSETS, AUTO_PORT_SPAN, pick_master_port, port_offset
from runner.ssh import Remote, connect_all, connect_each

T = TypeVar("T")
DEFAULT_INVENTORY = "hosts/local.yaml"  # what `runner sandbox up` writes
INVENTORY_ENV = "RUNNER_INVENTORY"
# The inventory of the last `runner up` / `runner sandbox up` run in a directory, kept in this file
# relative to it; RUNNER_LAST_UP names another file ("" keeps none: the test suite's runs, made
# from the checkout, must not become its default).
LAST_UP = Path(".runner") / "last-inventory"
LAST_UP_ENV = "RUNNER_LAST_UP"


def _last_up_file(cwd: Path, environ: Mapping[str, str]) -> Path | None:
    name = environ.get(LAST_UP_ENV)
    if name is None:
        return cwd / LAST_UP
    return cwd / name if name else None


def add_inventory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--inventory", default=None,
                   help=f"inventory YAML (default: ${INVENTORY_ENV}, else the last `runner up` here, "
                        f"else {DEFAULT_INVENTORY})")
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust and record host keys not yet in known_hosts (default: refuse)")
    add_parallel_arg(p)


def default_inventory(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> tuple[str, str]:
    """(path, where it came from) of the inventory a command without -i uses: $RUNNER_INVENTORY,
    then the last `up` in this directory (while that file exists), then hosts/local.yaml. A
    missing one is a UserError naming -i and `runner sandbox up`."""
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    if environ.get(INVENTORY_ENV):
        return environ[INVENTORY_ENV], INVENTORY_ENV
    record = _last_up_file(cwd, environ)
    try:
        last = record.read_text().strip() if record else ""
    except (OSError, UnicodeDecodeError):
        last = ""
    if last and "\n" not in last and (cwd / last).is_file():
        return last, "default" if last == DEFAULT_INVENTORY else "last up"
    if not (cwd / DEFAULT_INVENTORY).is_file():
        raise UserError(f"no inventory: {DEFAULT_INVENTORY} does not exist here; name one with -i FILE (or "
                        f"{INVENTORY_ENV}=FILE), or start the local sandbox cluster with `runner sandbox up`, "
                        f"which writes {DEFAULT_INVENTORY}")
    return DEFAULT_INVENTORY, "default"


def resolve_inventory(args: argparse.Namespace) -> None:
    """Fill args.inventory of a command run without -i; an inventory taken from the last `up`
    is named on stderr (it may not be the one the user has in mind)."""
    if getattr(args, "inventory", "") is not None:
        return
    args.inventory, origin = default_inventory()
    if origin == "last up":
        sys.stderr.write(f"runner: inventory {args.inventory} (from the last `runner up` or `runner sandbox up` here; -i FILE for another)\n")


def remember_inventory(path: str | os.PathLike, cwd: Path | None = None,
                       environ: Mapping[str, str] | None = None) -> None:
    """Record path as this directory's last `up` inventory (best effort: a read-only checkout
    just keeps its default)."""
    cwd = Path.cwd() if cwd is None else cwd
    state = _last_up_file(cwd, os.environ if environ is None else environ)
    path = str(path)
    if state is None or "\n" in path:
        return
    try:
        state.parent.mkdir(parents=True, exist_ok=True)
        tmp = state.with_name(f"{state.name}.{os.getpid()}")
        tmp.write_text(path + "\n")
        os.replace(tmp, state)
    except OSError:
        pass


def load(args, *, with_job: bool = True, check_files: bool = True) -> Inventory:
    """The inventory, every problem refused here. check_files=False (a dry-run) leaves out the
    files only a connection needs (SSH keys, known_hosts): nothing is read that is not planned."""
    return load_inventory(args.inventory, job_path=getattr(args, "job", None), with_job=with_job,
                          check_files=check_files)


class Cluster:
    """The inventory's nodes, connected (verified host keys), closed on exit.

    partial=True (down, status, ls, logs) keeps going with the nodes that answer: one dead node
    must not stop `down` from stopping the others (that is how orphans are made). The nodes that
    could not be reached are in `unreachable` ({node: one-line reason}); if none answers at all,
    it is one error as with partial=False."""

    def __init__(self, inv: Inventory, accept_new_host_keys: bool = False, partial: bool = False,
                 workers: int = DEFAULT_PARALLEL):
        self.inv = inv
        self.accept_new = accept_new_host_keys
        self.partial = partial
        self.workers = workers
        self.remotes: dict[str, Remote] = {}
        self.unreachable: dict[str, str] = {}

    def __enter__(self) -> Cluster:
        if not self.partial:
            self.remotes = connect_all(self.inv.nodes, self.accept_new, self.workers)
            return self
        self.remotes, self.unreachable = connect_each(self.inv.nodes, self.accept_new, self.workers)
        if not self.remotes:
            raise UserError("; ".join(self.unreachable.values()))
        return self

    def map(self, items: list, fn: Callable) -> list:
        """parallel() bounded by this command's --parallel."""
        return parallel(items, fn, self.workers)

    def __exit__(self, *exc) -> None:
        self.map(list(self.remotes.values()), Remote.close)

    def __getitem__(self, name: str) -> Remote:
        return self.remotes[name]

    def reachable(self) -> list[Node]:
        """Connected nodes, master first (node rank order)."""
        return [n for n in self.inv.ordered() if n.name in self.remotes]

    def warn_unreachable(self, consequence: str = "left out") -> None:
        """One stderr line per node that did not answer, saying what that means for this command."""
        for msg in self.unreachable.values():
            sys.stderr.write(f"runner: warning: {msg} ({consequence})\n")

    def each(self, fn: Callable[[Remote], T]) -> dict[str, T]:
        """Run fn on every connected node in parallel; one UserError naming every node that failed."""
        res = self.map([self.remotes[n.name] for n in self.inv.nodes if n.name in self.remotes], fn)
        errors = [f"{r.node.name}: {_short(e)}" for r, _, e in res if e is not None]
        if errors:
            raise UserError("; ".join(errors))
        return {r.node.name: v for r, v, _ in res}


def _short(e: Exception) -> str:
    s = str(e).strip().splitlines()
    msg = s[0] if s else type(e).__name__
    return msg.split(": ", 1)[1] if msg.startswith("node ") and ": " in msg else msg


@dataclass
class Probe:
    """Everything `check` shows about a node; `up` uses arch/home/ifname."""

    arch: str | None = None
    home: str | None = None
    ifname: str | None = None
    master_ip: str | None = None
    cpus: int | None = None
    mem_gb: float | None = None
    disk_free_gb: float | None = None
    gpus: int = 0
    gpu_runtime: bool | None = None  # NVIDIA Container Toolkit seen (docker's runtimes or its CLI); None: no GPU
    docker: str | None = None
    docker_error: str | None = None
    clock_offset_s: float | None = None
    listening: set[int] | None = None
    uid: int | None = None        # the SSH user's: its containers run as uid:gid (plan.py)
    gid: int | None = None
    user: str | None = None

    def facts(self) -> Facts:
        return Facts(arch=self.arch, ifname=self.ifname, home=self.home, uid=self.uid, gid=self.gid,
                     user=self.user)


UNAME_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def probe(remote: Remote, master_host: str, clock: bool = True) -> Probe:
    """One round trip of plain shell (no python needed on the node)."""
    wd_sh = shlex.quote(node_paths(remote.node, remote.home).workdir)
    m = shlex.quote(master_host)
    script = f"""
A=$(getent ahostsv4 {m} 2>/dev/null | awk 'NR==1{{print $1}}'); [ -n "$A" ] || A={m}
echo "master_ip=$A"
R=$(ip -o route get "$A" 2>/dev/null | head -1)
echo "route=$R"
case "$R" in local*) echo "addrdev=$(ip -o addr show to "$A" 2>/dev/null | awk 'NR==1{{print $2}}')";; esac
echo "arch=$(uname -m)"
echo "home=$HOME"
echo "uid=$(id -u)"
echo "gid=$(id -g)"
echo "user=$(id -un 2>/dev/null)"
echo "nproc=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)"
echo "mem_kb=$(awk '/MemTotal/{{print $2}}' /proc/meminfo)"
d={wd_sh}; while [ ! -e "$d" ]; do d=$(dirname "$d"); done
echo "disk_kb=$(df -Pk "$d" | awk 'NR==2{{print $4}}')"
G=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); echo "gpus=$G"
if [ "${{G:-0}}" -gt 0 ]; then
  {{ docker info --format '{{{{json .Runtimes}}}}' 2>/dev/null | grep -q nvidia || command -v nvidia-container-cli >/dev/null 2>&1; }} \
    && echo "gpu_runtime=yes" || echo "gpu_runtime=no"
fi
V=$(docker version --format '{{{{.Server.Version}}}}' 2>&1 | tr '\\n' ' ')
echo "docker_rc=$?"
echo "docker=$V"
"""
    lines, offset = _probe_session(remote, script, clock)
    kv: dict[str, str] = {}
    for line in lines:
        k, _, v = line.partition("=")
        kv[k.strip()] = v.strip()
    p = Probe()
    p.arch = UNAME_ARCH.get(kv.get("arch", ""), kv.get("arch") or None)
    p.home = kv.get("home") or None
    p.uid, p.gid, p.user = _int(kv.get("uid")), _int(kv.get("gid")), kv.get("user") or None
    p.master_ip = kv.get("master_ip")
    route = kv.get("route", "").split()
    if "dev" in route:
        p.ifname = route[route.index("dev") + 1]
    if kv.get("addrdev"):
        # The master routes its own address via `local ... dev lo`; gloo must bind the interface
        # that HOLDS the address, which other nodes can reach.
        p.ifname = kv["addrdev"]
    p.cpus = _int(kv.get("nproc"))
    mem = _int(kv.get("mem_kb"))
    p.mem_gb = round(mem / 1048576, 1) if mem else None
    disk = _int(kv.get("disk_kb"))
    p.disk_free_gb = round(disk / 1048576, 1) if disk is not None else None
    p.gpus = _int(kv.get("gpus")) or 0
    if kv.get("gpu_runtime") in ("yes", "no"):
        p.gpu_runtime = kv["gpu_runtime"] == "yes"
    v = kv.get("docker", "")
    if v and v[0].isdigit() and " " not in v.strip():
        p.docker = v.strip()
    else:
        p.docker_error = v.strip()[:160] or "docker not found"
        if "permission denied" in v.lower():
            # A Pi's `pi` is in the docker group; an account that is not may not use the engine.
            who = p.user or remote.node.user
            p.docker_error = (f"permission denied on the engine's socket: the SSH user {who} is not in its group; "
                              f"`sudo usermod -aG docker {who}` on the node, then connect again")
    p.clock_offset_s = offset
    p.listening = remote.listening_ports()
    return p


PROBE_END = "__runner_probe_end__"
PROBE_LINE, PROBE_LINES = 4096, 1000  # what the probe's answer may hold (a few dozen short lines)


def _probe_session(remote: Remote, script: str, clock: bool, samples: int = 3) -> tuple[list[str], float | None]:
    """The probe's lines, then (clock=True) the clock samples, all in ONE session: each exec costs
    the node a login shell (its ~/.bashrc too: ~100 processes on a pyenv-initialised account)."""
    loop = "while read -r _; do date +%s%N; done" if clock else ":"
    chan = remote.open_exec(shlex.join(["sh", "-c", f"{script}\necho {PROBE_END}\n{loop}"]))
    lines: list[str] = []
    try:
        chan.settimeout(30)
        out = chan.makefile("rb")
        # A node's answer is read a bounded line at a time, and only so many of them.
        while (raw := out.readline(PROBE_LINE)) and (line := raw.decode(errors="replace").rstrip("\n")) != PROBE_END:
            if len(lines) == PROBE_LINES:
                raise UserError(f"node {remote.node.name}: the probe's answer is over {PROBE_LINES} lines; "
                                "is the login shell printing something?")
            lines.append(line)
        return lines, (_clock_offset(chan, out, samples) if clock else None)
    except (OSError, TimeoutError):
        raise UserError(f"node {remote.node.name}: the probe did not answer within 30s") from None
    finally:
        chan.close()


def _clock_offset(chan, replies, samples: int) -> float | None:
    """Node clock minus ours, from the sample with the smallest round trip (NTP's idea)."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        t0 = time.time()
        chan.sendall(b"\n")
        out = replies.readline(64).strip()
        t1 = time.time()
        if not out.isdigit():
            return None
        rtt, off = t1 - t0, int(out) / 1e9 - (t0 + t1) / 2
        if best is None or rtt < best[0]:
            best = (rtt, off)
    return round(best[1], 3) if best else None


def _int(s: str | None) -> int | None:
    try:
        return int(s) if s not in (None, "") else None
    except ValueError:
        return None


__all__ = ["AUTO_PORT_BASE", "AUTO_PORT_OFFSETS", "AUTO_PORT_SPAN", "Cluster", "Probe", "add_inventory_args", "load",
           "parallel", "pick_master_port", "port_offset", "probe", "connect_all"]
