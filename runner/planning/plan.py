"""Plan: inventory + job + run id + probed facts in, one action list per node out.

Pure: no sockets, no files, no clocks. `runner up --dry-run` prints it, tests assert on it, and
launch.py executes it. Node rank 0 is always the inventory's master (static rendezvous), so the
rank order cannot be reshuffled by torchrun's c10d rendezvous.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass, field

from runner.core.errors import UserError
from runner.core.node_output import visible
from runner.core.redact import MASK
from runner.inventory import Inventory, Node, looks_secret
from runner.planning.jobspec import direct_argv, signal_env, torchrun_argv
from runner.planning.paths import node_paths

LABEL_PREFIX = "io.runner"
LABEL_RUN = f"{LABEL_PREFIX}.run-id"
LABEL_ROLE = f"{LABEL_PREFIX}.role"  # a container of the run that is not a rank: "perseus" (its server)
LABEL_NODE = f"{LABEL_PREFIX}.node"
LABEL_RANK = f"{LABEL_PREFIX}.rank"
LABEL_NNODES = f"{LABEL_PREFIX}.nnodes"
LABEL_RUN_DIR = f"{LABEL_PREFIX}.run-dir"
LABEL_MASTER = f"{LABEL_PREFIX}.master"
LABEL_GRACE = f"{LABEL_PREFIX}.grace-period"
# On an image: it carries the worker's gate, so workers can start early and wait for the go-file.
# The label's value says where: images built before runner/agents/ existed carry "1"; from "3" on
# the image also carries torchrun with its exit barrier mended (runner/agents/torchrun.py), which
# the master runs (and the gate, for the workers).
LABEL_GATE = f"{LABEL_PREFIX}.gate"
GATE_MODULES = {"1": "runner.gate", "2": "runner.agents.gate", "3": "runner.agents.gate"}
TORCHRUN_MODULES = {"3": "runner.agents.torchrun"}

OUT = "/out"
SECRETS_IN_CONTAINER = "/run/runner/secrets.env"
GATE_IN_CONTAINER = "/run/runner/gate"   # read-only mount of the node's gate dir
UNPROBED = "<probed at launch>"


@dataclass(frozen=True)
class Facts:
    """What the runner learned from a node over SSH (check/up); all optional for dry-runs."""

    arch: str | None = None
    ifname: str | None = None   # interface whose route reaches the master address
    home: str | None = None     # to resolve `~` in workdir (docker mounts need absolute paths)
    gate: str | None = None     # the module of the gate the node's image carries (GATE_MODULES), if any
    torchrun: str | None = None  # the module of the mended torchrun it carries (TORCHRUN_MODULES), if any
    uid: int | None = None      # the SSH user's (`id -u`, `id -g`, `id -un`): containers run as uid:gid
    gid: int | None = None
    user: str | None = None
    src_ip: str | None = None   # the node's address toward the master (`ip route get`'s src): its /etc/hosts line
    hostname: str | None = None  # the node's own (host_name): its containers' too, answered by their /etc/hosts


@dataclass
class NodePlan:
    node: str
    host: str
    rank: int
    arch: str | None
    image: str | None
    container: str
    labels: dict[str, str]
    command: list[str]            # container command (argv); never holds a secret
    env: dict[str, str]           # non-secret env, set on the container
    secret_keys: list[str]        # names only; values travel in a 0600 file
    workdir: str
    run_dir: str                  # on the node; mounted as /out
    secrets_file: str | None      # on the node; mounted read-only at SECRETS_IN_CONTAINER
    config_file: str | None       # on the node (inside run_dir)
    gpus: int | str | None = None
    # container path -> node path: keyed by where it appears (unique: job_data.check_destinations),
    # so two mount points of one node path (two syncs of equal contents) stay two mounts
    mounts: dict[str, str] = field(default_factory=dict)
    writable: frozenset[str] = frozenset({OUT})  # container paths mounted read-write; the rest read-only
    user: str | None = None       # "uid:gid" the container runs as: the SSH user's; None: the image's (root SSH)
    go_file: str | None = None    # on the node: written once the master listens (gated workers)
    cpus: float | None = None     # the node's limits (inventory cpus/memory) on the job's container
    memory: str | None = None
    # name -> address of the job's nodes, the container's /etc/hosts lines (`hosts_of`)
    hosts: dict[str, str] = field(default_factory=dict)
    own_host: tuple[str, str] | None = None  # (the node's hostname, its address): the first of those lines

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def data_dsts(self) -> set[str]:
        """Mount points of the job's data (job.sync, job.mounts), not the runner's own."""
        return {d for d in self.mounts if d != OUT and not d.startswith("/run/runner")}

    @property
    def limits(self) -> str:
        """As the plan shows them: `cpus=0.5 memory=4g`, or `none`."""
        parts = ([f"cpus={self.cpus:g}"] if self.cpus else []) + ([f"memory={self.memory}"] if self.memory else [])
        return " ".join(parts) or "none"


@dataclass
class Plan:
    run_id: str
    nnodes: int
    master: str
    master_addr: str
    master_port: int | str
    nproc_per_node: dict[str, int]
    nodes: list[NodePlan]
    grace_period: float
    config_src: str | None
    env_file_src: str | None

    def node(self, name: str) -> NodePlan:
        return next(n for n in self.nodes if n.node == name)

    def render(self) -> str:
        """Human-readable plan; secret values never appear (only their names, masked). Each line as
        `cat -v` shows it: an inventory value's escape or newline is seen, not acted on or split."""
        lines = [f"run {self.run_id}: {self.nnodes} node(s), master {self.master} "
                 f"({self.master_addr}:{self.master_port}), static rendezvous"]
        if self.config_src:
            lines.append(f"  config {self.config_src} -> <run dir>/config.yaml on every node")
        if self.env_file_src:
            lines.append(f"  env_file {self.env_file_src} -> 0600 file on every node (values masked)")
        if any("torchrun" in n.command for n in self.nodes):  # the image's label is read at launch
            lines.append(f"  launch images labelled {LABEL_GATE}=3 (this project's) run `torchrun` as `python -m "
                         f"{TORCHRUN_MODULES['3']}` (exit barrier mended), workers behind `python -m "
                         f"{GATE_MODULES['3']}` until the master listens")
        for n in self.nodes:
            lines.append(f"[{n.node}/{n.rank}] {n.host}  arch={n.arch or UNPROBED}  image={n.image or UNPROBED}")
            lines.append(f"    container {n.container}  network=host  user={n.user or 'image default'}  "
                         f"gpus={n.gpus or 'none'}  limits {n.limits}")
            lines.append(f"    run dir   {n.run_dir} -> {OUT}")
            for dst, src in n.mounts.items():
                if dst in n.data_dsts:
                    lines.append(f"    mount     {src} -> {dst} ({'rw' if dst in n.writable else 'ro'})")
            lines.append(f"    command   {shlex.join(n.command)}")
            for k, v in sorted(masked(n.env).items()):
                lines.append(f"    env       {k}={v}" + ("  (looks like a secret: use env_file)" if v == MASK else ""))
            for k in n.secret_keys:
                lines.append(f"    env       {k}={MASK}  (from env_file)")
        return "\n".join(visible(ln) for ln in lines)

    def as_dict(self) -> dict:
        """For display (JSON): secret-looking values masked as in render()."""
        return {"run_id": self.run_id, "nnodes": self.nnodes, "master": self.master,
                "master_addr": self.master_addr, "master_port": self.master_port,
                "nodes": [{"node": n.node, "rank": n.rank, "host": n.host, "arch": n.arch, "image": n.image,
                           "container": n.container, "command": n.command, "env": masked(n.env),
                           "secret_keys": n.secret_keys, "run_dir": n.run_dir, "labels": n.labels,
                           "cpus": n.cpus, "memory": n.memory, "user": n.user}
                          for n in self.nodes]}


def docker_limits(cpus: float | None, memory: str | None) -> dict:
    """docker SDK create() arguments for a node's limits (Docker --cpus is nano_cpus / 1e9)."""
    out: dict = {}
    if cpus:
        out["nano_cpus"] = int(round(cpus * 1e9))
    if memory:
        out["mem_limit"] = memory
    return out


def masked(env: dict[str, str]) -> dict[str, str]:
    """env with the values of secret-looking names (TOKEN, SECRET, PASSWORD, KEY, ...) masked."""
    return {k: MASK if looks_secret(k) else v for k, v in env.items()}


def container_name(run_id: str, node: str) -> str:
    return f"runner-{run_id}-{node}"


def torchrun_command(inv: Inventory, nnodes: int, rank: int, nproc: int, master_addr: str,
                     master_port: int | str, has_config: bool) -> list[str]:
    return torchrun_argv(inv.job, nnodes, rank, nproc, master_addr, master_port,
                         f"{OUT}/config.yaml" if has_config else None, list(inv.job.args))


def launch_command(f: Facts, torchrun: list[str], go_file: str | None, gate_timeout: float) -> list[str]:
    """A rank's command: the gate in front of torchrun's arguments for a worker that waits for
    its go-file, else the image's mended torchrun where it has one, else `torchrun` as given."""
    if go_file:
        return ["python", "-m", f.gate, go_file, str(int(gate_timeout)), "--", *torchrun[1:]]
    if f.torchrun:
        return ["python", "-m", f.torchrun, *torchrun[1:]]
    return torchrun


def with_secrets(argv: list[str]) -> list[str]:
    """argv run with the job's env_file sourced inside the container: secrets never appear in argv,
    `docker inspect` or logs."""
    return ["/bin/sh", "-c", f'set -a; . {SECRETS_IN_CONTAINER}; set +a; exec "$@"', "runner-env", *argv]


def make_plan(inv: Inventory, run_id: str, facts: dict[str, Facts] | None = None,
              master_port: int | None = None, secret_keys: list[str] | None = None,
              strict: bool = False, launch_token: str | None = None, gate_timeout: float = 300,
              trees: list | None = None, direct: bool = False) -> Plan:
    """strict=True (a real launch) demands every probed fact; dry-runs show placeholders.
    launch_token (one per launch) turns on the gate for workers whose image has it.
    trees: job.sync's scanned sources (runner/delivery/sync.py Tree), mounted read-only.
    direct: a node of one process runs it without torchrun (jobspec.direct_argv)."""
    facts = facts or {}
    nodes = inv.ordered()
    nnodes = len(nodes)
    master = nodes[0]
    job = inv.job
    port: int | str = master_port if master_port is not None else job.master_port
    if port == "auto":
        port = "<auto>"  # a free port on the master, picked at launch
    if strict and not isinstance(port, int):
        raise UserError("master_port 'auto' was not resolved before launch (internal error)")
    secret_keys = sorted(secret_keys or [])
    plans: list[NodePlan] = []
    nproc = {n.name: job.nproc_per_node or n.slots for n in nodes}
    hosts = hosts_of(nodes, facts)
    for rank, node in enumerate(nodes):
        f = facts.get(node.name, Facts())
        arch = node.arch or f.arch
        image = job.image_for(arch)
        if strict:
            if not arch:
                raise UserError(f"{inv.path}:{node.line}: node {node.name}: arch unknown (not in inventory, not probed)")
            if not image:
                raise UserError(f"{inv.path}: job.image: no image for arch {arch} (node {node.name}); add `{arch}: <tag>`")
            if not f.ifname:
                raise UserError(f"node {node.name}: no interface routes to master {master.rank_addr} "
                                f"(`ip route get {master.rank_addr}` failed on the node)")
        paths = node_paths(node, f.home)
        workdir, run_dir = paths.workdir, paths.run(run_id)
        ifname = f.ifname or UNPROBED
        # torchrun's signal handling (runner/planning/jobspec.py); defaults: user env may override.
        env = {**signal_env(job.grace_period), **user_env(f), **job.env, **node.env}
        # The contract with the trainer (docs/contract.md); set last so user env cannot break it.
        env.update({
            "RUN_ID": run_id, "NODE_NAME": node.name, "NODE_RANK": str(rank), "NNODES": str(nnodes),
            "MASTER_ADDR": master.rank_addr, "MASTER_PORT": str(port), "OUTPUT_DIR": OUT,
            "GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname, "PYTHONUNBUFFERED": "1",
        })
        for k in secret_keys:
            env.pop(k, None)  # the env_file wins, and its value must not sit in container config
        tr = torchrun_command(inv, nnodes, rank, nproc[node.name], master.rank_addr, port, bool(job.config))
        secrets_file = paths.secrets(run_id) if secret_keys else None
        mounts = {OUT: run_dir}
        for t in trees or []:
            mounts[t.spec.dst] = t.mount_source(paths)
        for m in job.mounts:
            mounts[m.dst] = paths.on_node(m.node_path, f.home)
        go_file = None
        if rank > 0 and f.gate and launch_token:
            # Started with the master, not after it: the gate imports torchrun meanwhile and
            # starts it only when the runner, having seen the master's port listen, writes go_file.
            gate_dir = paths.gates(run_id)
            go_file = f"{gate_dir}/go-{launch_token}"
            mounts[GATE_IN_CONTAINER] = gate_dir
        if direct and nproc[node.name] == 1:
            tr = direct_argv(job, f"{OUT}/config.yaml" if job.config else None, list(job.args))
        else:
            tr = launch_command(f, tr, go_file and f"{GATE_IN_CONTAINER}/go-{launch_token}", gate_timeout)
        if secrets_file:
            mounts[SECRETS_IN_CONTAINER] = secrets_file
        command = with_secrets(tr) if secrets_file else tr
        labels = {LABEL_RUN: run_id, LABEL_NODE: node.name, LABEL_RANK: str(rank), LABEL_NNODES: str(nnodes),
                  LABEL_RUN_DIR: run_dir, LABEL_MASTER: master.name, LABEL_GRACE: str(job.grace_period)}
        plans.append(NodePlan(
            node=node.name, host=node.host, rank=rank, arch=arch, image=image,
            container=container_name(run_id, node.name), labels=labels, command=command, env=env,
            secret_keys=secret_keys, workdir=workdir, run_dir=run_dir, secrets_file=secrets_file,
            config_file=f"{run_dir}/config.yaml" if job.config else None, gpus=node.gpus, mounts=mounts,
            go_file=go_file, cpus=node.cpus, memory=node.memory, user=container_user(node, f, strict), hosts=hosts,
            own_host=own_host(node, f), writable=frozenset({OUT, *(m.dst for m in job.mounts if m.rw)})))
    return Plan(run_id=run_id, nnodes=nnodes, master=master.name, master_addr=master.rank_addr, master_port=port,
                nproc_per_node=nproc, nodes=plans, grace_period=job.grace_period,
                config_src=job.config, env_file_src=job.env_file)


def hosts_of(nodes: list[Node], facts: dict[str, Facts]) -> dict[str, str]:
    """Every job node's address under its name, for the containers' /etc/hosts. torch's c10d looks up
    the name of each store connection's address (socket.cpp: "The hostname of the client socket
    cannot be retrieved"); with no DNS server in reach (Pis on a bare switch, a sealed subnet, the
    namespaced sandbox) each lookup waits out the resolver: 10 s (5 s x 2 tries) per connection, on
    the path to every first step. A line in /etc/hosts answers it at once. Addresses are the nodes'
    own (the probe's `src`), else the inventory's when it is an IP literal; names made hostname-safe.
    `extra_hosts` writes them as Docker takes them."""
    out: dict[str, str] = {}
    for n in nodes:
        addr = facts.get(n.name, Facts()).src_ip or ip_literal(n.rank_addr)
        name = re.sub(r"[^A-Za-z0-9.-]", "-", n.name).strip(".-")[:63]
        if addr and name and name not in out:
            out[name] = addr
    return out


def own_host(node: Node, f: Facts) -> tuple[str, str] | None:
    """The node's hostname and address, for its containers' /etc/hosts. With host networking a
    container has the node's hostname, and torchrun's agent looks it up for every event it records
    (socket.getfqdn(): torch/distributed/elastic/agent/server/api.py _get_fq_hostname). Docker writes
    the file itself once given extra lines, without the hostname, and with no DNS server in reach
    each lookup waited out the resolver: 10 s, several times before the first step (22.8 s from a
    container's start to its trainer's, measured on the namespaced sandbox; 2.4 s answered here).
    None: the hostname was not probed (a dry-run), or it is one Docker's own lines answer (localhost,
    ip6-*: it must stay the loopback inside the container)."""
    host = f.hostname
    if not host or host.lower().split(".")[0] == "localhost" or host.lower().startswith("ip6-"):
        return None
    return host, f.src_ip or ip_literal(node.rank_addr) or "127.0.1.1"  # Debian's line for its own name


def host_name(text: str) -> str | None:
    """A hostname a node reported, or None where it is not one (RFC 1123 characters, at most 253):
    it becomes a line of the node's containers' /etc/hosts."""
    return text if re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", text) else None


def extra_hosts(hosts: dict[str, str], own: tuple[str, str] | None = None) -> list[str]:
    """Docker's `name:address` lines for `hosts`, after the node's `own` (hostname, address): glibc
    takes the first line that matches. An IPv4 address twice: c10d's sockets are IPv6 ones holding
    IPv4-mapped addresses (::ffff:a.b.c.d), which glibc looks up as IPv6 and so never matches
    against an IPv4 line of /etc/hosts (seen on the namespaced sandbox: a PTR query despite the line)."""
    out = []
    for name, addr in ([own] if own else []) + list(hosts.items()):
        out.append(f"{name}:{addr}")
        if ipaddress.ip_address(addr).version == 4:
            out.append(f"{name}:::ffff:{addr}")
    return out


def ip_literal(text: str) -> str | None:
    """`text` as an IP address, or None (a name, or anything a node said that is not one)."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


# HOME of a container run as a non-root SSH user: the image has no passwd entry for its uid, so
# Docker would give it HOME=/ (not writable); caches (torch, Triton, HF, matplotlib) go under ~.
CONTAINER_HOME = "/tmp"


def container_user(node: Node, f: Facts, strict: bool) -> str | None:
    """What the node's container runs as: the SSH user's uid:gid, so whatever the run writes on
    the node is the user's (it can copy into it on resume, remove it); None for root, which keeps
    the image's own user. A dry-run shows it unprobed (unless the inventory's user is root); a
    launch whose probe could not tell (no `id` on the node) keeps the image's user."""
    if f.uid is None or f.gid is None:
        return None if strict or node.user == "root" else UNPROBED
    return None if f.uid == 0 else f"{f.uid}:{f.gid}"


def user_env(f: Facts) -> dict[str, str]:
    """Defaults (the job's env may override them) for a non-root container: a writable HOME, and
    USER, which getpass (torch's compile caches) needs when the uid has no passwd entry."""
    if not f.uid:
        return {}
    return {"HOME": CONTAINER_HOME, "USER": f.user or str(f.uid)}


def render_secrets_file(secrets: dict[str, str]) -> str:
    """Shell-quoted KEY='value' lines, sourced with `set -a` inside the container."""
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in sorted(secrets.items()))
