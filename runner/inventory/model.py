"""What an inventory describes once it is read: nodes (how to reach each one, what it may use),
the job (image, config, data, secrets) and the rules their fields follow. Plain data, no I/O."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from runner.core.errors import UserError
from runner.inventory.job_data import MountSpec, SyncSpec
from runner.inventory.safe_yaml import read_text

ARCHES = ("amd64", "arm64")
# What users type for arch, mapped onto Docker's platform names.
ARCH_ALIASES = {"amd64": "amd64", "x86_64": "amd64", "arm64": "arm64", "aarch64": "arm64"}
ROLES = ("master", "worker")
FINGERPRINT_RE = re.compile(r"SHA256:[A-Za-z0-9+/]{43}=?")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HOSTNAME_RE = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
# Values that reach a shell or a docker bind spec on a node are refused unless made of these
# (quoting is done too, everywhere; this keeps a path readable in `ps`, logs and mount specs).
PATH_CHARS_RE = re.compile(r"[A-Za-z0-9._+@/-]")
ZONE_RE = re.compile(r"[A-Za-z0-9_.-]{1,15}")  # an IPv6 zone id: a network interface's name (IFNAMSIZ)
USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}")
IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}")
# Env names whose values are secrets by their look: masked in every output, and a warning says
# that job.env still puts them in the container's config (docker inspect), where env_file does not.
_TORCHRUN = "torchrun, per process, from the nodes' `slots` (or job.nproc_per_node)"
# Set by the runner or torchrun on every node: a user value would silently replace it (every
# node would get the same NODE_RANK). Name -> the field that sets it.
RESERVED_ENV = {
    "RUN_ID": "the run id (`runner up` makes one; `--resume RUN` reuses one)",
    "NODE_NAME": "the node's `name`",
    "NODE_RANK": "the node's place: the `role: master` node is 0, the others follow in inventory order",
    "NNODES": "the number of entries under `nodes:`",
    "MASTER_ADDR": "the master node's `addr` (default: its `host`)",
    "MASTER_PORT": "`job.master_port`",
    "OUTPUT_DIR": "the node's `workdir` (the run dir under it is mounted at /out)",
    "GLOO_SOCKET_IFNAME": "a probe of each node (the interface that routes to the master)",
    "NCCL_SOCKET_IFNAME": "a probe of each node (the interface that routes to the master)",
    **dict.fromkeys(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID",
                     "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"), _TORCHRUN),
}


def reserved_env_error(name: str) -> str | None:
    what = RESERVED_ENV.get(name)
    return f"{name} is reserved: the runner sets it from {what}; remove it" if what else None


def workdir_error(wd: str) -> str | None:
    """Why a workdir cannot be used, or None."""
    if wd.startswith("~") and not (wd == "~" or wd.startswith("~/")):
        return (f"{wd!r}: only ~ or ~/path (the SSH user's own home) is allowed: ~user resolves "
                "differently on the node and in a docker mount")
    if not wd.startswith(("/", "~")):
        return f"{wd!r} is relative: use an absolute path or ~/path (docker takes a relative one for a named volume)"
    bad = next((ch for ch in wd if not PATH_CHARS_RE.match(ch) and ch != "~"), None)
    if bad is not None or "~" in wd[1:]:
        return (f"{wd!r} contains {bad or '~'!r}: use letters, digits and . _ - + @ / only "
                "(the path reaches a shell and a docker bind spec on the node)")
    return None

NODE_FIELDS = {"name", "host", "addr", "port", "user", "identity_file", "known_hosts", "host_key", "arch",
               "slots", "role", "workdir", "gpus", "env", "cpus", "memory", "compress",
               "ssh_config", "proxy_jump", "proxy_jump_host_key"}  # the last three: runner/inventory/ssh_config.py
# Node limits, applied as Docker limits on the job's container (--cpus, --memory): a node that
# shares its machine, or sandbox nodes of unequal speed. Docker's own size syntax, its minimum 6m.
MEMORY_RE = re.compile(r"([0-9]+)([bkmg]?)", re.I)
MEMORY_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
MIN_MEMORY = 6 << 20
MAX_MEMORY = 64 << 40   # 65536g: more than any machine; a 30-digit size is a typo or an attack
MAX_NODES = 100_000     # entries under `nodes:` (and slurm.nodes)
MAX_RANKS = 1 << 20     # processes of one job, all nodes' slots summed (the trainer's and a checkpoint's bound)


def memory_bytes(text: str) -> int | None:
    """'4g' -> 4294967296 (Docker's units: b, k, m, g, powers of 1024); None if not a size."""
    m = MEMORY_RE.fullmatch(text.strip())
    if not m or len(m[1]) > 30:  # digits past any size: never handed to int()'s 4300-digit limit
        return None if not m else MAX_MEMORY + 1
    return int(m[1]) * MEMORY_UNITS[m[2].lower()]

DEFAULT_FIELDS = NODE_FIELDS - {"name", "host", "addr", "role", "host_key"}
PUSH_MODES = ("relay", "direct")
JOB_FIELDS = {"image", "config", "args", "env", "env_file", "master_port", "nproc_per_node",
              "grace_period", "command", "build", "sync", "mounts", "unsafe_mounts", "registry", "push", "perseus",
              "notify", "elastic", "hang_timeout", "dp_sync"}
DP_SYNC_MODES = ("auto", "allreduce", "diloco")  # job.dp_sync (runner/planning/dp_sync.py)
BUILD_FIELDS = {"context", "dockerfile", "args", "platform"}
TOP_FIELDS = {"defaults", "nodes", "job", "slurm"}
# In job.env_file: how the nodes log in to job.registry (never passed to the job's containers).
REGISTRY_AUTH_KEYS = ("RUNNER_REGISTRY_USER", "RUNNER_REGISTRY_PASSWORD")  # slurm: parsed by runner/inventory/slurm.py


@dataclass(frozen=True)
class Jump:
    """A bastion (OpenSSH's ProxyJump host), resolved by runner/inventory/ssh_config.py: one hop only. Its
    host key is verified like a node's (known_hosts of the node, or the pinned host_key)."""
    host: str
    port: int = 22
    user: str = "root"
    identity_file: str | None = None
    host_key: str | None = None      # pinned "SHA256:..." (proxy_jump_host_key)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}:{self.port}"


@dataclass
class Node:
    name: str
    host: str                        # what SSH connects to
    addr: str | None = None          # what the ranks use (MASTER_ADDR, the interface probe); None: host
    port: int = 22
    user: str = "root"
    identity_file: str | None = None
    known_hosts: str | None = None
    host_key: str | None = None      # pinned "SHA256:..." fingerprint
    arch: str | None = None          # None: probed over SSH
    slots: int = 1                   # processes per node (torchrun --nproc-per-node)
    role: str = "worker"
    workdir: str = "~/runner"
    gpus: int | str | None = None    # None/0: CPU; "all" or a count
    cpus: float | None = None        # Docker --cpus of the job's container (None: no limit)
    memory: str | None = None        # Docker --memory of the job's container, e.g. "4g"
    compress: bool | None = None     # ssh -C on bulk streams; None (auto): runner/transport/link_rate.py
    env: dict[str, str] = field(default_factory=dict)
    ssh_config: str | None = None    # the ssh_config file that filled fields the inventory left out
    proxy_jump: Jump | None = None   # the bastion SSH goes through (inventory or ssh_config ProxyJump)
    line: int = 0

    @property
    def is_master(self) -> bool:
        return self.role == "master"

    @property
    def rank_addr(self) -> str:
        """The address other nodes' ranks reach this node at: `addr`, else the SSH `host`."""
        return self.addr or self.host


@dataclass
class BuildSpec:
    """How `runner push` builds an image on this host's engine (job.build, per arch or for all)."""
    context: str                      # directory sent to the engine (its .dockerignore applies)
    dockerfile: str = "Dockerfile"    # relative to context
    args: dict[str, str] = field(default_factory=dict)  # --build-arg
    platform: str | None = None       # e.g. linux/arm64 (cross-build through qemu binfmt)


@dataclass
class Job:
    image: dict[str, str] | str = "runner-trainer:latest"  # one tag, or {arch: tag}
    config: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    env_file: str | None = None
    master_port: int | str = "auto"
    nproc_per_node: int | None = None  # None: each node's slots
    grace_period: float = 30.0        # seconds between SIGTERM and SIGKILL on down
    command: list[str] | None = None  # replaces `-m trainer --config ...` (tests, custom entrypoints)
    build: dict[str, BuildSpec] = field(default_factory=dict)  # {arch: spec}; one spec for all fills both
    sync: list[SyncSpec] = field(default_factory=list)     # local data copied to every node (runner/delivery/sync.py)
    mounts: list[MountSpec] = field(default_factory=list)  # data already on the nodes
    unsafe_mounts: list[str] = field(default_factory=list)  # job.mounts node paths that hand the job the node, on purpose
    registry: str | None = None       # nodes pull the job's tags from HOST:PORT instead of a push
    push: str = "relay"               # relay: this host sends each layer once, nodes pass it on; direct: one stream each
    perseus: Any = None               # runner/backends/ssh/perseus.py PerseusSpec: a Perseus server beside the job
    notify: Any = None                # runner/backends/notify.py NotifySpec: told on this machine when `up` ends
    elastic: Any = None               # runner/inventory/elastic_spec.py ElasticSpec: shrink on a lost node, regrow
    hang_timeout: int | None = None   # seconds without progress that make a hang (None: auto, contract/hang.py)
    dp_sync: str | None = None        # auto | allreduce | diloco (None: the trainer config's parallel.dp_sync)

    def image_for(self, arch: str | None) -> str | None:
        if isinstance(self.image, str):
            return self.image
        if arch is None:
            return None
        return self.image.get(arch)

    def secrets(self) -> dict[str, str]:
        """Parsed env_file (KEY=VALUE lines) for the job's containers; values are secrets and never
        printed. The registry credentials (REGISTRY_AUTH_KEYS) are the runner's, not the job's."""
        every = read_env_file(self.env_file) if self.env_file else {}
        return {k: v for k, v in every.items() if k not in REGISTRY_AUTH_KEYS}

    def registry_auth(self) -> tuple[str, str] | None:
        """(user, password) for job.registry from the env_file, or None (the node's own docker login)."""
        every = read_env_file(self.env_file) if self.env_file else {}
        user, password = (every.get(k) for k in REGISTRY_AUTH_KEYS)
        if bool(user) != bool(password):
            raise UserError(f"{self.env_file}: give both {' and '.join(REGISTRY_AUTH_KEYS)} or neither")
        return (user, password) if user else None


@dataclass
class Inventory:
    path: str
    nodes: list[Node]
    job: Job

    @functools.cached_property
    def master(self) -> Node:
        return next(n for n in self.nodes if n.is_master)

    def ordered(self) -> list[Node]:
        """Master first (node rank 0), then the others in inventory order."""
        return [self.master] + [n for n in self.nodes if not n.is_master]

    @functools.cached_property
    def _by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        n = self._by_name.get(name)
        if n is None:
            shown = ", ".join(x.name for x in self.nodes[:10]) + (" ..." if len(self.nodes) > 10 else "")
            raise UserError(f"{self.path}: no node named {name!r} (nodes: {shown})")
        return n


ENV_FILE_MAX_BYTES = 1 << 20  # KEY=VALUE lines: secrets, not data


def read_env_file(path: str) -> dict[str, str]:
    """Docker-style env file: KEY=VALUE per line, # comments, optional surrounding quotes."""
    out: dict[str, str] = {}
    text = read_text(path, "env_file", ENV_FILE_MAX_BYTES)  # bounded, UTF-8 or one line
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[7:].lstrip()
        key, sep, val = line.partition("=")
        key = key.strip()
        if not sep or not ENV_NAME_RE.fullmatch(key):
            raise UserError(f"{path}:{i}: expected KEY=VALUE (value not shown)")
        if why := reserved_env_error(key):
            raise UserError(f"{path}:{i}: {why} (value not shown)")
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            val = val[1:-1]
        out[key] = val
    return out
