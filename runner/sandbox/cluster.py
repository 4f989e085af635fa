"""The sandbox cluster: N "nodes" on this machine, each a real sshd on its own loopback address
plus its own dockerd (own data root, exec root, socket, pidfile; no bridge).

Node i listens on 127.0.0.(11+i):PORT. Its sshd sets DOCKER_HOST for every session, so
`docker ...` run over SSH on node i (and the docker SDK's ssh dial-stdio) reaches node i's engine
and no other: an image loaded on node 1 is absent on node 2. Each node has its own workdir.
Host keys (ed25519 and ECDSA, as a stock sshd has) are generated per node and the ed25519 ones
written to a known_hosts file, so clients verify them instead of auto-accepting. The sshd keeps a
real sshd's session limits (MaxSessions 10), so the runner is held to them here too.

`--light` nodes (for measuring many nodes) are an sshd only: no engine of their own, their
sessions talk to this machine's engine (runner/delivery/host_engine.py), whose containers the runner tells
apart by their node label. Up to MAX_LIGHT_NODES of them.

`--user NAME` nodes log in as a non-root account, as a Raspberry Pi's `pi` does: the account is
made if missing (home, bash, no password, no sudo) and kept by `down` (`userdel -r NAME` removes
it). Each node's dockerd serves its socket to NAME's primary group (dockerd --group), the way a
Pi's engine serves the `docker` group, and sshd refuses root. The account cannot reach the state
dir (the tests keep it in a 0700 tmp dir), so what it must read or own lives in its home:
`~NAME/runner-sandbox-<tag>/` holds the authorized key and one workdir per node; `down` removes
that dir (as root here, so files a container wrote as root go too).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import psutil
import yaml

from runner.core.errors import UserError
from runner.sandbox.accounts import engine_group, ensure_account
from runner.sandbox.defaults import DEFAULT_BASE_ADDR, DEFAULT_PORT, ROOT  # noqa: F401 - their names here too
from runner.sandbox.net import SandboxNet, parse_shape
from runner.sandbox.node import SandboxNode
from runner.sandbox.processes import (
    is_proc,
    port_free,
    processes_mentioning,
    read_pid,
    remove_stale_pid,
    run,
    terminate,
    terminate_tree,
    unmount_below,
)

log = logging.getLogger("runner.sandbox")

MAX_NODES = 16
MAX_LIGHT_NODES = 128
# Light nodes measure the runner, not this machine's login: bash sources ~/.bashrc for every
# command run over SSH unless SHLVL says it is nested, and root's here runs `pyenv init` (~100
# processes, 0.1-0.25 s per exec). Full nodes keep it: a real node's heavy bashrc costs as much.
LIGHT_ENV = " SHLVL=1"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
# useradd's own rule for a portable name (and what the inventory's `user` accepts).
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"


class Sandbox:
    """State lives in files under `state_dir`; every method can be re-run safely."""

    def __init__(self, state_dir: Path | str = ".sandbox", base_addr: str = DEFAULT_BASE_ADDR,
                 port: int = DEFAULT_PORT, light: bool = False, user: str = ROOT, user_dir: Path | None = None,
                 net: dict | None = None):
        self.state = Path(state_dir).resolve()
        # Nodes in their own network namespaces (runner/sandbox/net.py): {"link": RATE[,DELAY] or
        # None, "uplink": ...}; None: every node on this machine's loopback.
        self.net_spec = net
        self.base_addr = base_addr
        self.port = port
        self.light = light
        self.user = user
        self.tag = hashlib.sha1(str(self.state).encode()).hexdigest()[:8]
        self.run_root = Path("/run/runner-sandbox") / self.tag
        # --user: the sandbox's files the account reads or owns (set by up(), or from sandbox.yaml).
        self.user_dir = user_dir

    # ---- layout ---------------------------------------------------------------------------
    @property
    def user_key(self) -> Path:
        return self.state / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state / "known_hosts"

    @property
    def authorized_keys(self) -> Path:
        return self.state / "authorized_keys"

    @property
    def user_authorized_keys(self) -> Path | None:
        """--user: the key sshd reads AS the account (it drops to the user to open it)."""
        return self.user_dir / "authorized_keys" if self.user_dir else None

    @property
    def net(self) -> SandboxNet | None:
        return SandboxNet.for_state_dir(self.state) if self.net_spec is not None else None

    def node(self, i: int) -> SandboxNode:
        net = self.net
        addr = net.addr(i) if net else str(ipaddress.IPv4Address(self.base_addr) + i)
        return SandboxNode(i, addr, self.port, self.state / f"node-{i}", self.run_root / f"node-{i}", self.light,
                    self.user_dir / f"node-{i}" if self.user_dir else None)

    def existing_nodes(self) -> list[SandboxNode]:
        if not self.state.is_dir():
            return []
        idx = sorted(int(p.name.split("-")[1]) for p in self.state.glob("node-*") if p.name[5:].isdigit())
        meta = self._read_meta()
        base = meta.get("base_addr", self.base_addr)
        port = meta.get("port", self.port)
        sb = Sandbox(self.state, base, port, bool(meta.get("light", self.light)), meta.get("user", ROOT),
                     Path(meta["user_dir"]) if meta.get("user_dir") else None, meta.get("net"))
        return [sb.node(i) for i in idx]

    def _read_meta(self) -> dict:
        f = self.state / "sandbox.yaml"
        return (yaml.safe_load(f.read_text()) or {}) if f.exists() else {}

    # ---- up -------------------------------------------------------------------------------
    def up(self, n: int, inventory: Path | None, cpus: list[float] | None = None) -> list[SandboxNode]:
        """cpus: per node (Docker --cpus of the job's container, written into the inventory)."""
        self._check_args(n)
        meta = self._read_meta()
        if meta and (meta.get("base_addr"), meta.get("port"), bool(meta.get("light")), meta.get("user", ROOT),
                     meta.get("net") is not None) != (self.base_addr, self.port, self.light, self.user,
                                                     self.net_spec is not None):
            if any(self._node_running(nd) for nd in self.existing_nodes()):
                raise UserError(f"sandbox in {self.state} is running on {meta.get('base_addr')}:"
                                f"{meta.get('port')} as user {meta.get('user', ROOT)}"
                                f"{' in namespaces' if meta.get('net') is not None else ''}; run 'runner sandbox "
                                "down' before changing address/port/--light/--user/--netns")
        account = ensure_account(self.user) if self.user != ROOT else None
        if account is not None:
            self.user_dir = Path(account.pw_dir) / f"runner-sandbox-{self.tag}"
        nodes = [self.node(i) for i in range(n)]
        net = self.net
        fresh = not any(self._node_running(nd) for nd in self.existing_nodes())
        if net is not None:  # (re)made and (re)shaped before any node starts; safe to re-run
            net.create(n, self.net_spec.get("link"), self.net_spec.get("uplink"))
        # Check every address before starting anything, so a taken one leaves nothing running.
        for nd in nodes if net is None else []:  # (a node's own namespace has nothing else in it)
            if not self._sshd_alive(nd) and not port_free(nd.addr, nd.port):
                raise UserError(f"{nd.addr}:{nd.port} ({nd.name}) is already in use by another process; "
                                "pick another --base-addr or --port")
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "sandbox.yaml").write_text(yaml.safe_dump(
            {"base_addr": self.base_addr, "port": self.port, **({"light": True} if self.light else {}),
             **({"user": self.user, "user_dir": str(self.user_dir)} if account else {}),
             **({"net": self.net_spec} if self.net_spec is not None else {})}))
        self._ensure_user_key()
        if account is not None:
            self._ensure_user_files(account, nodes)
        started: list[SandboxNode] = []
        try:
            for nd in nodes:
                # Counted as started BEFORE _start_node: if its sshd fails after its dockerd came
                # up, the rollback must stop that dockerd too. A node that was already fully
                # running before this call is left alone.
                if not (self._sshd_alive(nd) and (nd.light or self._docker_alive(nd))):
                    started.append(nd)
                self._start_node(nd)
            for nd in nodes:
                self._wait_ready(nd)
        except BaseException:
            for nd in started:
                self._stop_node(nd)
            if net is not None and fresh:  # nothing of this sandbox ran before: nothing of it is left
                net.destroy()
            raise
        # Nodes beyond N from an earlier, larger sandbox are stopped (their data is kept).
        for nd in self.existing_nodes():
            if nd.index >= n:
                self._stop_node(nd)
        self._write_known_hosts(nodes)
        if inventory is not None:
            write_inventory(Path(inventory), nodes, self, cpus)
        return nodes

    def _check_args(self, n: int) -> None:
        """Every option checked, one line each, before anything is made."""
        most = MAX_LIGHT_NODES if self.light else MAX_NODES
        if n < 1 or n > most:
            raise UserError(f"--nodes must be between 1 and {most}{' for --light nodes' if self.light else ''} (got {n})")
        try:
            base = ipaddress.IPv4Address(self.base_addr)
        except ValueError:
            raise UserError(f"--base-addr {self.base_addr!r} is not an IPv4 address") from None
        if self.net_spec is not None:
            if self.light:
                raise UserError("--link/--uplink/--netns are for full nodes: --light nodes share this machine's engine")
            for what in ("link", "uplink"):  # one line for a bad RATE[,DELAY], before anything starts
                if self.net_spec.get(what):
                    parse_shape(self.net_spec[what], f"--{what}")
        elif base not in ipaddress.IPv4Network("127.0.0.0/8") or int(base) + n - 1 > int(
                ipaddress.IPv4Address("127.255.255.254")):
            raise UserError(f"--base-addr {self.base_addr} must leave {n} addresses inside 127.0.0.0/8 "
                            "(sandbox traffic stays on loopback)")
        if not 1 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a TCP port")
        for tool in (SSHD, DOCKERD, "ssh-keygen"):
            if not shutil.which(tool) and not os.path.exists(tool):
                raise UserError(f"{tool} not found: run scripts/setup.sh (installs openssh-server, docker.io)")
        if self.user != ROOT:
            if self.light:
                raise UserError("--user is for full nodes: --light nodes share this machine's engine")
            if not USER_RE.fullmatch(self.user):
                raise UserError(f"--user {self.user!r}: not a user name (lower-case letters, digits, '_', '-'; "
                                "at most 32; not starting with a digit or '-')")

    def _ensure_user_key(self) -> None:
        if not self.user_key.exists():
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "runner-sandbox-user",
                  "-f", str(self.user_key)])
        self.authorized_keys.write_text(Path(f"{self.user_key}.pub").read_text())
        os.chmod(self.authorized_keys, 0o600)

    def _ensure_user_files(self, account: pwd.struct_passwd, nodes: list[SandboxNode]) -> None:
        """The account's own: its sandbox dir, the authorized key (0600) and each node's workdir."""
        uid, gid = account.pw_uid, account.pw_gid
        for d in (self.user_dir, *(nd.workdir for nd in nodes)):
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, uid, gid)
        keys = self.user_authorized_keys
        keys.write_text(Path(f"{self.user_key}.pub").read_text())
        os.chown(keys, uid, gid)
        os.chmod(keys, 0o600)

    def _start_node(self, nd: SandboxNode) -> bool:
        """Start what is not running; True if anything was started."""
        for d in (nd.root, nd.workdir, nd.run) + (() if nd.light else (nd.data_root, nd.exec_root)):
            d.mkdir(parents=True, exist_ok=True)  # (--user: made and chowned by _ensure_user_files)
        for kind, key in (("ed25519", nd.host_key), ("ecdsa", nd.host_key_ecdsa)):
            if not key.exists():
                run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", f"runner-sandbox-{nd.name}", "-f", str(key)])
        started = False
        if not nd.light and not self._docker_alive(nd):
            remove_stale_pid(nd.docker_pid)
            logf = open(nd.root / "dockerd.log", "ab")
            subprocess.Popen(
                [*self._in_node(nd), DOCKERD, "--host", nd.docker_host, "--data-root", str(nd.data_root),
                 "--exec-root", str(nd.exec_root), "--pidfile", str(nd.docker_pid),
                 "--bridge", "none", "--iptables=false", "--ip-masq=false",
                 "--containerd-namespace", f"sandbox-{nd.name}",
                 "--containerd-plugins-namespace", f"sandbox-{nd.name}-plugins",
                 # --user: the socket is the account's group's (0660), as a Pi's is the docker group's.
                 *(["--group", engine_group(self.user)] if self.user != ROOT else [])],
                stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, start_new_session=True)
            started = True
        if not self._sshd_alive(nd):
            # sshd starts with any one loadable host key; the sandbox's known_hosts records the
            # ed25519 one, so an unreadable ed25519 key is a node nobody could verify.
            check = subprocess.run(["ssh-keygen", "-y", "-f", str(nd.host_key)], capture_output=True, text=True)
            if check.returncode != 0:
                raise UserError(f"{SSHD} -f failed: host key {nd.host_key} is unreadable "
                                f"({(check.stderr.strip().splitlines() or ['?'])[-1]}); remove it for a new one")
            remove_stale_pid(nd.sshd_pid)
            nd.sshd_config.write_text(_sshd_config(nd, self.user_authorized_keys or self.authorized_keys,
                                                   root_login=self.user == ROOT))
            Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation dir sshd insists on
            run([*self._in_node(nd), SSHD, "-f", str(nd.sshd_config), "-E", str(nd.root / "sshd.log")])
            started = True
        return started

    def _listening(self, nd: SandboxNode) -> bool:
        """Its sshd accepts connections: bound here on loopback; in a namespace, reached over the bridge."""
        if self.net_spec is None:
            return not port_free(nd.addr, nd.port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            return s.connect_ex((nd.addr, nd.port)) == 0

    def _in_node(self, nd: SandboxNode) -> list[str]:
        """argv prefix running a node's daemon inside its network namespace (none on loopback)."""
        net = self.net
        return net.exec_prefix(nd.index) if net is not None else []

    def set_link(self, name: str, up: bool) -> None:
        """`runner sandbox link NODE down|up`: a real partition of one node (its processes run on)."""
        net = self.net_of_meta()
        if net is None:
            raise UserError(f"sandbox in {self.state}: its nodes share this machine's loopback and have no link "
                            "to cut; start it with --netns (or --link/--uplink)")
        nd = next((x for x in self.existing_nodes() if x.name == name), None)
        if nd is None:
            known = ", ".join(x.name for x in self.existing_nodes()) or "none"
            raise UserError(f"sandbox in {self.state}: no node named {name!r} (nodes: {known})")
        net.set_link(nd.index, up)

    def net_of_meta(self) -> SandboxNet | None:
        return SandboxNet.for_state_dir(self.state) if self._read_meta().get("net") is not None else None

    def _wait_ready(self, nd: SandboxNode, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._sshd_alive(nd) and self._listening(nd) and (nd.light or self._docker_alive(nd)):
                return
            time.sleep(0.25)
        raise UserError(f"{nd.name} did not come up within {timeout:.0f} s "
                        f"(see {nd.root}/sshd.log and {nd.root}/dockerd.log)")

    def _write_known_hosts(self, nodes: list[SandboxNode]) -> None:
        lines = []
        for nd in nodes:
            kind, key = Path(f"{nd.host_key}.pub").read_text().split()[:2]
            lines.append(f"[{nd.addr}]:{nd.port} {kind} {key}\n")
        self.known_hosts.write_text("".join(lines))

    # ---- down -----------------------------------------------------------------------------
    def down(self) -> list[str]:
        from concurrent.futures import ThreadPoolExecutor

        nodes = self.existing_nodes()
        # Each node's engine takes seconds to stop (its containers, then a SIGTERM grace): side by
        # side, a cluster goes down in one node's time (one after the other, a suite's teardown
        # of its clusters took minutes).
        with ThreadPoolExecutor(max_workers=max(1, min(len(nodes), 16))) as pool:
            stopped = [nd.name for nd, did in zip(nodes, pool.map(self._stop_node, nodes), strict=True) if did]
        for parent in {nd.run.parent for nd in nodes}:
            with contextlib.suppress(OSError):
                parent.rmdir()  # the sandbox's own dir under /run, once its nodes are gone
        # --user: the workdirs in the account's home (as root: files a container wrote as root go
        # too). The account itself is kept: another sandbox may be using it.
        user_dir = self._read_meta().get("user_dir")
        if user_dir and Path(user_dir).name.startswith("runner-sandbox-"):
            shutil.rmtree(user_dir, ignore_errors=True)
        net = self.net_of_meta()
        if net is not None:  # every namespace, veth, bridge and qdisc it made
            net.destroy()
        return stopped

    def _stop_node(self, nd: SandboxNode) -> bool:
        did = False
        if self._docker_alive(nd):
            # Containers first: a stopped engine would leave their shims behind.
            ids = subprocess.run(["docker", "-H", nd.docker_host, "ps", "-aq"], capture_output=True,
                                 text=True).stdout.split()
            if ids:
                subprocess.run(["docker", "-H", nd.docker_host, "rm", "-f", *ids], capture_output=True)
        for pidfile in (nd.sshd_pid, nd.docker_pid):
            pid = read_pid(pidfile)
            if pid and psutil.pid_exists(pid):
                did = True
                terminate_tree(pid)
            remove_stale_pid(pidfile)
        # Anything still holding the node's files (containerd, shims, session children).
        for proc in processes_mentioning(str(nd.root), str(nd.run)):
            did = True
            terminate(proc.pid)
        # Its socket and exec-root dir under /run: nothing uses them now (they piled up, one per
        # sandbox ever started). An engine that ran containers leaves its netns bind-mounted there.
        unmount_below(nd.run)
        shutil.rmtree(nd.run, ignore_errors=True)
        return did

    # ---- status ---------------------------------------------------------------------------
    def status(self) -> list[dict]:
        rows = []
        net = self.net_of_meta()
        links = {x["node"]: x for x in net.status()["nodes"]} if net is not None else {}
        for nd in self.existing_nodes():
            row = {"node": nd.name, "address": f"{nd.addr}:{nd.port}", "user": self._read_meta().get("user", ROOT),
                   "sshd": self._sshd_alive(nd),
                   "dockerd": "shared" if nd.light else self._docker_alive(nd), "images": None, "containers": None,
                   "workdir": str(nd.workdir)}
            if net is not None:
                ln = links.get(nd.index, {})
                row["link"] = ln.get("link", "missing")
                row["shaping"] = ln.get("to_node")
            if row["dockerd"] is True:
                out = subprocess.run(["docker", "-H", nd.docker_host, "info", "--format",
                                      "{{.Images}} {{.ContainersRunning}}"], capture_output=True, text=True)
                if out.returncode == 0 and out.stdout.split():
                    row["images"], row["containers"] = (int(x) for x in out.stdout.split()[:2])
            rows.append(row)
        return rows

    # ---- liveness -------------------------------------------------------------------------
    def _node_running(self, nd: SandboxNode) -> bool:
        return self._sshd_alive(nd) or self._docker_alive(nd)

    @staticmethod
    def _sshd_alive(nd: SandboxNode) -> bool:
        pid = read_pid(nd.sshd_pid)
        return bool(pid and psutil.pid_exists(pid) and is_proc(pid, "sshd"))

    @staticmethod
    def _docker_alive(nd: SandboxNode) -> bool:
        pid = read_pid(nd.docker_pid)
        if not (pid and psutil.pid_exists(pid) and is_proc(pid, "dockerd")):
            return False
        return subprocess.run(["docker", "-H", nd.docker_host, "version", "--format", "{{.Server.Version}}"],
                              capture_output=True).returncode == 0


def write_inventory(path: Path, nodes: list[SandboxNode], sb: Sandbox, cpus: list[float] | None = None) -> None:
    """The inventory `runner` consumes for the sandbox: real SSH, verified host keys."""
    doc = {
        # ssh_config none: the sandbox's own nodes; a user's `Host *` ProxyJump must not apply.
        "defaults": {"user": sb.user, "port": sb.port, "identity_file": str(sb.user_key),
                     "known_hosts": str(sb.known_hosts), "ssh_config": "none"},
        "nodes": [{"name": nd.name, "host": nd.addr, "arch": "amd64", "workdir": str(nd.workdir),
                   **({"role": "master"} if nd.index == 0 else {}),
                   **({"cpus": cpus[nd.index]} if cpus else {})} for nd in nodes],
        # The Pi experiment at sandbox size, with the guide's own flags.
        "job": {"image": "runner-trainer:latest", "config": "configs/pi-qwen3-3stage-tiny.yaml",
                "args": ["--train_steps", "5", "--batch_size", "16", "--microbatch_num", "4",
                         "--profile_batch", "1"],
                "env": {"OMP_NUM_THREADS": "1"}, "master_port": "auto"},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    where = "own network namespace and address" if sb.net_spec is not None else "own loopback address"
    header = ("# Sandbox cluster inventory, written by `runner sandbox up`: each node is an sshd on its\n"
              f"# {where} with its own dockerd. Re-running `runner sandbox up` rewrites it.\n")
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120))


def _sshd_config(nd: SandboxNode, authorized_keys: Path, root_login: bool = True) -> str:
    return f"""# sandbox {nd.name}: written by runner sandbox
ListenAddress {nd.addr}:{nd.port}
HostKey {nd.host_key}
HostKey {nd.host_key_ecdsa}
PidFile {nd.sshd_pid}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin {"prohibit-password" if root_login else "no"}
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AllowTcpForwarding yes
AllowStreamLocalForwarding yes
StreamLocalBindUnlink yes
MaxStartups 64:30:128
SetEnv DOCKER_HOST={nd.docker_host} SANDBOX_NODE={nd.name}{LIGHT_ENV if nd.light else ""}
Subsystem sftp internal-sftp
"""


