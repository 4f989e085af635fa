"""A real Slurm cluster on this machine: munged, slurmctld and N `slurmd -N node-i`, plus a login
node (an sshd) from which `runner up --scheduler slurm` submits, as on a site's login host.

Debian's slurm-wlm is built with multiple-slurmd support, so N slurmd daemons on distinct ports
are N nodes to slurmctld: jobs get real allocations, `srun` steps, signals, requeues. Node i's
NodeAddr is a loopback address of its own (what the batch script gives torchrun as MASTER_ADDR);
all nodes share this machine's filesystem, which stands for a cluster's shared filesystem.

Everything lives under `<sandbox dir>/slurm` (config, munge key, spool, state, logs, the shared
workdir) and `/run/runner-slurm/<tag>` (munge socket, pid files; unix socket paths are short).
Every daemon is started with RUNNER_SLURM_SANDBOX=<state> in its environment, so `down` finds
everything of this cluster, job steps included, and leaves nothing running.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from runner.core.errors import UserError
from runner.sandbox.defaults import DEFAULT_SLURM_BASE_ADDR
from runner.sandbox.processes import port_free, read_pid

FIRST_DAEMON_PORT = 16817
MARKER = "RUNNER_SLURM_SANDBOX"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


@dataclass(frozen=True)
class SlurmLayout:
    state: Path   # <sandbox dir>/slurm
    run: Path     # /run/runner-slurm/<tag>

    @property
    def conf(self) -> Path:
        return self.state / "etc" / "slurm.conf"

    @property
    def munge_key(self) -> Path:
        return self.state / "munge" / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.run / "munge.sock"

    @property
    def shared(self) -> Path:
        """The 'shared filesystem': the runner's workdir for Slurm runs."""
        return self.state / "shared"

    @property
    def user_key(self) -> Path:
        return self.state / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state / "known_hosts"

    @property
    def host_key(self) -> Path:
        return self.state / "login" / "ssh_host_ed25519_key"

    @property
    def sshd_pid(self) -> Path:
        return self.run / "sshd.pid"

    @property
    def meta(self) -> Path:
        return self.state / "cluster.yaml"


class SlurmSandbox:
    def __init__(self, sandbox_dir: Path | str = ".sandbox", base_addr: str = DEFAULT_SLURM_BASE_ADDR,
                 port: int = 2222):
        state = Path(sandbox_dir).resolve() / "slurm"
        tag = hashlib.sha1(str(state).encode()).hexdigest()[:8]
        self.lay = SlurmLayout(state, Path("/run/runner-slurm") / tag)
        self.base_addr = base_addr
        self.port = port

    # ---- facts ------------------------------------------------------------------------------
    def read_meta(self) -> dict:
        return (yaml.safe_load(self.lay.meta.read_text()) or {}) if self.lay.meta.exists() else {}

    def env(self) -> dict[str, str]:
        """What every Slurm client and daemon of this cluster runs with."""
        return {**os.environ, "SLURM_CONF": str(self.lay.conf), MARKER: str(self.lay.state)}

    def running(self) -> bool:
        return bool(_marked_processes(str(self.lay.state)))

    # ---- up ---------------------------------------------------------------------------------
    def up(self, n: int, inventory: Path | None, venv: str | None = None) -> dict:
        if not 1 <= n <= 16:
            raise UserError(f"--nodes must be between 1 and 16 for a Slurm sandbox (got {n})")
        for tool in (*TOOLS, "sshd", "ssh-keygen"):
            if not shutil.which(tool) and not os.path.exists(f"/usr/sbin/{tool}"):
                raise UserError(f"{tool} not found: run scripts/setup.sh (installs slurm-wlm, munge, openssh-server)")
        addrs = _addresses(self.base_addr, n)
        meta = self.read_meta()
        if self.running():
            if meta.get("nodes") == n and meta.get("base_addr") == self.base_addr and meta.get("port") == self.port:
                if inventory is not None:
                    write_slurm_inventory(inventory, self, meta, venv)
                return meta
            self.down()  # another size or address: start afresh (jobs of the old one are cancelled)
        if not port_free(addrs[0], self.port):
            raise UserError(f"{addrs[0]}:{self.port} (the Slurm login node) is already in use; "
                            "pick another --base-addr or --port")
        ports = _free_port_run(n + 1)
        meta = {"nodes": n, "base_addr": self.base_addr, "port": self.port, "login": addrs[0],
                "node_addrs": addrs[1:], "ctld_port": ports[0], "slurmd_ports": ports[1:],
                "hostname": socket.gethostname(), "conf": str(self.lay.conf), "shared": str(self.lay.shared)}
        self._prepare(meta)
        try:
            self._start(meta)
            self._wait_ready(n)
        except BaseException:
            self.down()
            raise
        self.lay.meta.write_text(yaml.safe_dump(meta, sort_keys=False))
        if inventory is not None:
            write_slurm_inventory(inventory, self, meta, venv)
        return meta

    def _prepare(self, meta: dict) -> None:
        lay = self.lay
        for d in (lay.state / "etc", lay.state / "state", lay.state / "log", lay.state / "login", lay.shared):
            d.mkdir(parents=True, exist_ok=True)
        for i in range(meta["nodes"]):
            (lay.state / "spool" / f"node-{i}").mkdir(parents=True, exist_ok=True)
        # munged insists: key dir 0700, key 0400; socket dir searchable by everyone.
        lay.munge_key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(lay.munge_key.parent, 0o700)
        if not lay.munge_key.exists():
            lay.munge_key.write_bytes(os.urandom(1024))
            os.chmod(lay.munge_key, 0o400)
        lay.run.mkdir(parents=True, exist_ok=True)
        for p in (lay.run, lay.run.parent):
            os.chmod(p, 0o755)
        lay.conf.write_text(slurm_conf(meta, lay))
        (lay.conf.parent / "oci.conf").write_text(oci_conf(lay))
        for key in (lay.user_key, lay.host_key):
            if not key.exists():
                _check(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "runner-slurm-sandbox", "-f", str(key)])
        (lay.state / "authorized_keys").write_text(Path(f"{lay.user_key}.pub").read_text())
        os.chmod(lay.state / "authorized_keys", 0o600)
        kind, key = Path(f"{lay.host_key}.pub").read_text().split()[:2]
        lay.known_hosts.write_text(f"[{meta['login']}]:{meta['port']} {kind} {key}\n")
        (lay.state / "login" / "sshd_config").write_text(login_sshd_config(meta, lay))

    def _start(self, meta: dict) -> None:
        lay, env = self.lay, self.env()
        log = lay.state / "log"
        _check(["munged", f"--key-file={lay.munge_key}", f"--socket={lay.munge_socket}",
                f"--pid-file={lay.run / 'munged.pid'}", f"--log-file={log / 'munged.log'}",
                f"--seed-file={lay.state / 'munge' / 'seed'}"], env)
        _check(["slurmctld", "-f", str(lay.conf)], env)
        for i in range(meta["nodes"]):
            _check(["slurmd", "-f", str(lay.conf), "-N", f"node-{i}"], env)
        Path("/run/sshd").mkdir(exist_ok=True)
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        _check([sshd, "-f", str(lay.state / "login" / "sshd_config"), "-E", str(log / "sshd.log")], env)

    def _wait_ready(self, n: int, timeout: float = 60.0) -> None:
        """Every node idle in slurmctld's eyes (registered), and the login node answering."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env())
            states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
            last = res.stderr.strip() or " ".join(f"{k}={v}" for k, v in sorted(states.items()))
            if len(states) == n and all(s == "idle" for s in states.values()) and not port_free(self.base_addr, self.port):
                return
            time.sleep(0.3)
        raise UserError(f"Slurm sandbox did not come up within {timeout:.0f} s ({last}); "
                        f"see {self.lay.state / 'log'}")

    # ---- down -------------------------------------------------------------------------------
    def down(self) -> bool:
        """Cancel every job, stop every daemon and job step of this cluster; True if any ran."""
        env = self.env()
        procs = _marked_processes(str(self.lay.state))
        if not procs:
            shutil.rmtree(self.lay.run, ignore_errors=True)
            return False
        ctld = read_pid(self.lay.run / "slurmctld.pid")
        if ctld and psutil.pid_exists(ctld) and shutil.which("scancel"):  # a dead one makes scancel wait
            subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                q = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.3)
        # Daemons first (slurmd would restart nothing, but stepds outlive it), then whatever is left:
        # job steps and their tasks carry no marker but are children of marked slurmstepds.
        procs = _marked_processes(str(self.lay.state))
        for proc in list(procs):
            with contextlib.suppress(psutil.Error):
                procs += proc.children(recursive=True)
        _stop_all(procs)
        shutil.rmtree(self.lay.run, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.lay.run.parent.rmdir()
        return True

    # ---- status -----------------------------------------------------------------------------
    def status(self) -> list[dict]:
        meta = self.read_meta()
        if not meta:
            return []
        if not self.running():
            return [{"node": f"node-{i}", "address": a, "state": "down"} for i, a in enumerate(meta["node_addrs"])]
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env())
        states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
        return [{"node": f"node-{i}", "address": a, "state": states.get(f"node-{i}", "unknown")}
                for i, a in enumerate(meta["node_addrs"])]


def _addresses(base: str, n: int) -> list[str]:
    try:
        b = ipaddress.IPv4Address(base)
    except ValueError:
        raise UserError(f"--base-addr {base!r} is not an IPv4 address") from None
    if b not in ipaddress.IPv4Network("127.0.0.0/8") or (b + n) not in ipaddress.IPv4Network("127.0.0.0/8"):
        raise UserError(f"--base-addr {base} must leave {n + 1} addresses inside 127.0.0.0/8 (traffic stays on loopback)")
    return [str(b + i) for i in range(n + 1)]


def _free_port_run(count: int, start: int = FIRST_DAEMON_PORT) -> list[int]:
    """`count` consecutive ports free on every address (slurmctld and slurmd bind 0.0.0.0)."""
    p = start
    while p + count < 30000:
        run = list(range(p, p + count))
        bad = next((q for q in run if not port_free("0.0.0.0", q)), None)
        if bad is None:
            return run
        p = bad + 1
    raise UserError(f"no {count} consecutive free TCP ports in {start}..30000 for the Slurm daemons")


def slurm_conf(meta: dict, lay: SlurmLayout) -> str:
    n = meta["nodes"]
    first, last = meta["node_addrs"][0], meta["node_addrs"][-1]
    ports = meta["slurmd_ports"]
    addr_range = first if n == 1 else f"{first.rsplit('.', 1)[0]}.[{first.rsplit('.', 1)[1]}-{last.rsplit('.', 1)[1]}]"
    port_range = str(ports[0]) if n == 1 else f"[{ports[0]}-{ports[-1]}]"
    names = "node-0" if n == 1 else f"node-[0-{n - 1}]"
    host = meta["hostname"]
    return f"""# Slurm sandbox cluster, written by `runner sandbox up --slurm`: {n} slurmd on this machine.
ClusterName=runner-sandbox
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={meta['ctld_port']}
SlurmdPort={ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={lay.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={lay.state / 'state'}
SlurmdSpoolDir={lay.state / 'spool'}/%n
SlurmctldPidFile={lay.run / 'slurmctld.pid'}
SlurmdPidFile={lay.run}/slurmd-%n.pid
SlurmctldLogFile={lay.state / 'log' / 'slurmctld.log'}
SlurmdLogFile={lay.state / 'log'}/slurmd-%n.log
# No cgroups in the sandbox: processes are tracked by parentage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
# SIGTERM to SIGKILL on cancel/requeue: the trainer's preempt checkpoint fits in it.
KillWait=30
MinJobAge=600
SlurmdParameters=config_overrides
NodeName={names} NodeHostname={host} NodeAddr={addr_range} Port={port_range} CPUs=1 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def oci_conf(lay: SlurmLayout) -> str:
    """Slurm's native OCI support (`srun --container BUNDLE`) through Debian's runc, as root."""
    root = f"--root={lay.run / 'runc'}"
    cid = "%n.%u.%j.%s.%t"
    return (f'RunTimeQuery="runc {root} state {cid}"\n'
            f'RunTimeKill="runc {root} kill -a {cid}"\n'
            f'RunTimeDelete="runc {root} delete --force {cid}"\n'
            f'RunTimeRun="runc {root} run {cid} -b %b"\n')


def login_sshd_config(meta: dict, lay: SlurmLayout) -> str:
    return f"""# Slurm sandbox login node: written by runner sandbox up --slurm
ListenAddress {meta['login']}:{meta['port']}
HostKey {lay.host_key}
PidFile {lay.sshd_pid}
AuthorizedKeysFile {lay.state / 'authorized_keys'}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxSessions 64
MaxStartups 64:30:128
SetEnv SLURM_CONF={lay.conf}
Subsystem sftp internal-sftp
"""


def write_slurm_inventory(path: Path, sb: SlurmSandbox, meta: dict, venv: str | None) -> None:
    """The inventory for the sandbox cluster: submitted from its login node over real SSH; no
    container (the project's virtualenv on the shared filesystem, as sites without pyxis do)."""
    repo = Path(__file__).resolve().parents[2]
    venv = venv or str(repo / ".venv")
    doc = {
        "slurm": {"partition": "debug", "nodes": meta["nodes"], "container": "none", "venv": venv,
                  "chdir": str(repo), "workdir": meta["shared"],
                  "login": {"host": meta["login"], "port": meta["port"], "user": "root",
                            "identity_file": str(sb.lay.user_key), "known_hosts": str(sb.lay.known_hosts)}},
        "job": {"image": "runner-trainer:latest", "config": "configs/pi-qwen3-3stage-tiny.yaml",
                "args": ["--train_steps", "5", "--batch_size", "16", "--microbatch_num", "4", "--profile_batch", "1"],
                "env": {"OMP_NUM_THREADS": "1"}, "master_port": "auto"},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("# Slurm sandbox inventory, written by `runner sandbox up --slurm`: a real Slurm cluster on this\n"
              "# machine (slurmctld + one slurmd per node), jobs submitted from its login node over SSH.\n")
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120))


def _check(cmd: list[str], env: dict | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise UserError(f"{os.path.basename(cmd[0])} failed: {why[0]}")


def _stop_all(procs: list[psutil.Process], grace: float = 10.0) -> None:
    """SIGTERM to all at once (each daemon takes a second or two to exit), SIGKILL what is left."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def _marked_processes(state: str) -> list[psutil.Process]:
    """Processes of this cluster: daemons name a file under <state> on their command line (sshd
    scrubs its environment); job steps carry MARKER=<state> in theirs, inherited from slurmd."""
    needle = f"{MARKER}={state}".encode()
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            if any(state + "/" in a for a in proc.info.get("cmdline") or []):
                found.append(proc)
                continue
            with open(f"/proc/{proc.pid}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(proc)
        except OSError:
            continue
    return found
