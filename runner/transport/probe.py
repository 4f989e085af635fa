"""What a node is, asked in one SSH session before anything starts: arch, home, the interface that
routes to the master, engine access, clock offset, memory, free ports (`check` shows it all;
`up` uses it for the plan)."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from runner.core.errors import UserError
from runner.planning.paths import node_paths
from runner.planning.plan import Facts, host_name, ip_literal
from runner.transport.ssh import Remote


@dataclass
class Probe:
    """Everything `check` shows about a node; `up` uses arch/home/ifname."""

    arch: str | None = None
    home: str | None = None
    ifname: str | None = None
    src_ip: str | None = None     # the address this node's sockets to the master come from (`src` of the route)
    master_ip: str | None = None
    cpus: int | None = None
    mem_gb: float | None = None
    mem_available: int | None = None  # bytes, MemAvailable when probed: what a job may still take
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
    hostname: str | None = None   # the node's (its containers share it: network_mode host): its /etc/hosts line

    def facts(self) -> Facts:
        return Facts(arch=self.arch, ifname=self.ifname, home=self.home, uid=self.uid, gid=self.gid,
                     user=self.user, src_ip=self.src_ip, hostname=self.hostname)


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
echo "hostname=$(cat /proc/sys/kernel/hostname 2>/dev/null)"
echo "home=$HOME"
echo "uid=$(id -u)"
echo "gid=$(id -g)"
echo "user=$(id -un 2>/dev/null)"
echo "nproc=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)"
echo "mem_kb=$(awk '/MemTotal/{{print $2}}' /proc/meminfo)"
echo "mem_avail_kb=$(awk '/MemAvailable/{{print $2}}' /proc/meminfo)"
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
    user = kv.get("user") or None  # the node's words, printed in messages: none with a control character
    p.uid, p.gid, p.user = _int(kv.get("uid")), _int(kv.get("gid")), user if user and user.isprintable() else None
    p.master_ip = kv.get("master_ip")
    p.hostname = host_name(kv.get("hostname", ""))
    route = kv.get("route", "").split()
    if "dev" in route:
        p.ifname = route[route.index("dev") + 1]
    if "src" in route[:-1]:
        p.src_ip = ip_literal(route[route.index("src") + 1])
    if kv.get("addrdev"):
        # The master routes its own address via `local ... dev lo`; gloo must bind the interface
        # that HOLDS the address, which other nodes can reach.
        p.ifname = kv["addrdev"]
        p.src_ip = ip_literal(p.master_ip or "")
    p.cpus = _int(kv.get("nproc"))
    mem = _int(kv.get("mem_kb"))
    p.mem_gb = round(mem / 1048576, 1) if mem else None
    avail = _int(kv.get("mem_avail_kb"))
    p.mem_available = avail * 1024 if avail else None
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

