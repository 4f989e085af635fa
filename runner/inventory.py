"""Inventory: which nodes exist, how to reach them, and the job to run on them.

The YAML is composed (not just loaded) so every value keeps its line number: a validation error
names the file, the line and the field in one line, e.g.
``hosts/pis.yaml:7: nodes[1].port: must be an integer in 1..65535, got 'ssh'``.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import logging
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runner.errors import UserError
from runner.job_data import (
    MountSpec,
    SyncSpec,
    check_destinations,
    check_unsafe_mounts,
    parse_mounts,
    parse_registry,
    parse_sync,
    parse_unsafe_mounts,
)

log = logging.getLogger("runner.inventory")

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
SECRET_NAME_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.I)
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


def looks_secret(name: str) -> bool:
    return bool(SECRET_NAME_RE.search(name))


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
               "slots", "role", "workdir", "gpus", "env", "cpus", "memory",
               "ssh_config", "proxy_jump", "proxy_jump_host_key"}  # the last three: runner/ssh_config.py
# Node limits, applied as Docker limits on the job's container (--cpus, --memory): a node that
# shares its machine, or sandbox nodes of unequal speed. Docker's own size syntax, its minimum 6m.
MEMORY_RE = re.compile(r"([0-9]+)([bkmg]?)", re.I)
MEMORY_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
MIN_MEMORY = 6 << 20


def memory_bytes(text: str) -> int | None:
    """'4g' -> 4294967296 (Docker's units: b, k, m, g, powers of 1024); None if not a size."""
    m = MEMORY_RE.fullmatch(text.strip())
    return int(m[1]) * MEMORY_UNITS[m[2].lower()] if m else None

DEFAULT_FIELDS = NODE_FIELDS - {"name", "host", "addr", "role", "host_key"}
PUSH_MODES = ("relay", "direct")
JOB_FIELDS = {"image", "config", "args", "env", "env_file", "master_port", "nproc_per_node",
              "grace_period", "command", "build", "sync", "mounts", "unsafe_mounts", "registry", "push", "perseus",
              "notify"}
BUILD_FIELDS = {"context", "dockerfile", "args", "platform"}
TOP_FIELDS = {"defaults", "nodes", "job", "slurm"}
# In job.env_file: how the nodes log in to job.registry (never passed to the job's containers).
REGISTRY_AUTH_KEYS = ("RUNNER_REGISTRY_USER", "RUNNER_REGISTRY_PASSWORD")  # slurm: parsed by runner/slurm_inventory.py


@dataclass(frozen=True)
class Jump:
    """A bastion (OpenSSH's ProxyJump host), resolved by runner/ssh_config.py: one hop only. Its
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
    sync: list[SyncSpec] = field(default_factory=list)     # local data copied to every node (runner/sync.py)
    mounts: list[MountSpec] = field(default_factory=list)  # data already on the nodes
    unsafe_mounts: list[str] = field(default_factory=list)  # job.mounts node paths that hand the job the node, on purpose
    registry: str | None = None       # nodes pull the job's tags from HOST:PORT instead of a push
    push: str = "relay"               # relay: this host sends each layer once, nodes pass it on; direct: one stream each
    perseus: Any = None               # runner/perseus.py PerseusSpec: a Perseus server beside the job
    notify: Any = None                # runner/notify.py NotifySpec: told on this machine when `up` ends

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


# --- YAML with line numbers --------------------------------------------------------------

class _Val:
    """A plain value plus where it came from."""

    __slots__ = ("value", "line")

    def __init__(self, value: Any, line: int):
        self.value = value
        self.line = line


# libyaml's composer when PyYAML was built with it (10x faster on a 10,000-node inventory); the
# nodes it makes carry the same line marks.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_DEPTH = 32  # mappings and lists inside each other: an inventory needs 5; deeper is an attack


class _Scalars(yaml.constructor.SafeConstructor):
    """One constructor for every scalar of a file (a loader per scalar cost most of the parse)."""

    def scalar(self, node: yaml.ScalarNode) -> Any:
        try:
            return self.construct_object(node, deep=True)
        finally:
            self.constructed_objects.clear()


def _convert(node: yaml.Node, path: str, where: str = "", sc: _Scalars | None = None, depth: int = 0) -> _Val:
    sc = sc or _Scalars()
    line = node.start_mark.line + 1
    if depth > MAX_DEPTH:
        raise UserError(f"{path}:{line}: {where}: nested more than {MAX_DEPTH} levels deep; not an inventory")
    if isinstance(node, yaml.MappingNode):
        out: dict[str, tuple[int, _Val]] = {}
        for k, v in node.value:
            key = str(sc.scalar(k)) if isinstance(k, yaml.ScalarNode) else str(k)
            w = f"{where}.{key}" if where else key
            kline = k.start_mark.line + 1
            if key in out:
                # YAML says keys are unique; PyYAML silently keeps the last, hiding a typo'd edit.
                raise UserError(f"{path}:{kline}: {w}: duplicate key (first at line {out[key][0]}); keep one")
            out[key] = (kline, _convert(v, path, w, sc, depth + 1))
        return _Val(out, line)
    if isinstance(node, yaml.SequenceNode):
        return _Val([_convert(v, path, f"{where}[{i}]", sc, depth + 1) for i, v in enumerate(node.value)], line)
    return _Val(sc.scalar(node), line)


class _Checker:
    """Raises UserError("file:line: field: problem") for the first problem found."""

    def __init__(self, path: str):
        self.path = path
        self.scope: str | None = None  # "node pi-1" / "every node": named at the end of a message

    def fail(self, line: int, where: str, msg: str) -> None:
        suffix = f" ({self.scope})" if self.scope else ""
        raise UserError(f"{self.path}:{line}: {_visible(where)}: {msg}{suffix}")

    def warn(self, line: int, where: str, msg: str) -> None:
        suffix = f" ({self.scope})" if self.scope else ""
        log.warning("runner: warning: %s:%d: %s: %s%s", self.path, line, _visible(where), msg, suffix)

    def mapping(self, v: _Val, where: str, allowed: set[str]) -> dict[str, tuple[int, _Val]]:
        if not isinstance(v.value, dict):
            self.fail(v.line, where, f"must be a mapping, got {_kind(v.value)}")
        for key, (kline, _) in v.value.items():
            if key not in allowed:
                from contract.suggest import did_you_mean

                hint = did_you_mean(str(key), allowed) or f" (allowed: {', '.join(sorted(allowed))})"
                self.fail(kline, f"{where}.{key}" if where else key, f"unknown field{hint}")
        return v.value

    def str_(self, v: _Val, where: str) -> str:
        if not isinstance(v.value, str) or not v.value.strip():
            self.fail(v.line, where, f"must be a non-empty string, got {_show(v.value)}")
        return v.value

    def int_(self, v: _Val, where: str, lo: int, hi: int) -> int:
        if isinstance(v.value, bool) or not isinstance(v.value, int) or not lo <= v.value <= hi:
            self.fail(v.line, where, f"must be an integer in {lo}..{hi}, got {_show(v.value)}")
        return v.value

    def str_map(self, v: _Val, where: str, env: bool = False) -> dict[str, str]:
        """NAME: value pairs; env=True also refuses reserved names and warns about secret-looking ones."""
        if not isinstance(v.value, dict):
            self.fail(v.line, where, f"must be a mapping of NAME: value, got {_kind(v.value)}")
        out = {}
        for key, (kline, x) in v.value.items():
            if not ENV_NAME_RE.fullmatch(key):
                self.fail(kline, f"{where}.{key}", "not a valid environment variable name")
            if env and (why := reserved_env_error(key)):
                self.fail(kline, f"{where}.{key}", why)
            if env and looks_secret(key):
                self.warn(kline, f"{where}.{key}", "looks like a secret: it is masked in output but lands in the "
                          "container's config (docker inspect); put it in job.env_file")
            if isinstance(x.value, (dict, list)) or x.value is None:
                self.fail(x.line, f"{where}.{key}", f"must be a string or number, got {_kind(x.value)}")
            out[key] = str(x.value).lower() if isinstance(x.value, bool) else str(x.value)
        return out


def _visible(where: str) -> str:
    """A field path built from the file's own keys, with any control character escaped: the
    message stays one line, and a key cannot write to the terminal."""
    return where if where.isprintable() else where.encode("unicode_escape").decode()


def _kind(x: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "nothing"}.get(type(x), type(x).__name__)


def _show(x: Any) -> str:
    return repr(x) if isinstance(x, (str, int, float, bool)) else _kind(x)


def _expand(p: str, base: Path) -> str:
    """~ and $VARS expanded; relative paths taken from the cwd if they exist there, else the
    inventory's folder (so `configs/x.yaml` works from the repo root and next to the file)."""
    p = os.path.expandvars(os.path.expanduser(p))
    if os.path.isabs(p) or os.path.exists(p):
        return p
    cand = base / p
    return str(cand) if cand.exists() else p


def read_env_file(path: str) -> dict[str, str]:
    """Docker-style env file: KEY=VALUE per line, # comments, optional surrounding quotes."""
    out: dict[str, str] = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read env_file: {exc.strerror}") from None
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


@functools.lru_cache(maxsize=1 << 16)
def _ip(h: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """h parsed as an IP address, or None: once per host however often it is checked or compared."""
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        return None


def host_error(h: str) -> str | None:
    """Why h cannot be a host (what SSH connects to, or the ranks' address), or None. A spelling
    the system resolver reads as another address (inet_aton: 127.1, 0x7f.1, 017.0.0.1,
    2130706433) is refused: two nodes would be one machine under two names, and known_hosts would
    be looked up under a name OpenSSH never records. An IPv6 zone id is an interface name."""
    ip = _ip(h)
    if ip is not None:
        zone = getattr(ip, "scope_id", None)
        if zone is not None and not ZONE_RE.fullmatch(zone):
            return f"{h!r}: the zone id after '%' must be an interface name (letters, digits, '.', '_', '-')"
        return None
    try:
        as_ipv4 = socket.inet_ntoa(socket.inet_aton(h))  # a parse, no lookup
    except OSError:
        as_ipv4 = None
    if as_ipv4 is not None:
        return f"{h!r} is read as the address {as_ipv4} by the system resolver: write {as_ipv4}"
    if not HOSTNAME_RE.fullmatch(h):
        return f"{h!r} is not an IP address or host name"
    return None


def _digest_b64(text: str) -> bool:
    """Whether text is the unpadded base64 of a 32-byte digest exactly as OpenSSH prints it."""
    raw = text.rstrip("=")
    try:
        digest = base64.b64decode(raw + "=", validate=True)
    except ValueError:
        return False
    return len(digest) == 32 and base64.b64encode(digest).decode().rstrip("=") == raw


def canonical_host(h: str) -> str:
    """A valid host in its one spelling: an IP address as `ipaddress` writes it (IPv6 compressed,
    lower-case), a name as written (ssh_config Host patterns match it as written)."""
    ip = _ip(h)
    return h if ip is None else str(ip)


def same_host(h: str) -> str:
    """What two hosts are compared by: the canonical address (an IPv4-mapped IPv6 one as its
    IPv4), a name lower-case (DNS ignores case)."""
    ip = _ip(h)
    if ip is None:
        return h.lower()
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


# --- parsing -----------------------------------------------------------------------------

def load_inventory(path: str | os.PathLike, *, check_files: bool = True,
                   job_path: str | None = None, with_job: bool = True) -> Inventory:
    """Parse and validate. check_files=False skips files needed only to connect (SSH keys,
    known_hosts), so a dry-run works on a laptop without the cluster's keys. with_job=False
    ignores the job section (status, logs, down, collect only need the nodes)."""
    path = str(path)
    root, c = read_yaml(path, "inventory")
    if root is None:
        c.fail(1, "nodes", "inventory is empty; it needs at least a `nodes:` list")
    top = c.mapping(root, "", TOP_FIELDS)
    base = Path(path).resolve().parent

    defaults: dict[str, Any] = {}
    if "defaults" in top:
        dline, dv = top["defaults"]
        if dv.value is not None:
            c.scope = "every node"
            defaults = _node_fields(c, dv, "defaults", DEFAULT_FIELDS, base, check_files)
            c.scope = None

    if "nodes" not in top:
        c.fail(1, "nodes", "missing; list at least one node with name and host")
    nline, nv = top["nodes"]
    if not isinstance(nv.value, list) or not nv.value:
        c.fail(nv.line if nv.value is not None else nline, "nodes",
               f"must be a non-empty list of nodes, got {_kind(nv.value) if nv.value else 'nothing'}")
    from runner.ssh_config import Resolver

    ssh_config = Resolver(c, check_files)
    nodes: list[Node] = []
    seen: dict[str, int] = {}
    addrs: dict[tuple, str] = {}
    for i, item in enumerate(nv.value):
        where = f"nodes[{i}]"
        named = item.value.get("name") if isinstance(item.value, dict) else None
        c.scope = f"node {named[1].value}" if named and isinstance(named[1].value, str) else None
        fields = _node_fields(c, item, where, NODE_FIELDS, base, check_files)
        for req in ("name", "host"):
            if req not in fields:
                c.fail(item.line, f"{where}.{req}", "missing (every node needs a name and a host)")
        merged = {**{k: v for k, v in defaults.items() if k != "env"}, **fields}
        merged["env"] = {**defaults.get("env", {}), **fields.get("env", {})}
        merged = ssh_config.resolve(merged, item.line, where)  # ~/.ssh/config fills what is left out
        node = Node(**merged, line=item.line)
        if node.name in seen:
            c.fail(item.line, f"{where}.name", f"duplicate node name {node.name!r} (first at line {seen[node.name]})")
        seen[node.name] = item.line
        j = node.proxy_jump  # one private address may sit behind two bastions
        key = (same_host(node.host), node.port, (same_host(j.host), j.port) if j else None)
        if key in addrs:
            c.fail(item.line, f"{where}.host", f"{node.host}:{node.port} is also node {addrs[key]!r}")
        addrs[key] = node.name
        nodes.append(node)
        c.scope = None

    masters = [n for n in nodes if n.is_master]
    if len(masters) > 1:
        c.fail(masters[1].line, f"nodes[{nodes.index(masters[1])}].role",
               f"two masters ({masters[0].name}, {masters[1].name}); exactly one node may be role: master")
    if not masters:
        nodes[0].role = "master"  # no role given: the first node is the master (rank 0)

    job = Job()
    if not with_job:
        top.pop("job", None)
    elif job_path:  # --job replaces the inventory's job section, which is then not validated
        job = _job_file(job_path, base)
        top.pop("job", None)
    elif "job" in top and top["job"][1].value is not None:
        job = _job(c, top["job"][1], base)
    if isinstance(job.image, dict):
        for n in nodes:
            if n.arch and n.arch not in job.image:
                jv = top["job"][1].value if "job" in top else {}
                c.fail(jv["image"][0] if isinstance(jv, dict) and "image" in jv else n.line, "job.image",
                       f"no image for arch {n.arch} (node {n.name}); add `{n.arch}: <tag>`")
    if job.perseus is not None:
        from runner.perseus import check_world

        check_world(job.perseus, sum(job.nproc_per_node or n.slots for n in nodes))
    return Inventory(path=path, nodes=nodes, job=job)


def read_yaml(path: str, what: str) -> tuple[_Val | None, _Checker]:
    """The file's YAML with line numbers kept, and a checker whose errors name the file; an
    unreadable file or bad YAML is one line naming it (`what`: inventory, job file)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        hint = "; name an inventory with -i FILE, or `runner sandbox up` writes a local one" if what == "inventory" else ""
        raise UserError(f"{path}: cannot read {what}: no such file{hint}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what}: {exc.strerror}") from None
    return _compose(path, text), _Checker(path)


def _no_aliases(path: str, text: str) -> None:
    """Anchors and aliases are refused before anything is built: nine lines of nested aliases
    (a 1 KB file) expand to 9^9 values while converting (killed at 26 s and 650 MB, growing).
    The events are only scanned when the text has an `&` or a `*` at all."""
    if "&" not in text and "*" not in text:
        return
    for ev in yaml.parse(text, Loader=_LOADER):
        if isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None) is not None:
            raise UserError(f"{path}:{ev.start_mark.line + 1}: YAML anchors and aliases (&name, *name, <<: *name) "
                            "are not accepted: write the values out (`defaults:` holds what every node shares)")


def _compose(path: str, text: str) -> _Val | None:
    try:
        _no_aliases(path, text)
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark else 1
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{path}:{line}: YAML syntax error: {problem}") from None
    if node is None:
        return None
    try:
        return _convert(node, path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UserError(f"{path}:{mark.line + 1 if mark else 1}: YAML error: {getattr(exc, 'problem', exc)}") from None


def _node_fields(c: _Checker, v: _Val, where: str, allowed: set[str], base: Path,
                 check_files: bool) -> dict[str, Any]:
    m = c.mapping(v, where, allowed)
    out: dict[str, Any] = {}
    for key, (_, x) in m.items():
        w = f"{where}.{key}"
        if key in ("name",):
            out[key] = c.str_(x, w)
            if not NAME_RE.fullmatch(out[key]):
                c.fail(x.line, w, f"{out[key]!r}: use letters, digits, '.', '_' or '-' (it names containers)")
        elif key in ("host", "addr"):
            s = c.str_(x, w)
            if why := host_error(s):
                c.fail(x.line, w, why)
            out[key] = canonical_host(s)
        elif key == "port":
            out[key] = c.int_(x, w, 1, 65535)
        elif key == "user":
            out[key] = c.str_(x, w)
            if not USER_RE.fullmatch(out[key]):
                c.fail(x.line, w, f"{out[key]!r} is not a user name (letters, digits, '.', '_', '-')")
        elif key in ("identity_file", "known_hosts"):
            p = _expand(c.str_(x, w), base)
            if check_files and not os.path.isfile(p):
                c.fail(x.line, w, f"file not found: {p}")
            out[key] = p
        elif key in ("ssh_config", "proxy_jump"):
            from runner.ssh_config import field_value

            out[key] = field_value(c, key, x.line, w, c.str_(x, w), base, check_files)
        elif key in ("host_key", "proxy_jump_host_key"):
            s = c.str_(x, w)
            if not FINGERPRINT_RE.fullmatch(s):
                c.fail(x.line, w, "must be an OpenSSH SHA256 fingerprint like 'SHA256:<43 base64 chars>' "
                       "(ssh-keyscan -p PORT HOST | ssh-keygen -lf -)")
            if not _digest_b64(s[7:]):
                c.fail(x.line, w, f"{s!r} can never match: 43 base64 characters of a SHA256 digest end in A, E, I, "
                       "M, Q, U, Y, c, g, k, o, s, w, 0, 4 or 8; copy it again from `ssh-keygen -lf`")
            out[key] = s
        elif key == "arch":
            s = c.str_(x, w)
            if s not in ARCH_ALIASES:
                c.fail(x.line, w, f"unknown arch {s!r} (use {' or '.join(ARCHES)}, or leave it out to probe)")
            out[key] = ARCH_ALIASES[s]
        elif key == "slots":
            out[key] = c.int_(x, w, 1, 1024)
        elif key == "role":
            s = c.str_(x, w)
            if s not in ROLES:
                c.fail(x.line, w, f"must be 'master' or 'worker', got {s!r}")
            out[key] = s
        elif key == "workdir":
            out[key] = c.str_(x, w)
            if why := workdir_error(out[key]):
                c.fail(x.line, w, why)
        elif key == "cpus":
            if isinstance(x.value, bool) or not isinstance(x.value, (int, float)) or not 0.01 <= x.value <= 1024:
                c.fail(x.line, w, f"must be a number of CPUs in 0.01..1024 (Docker --cpus, e.g. 0.5), got {_show(x.value)}")
            out[key] = float(x.value)
        elif key == "memory":
            raw = str(x.value) if isinstance(x.value, (str, int)) and not isinstance(x.value, bool) else None
            size = memory_bytes(raw) if raw is not None else None
            if size is None or size < MIN_MEMORY:
                c.fail(x.line, w, f"must be a size like 512m or 4g (Docker --memory, at least 6m), got {_show(x.value)}")
            out[key] = raw.strip().lower()
        elif key == "gpus":
            if x.value == "all" or x.value is None:
                out[key] = x.value
            else:
                out[key] = c.int_(x, w, 0, 1024)
        elif key == "env":
            out[key] = c.str_map(x, w, env=True)
    return out


def _job(c: _Checker, v: _Val, base: Path) -> Job:
    m = c.mapping(v, "job", JOB_FIELDS)
    job = Job()
    for key, (_, x) in m.items():
        w = f"job.{key}"
        if key == "image":
            if isinstance(x.value, dict):
                imgs = {}
                for arch, (aline, tag) in x.value.items():
                    if arch not in ARCH_ALIASES:
                        c.fail(aline, f"{w}.{arch}", f"unknown arch (use {' or '.join(ARCHES)})")
                    imgs[ARCH_ALIASES[arch]] = _image(c, tag, f"{w}.{arch}")
                if not imgs:
                    c.fail(x.line, w, "empty mapping; give a tag or {arch: tag}")
                job.image = imgs
            else:
                job.image = _image(c, x, w)
        elif key == "config":
            p = _expand(c.str_(x, w), base)
            if not os.path.isfile(p):
                c.fail(x.line, w, f"config file not found: {p}")
            job.config = p
        elif key in ("args", "command"):
            if not isinstance(x.value, list):
                c.fail(x.line, w, f"must be a list of strings, got {_kind(x.value)}")
            vals = []
            for j, a in enumerate(x.value):
                if isinstance(a.value, (dict, list)) or a.value is None:
                    c.fail(a.line, f"{w}[{j}]", f"must be a string or number, got {_kind(a.value)}")
                vals.append(str(a.value).lower() if isinstance(a.value, bool) else str(a.value))
            setattr(job, key, vals)
        elif key == "env":
            job.env = c.str_map(x, w, env=True)
        elif key == "env_file":
            p = _expand(c.str_(x, w), base)
            if not os.path.isfile(p):
                c.fail(x.line, w, f"env_file not found: {p}")
            try:
                read_env_file(p)
            except UserError as exc:
                c.fail(x.line, w, str(exc))
            job.env_file = p
        elif key == "master_port":
            if x.value == "auto":
                job.master_port = "auto"
            else:
                if isinstance(x.value, str):
                    c.fail(x.line, w, f"must be 'auto' or an integer in 1024..65535, got {x.value!r}")
                job.master_port = c.int_(x, w, 1024, 65535)
        elif key == "nproc_per_node":
            job.nproc_per_node = c.int_(x, w, 1, 1024)
        elif key == "grace_period":
            if isinstance(x.value, bool) or not isinstance(x.value, (int, float)) or not 0 <= x.value <= 3600:
                c.fail(x.line, w, f"must be seconds in 0..3600, got {_show(x.value)}")
            job.grace_period = float(x.value)
        elif key == "build":
            job.build = _build(c, x, w, base)
        elif key == "sync":
            job.sync = parse_sync(c, x, lambda p: _expand(p, base))
        elif key == "mounts":
            job.mounts = parse_mounts(c, x)
        elif key == "unsafe_mounts":
            job.unsafe_mounts = parse_unsafe_mounts(c, x)
        elif key == "registry":
            job.registry = parse_registry(c, x)
        elif key == "perseus":
            from runner.perseus import parse_perseus

            job.perseus = parse_perseus(c, x, lambda p: _expand(p, base))
        elif key == "notify":
            from runner.notify import parse as parse_notify

            try:
                job.notify = parse_notify([a.value for a in x.value] if isinstance(x.value, list) else x.value)
            except ValueError as exc:
                c.fail(x.line, w, str(exc))
        elif key == "push":
            job.push = c.str_(x, w)
            if job.push not in PUSH_MODES:
                c.fail(x.line, w, f"must be {' or '.join(PUSH_MODES)}, got {job.push!r}")
    check_destinations(c, job.sync, job.mounts)
    check_unsafe_mounts(c, job.mounts, job.unsafe_mounts, m["unsafe_mounts"][0] if "unsafe_mounts" in m else v.line)
    return job


def _image(c: _Checker, v: _Val, where: str) -> str:
    tag = c.str_(v, where)
    if not IMAGE_RE.fullmatch(tag):
        c.fail(v.line, where, f"{tag!r} is not an image reference (like name:tag or registry/name:tag)")
    return tag


def _build(c: _Checker, v: _Val, where: str, base: Path) -> dict[str, BuildSpec]:
    """`build: {context, dockerfile, args, platform}` for every arch, or `build: {arm64: {...}, ...}`."""
    if isinstance(v.value, dict) and v.value and not set(v.value) & BUILD_FIELDS:
        out = {}
        for arch, (aline, x) in v.value.items():
            if arch not in ARCH_ALIASES:
                c.fail(aline, f"{where}.{arch}", f"unknown arch (use {' or '.join(ARCHES)}) or build field "
                       f"({', '.join(sorted(BUILD_FIELDS))})")
            out[ARCH_ALIASES[arch]] = _build_spec(c, x, f"{where}.{arch}", base)
        return out
    spec = _build_spec(c, v, where, base)
    return dict.fromkeys(ARCHES, spec)


def _build_spec(c: _Checker, v: _Val, where: str, base: Path) -> BuildSpec:
    m = c.mapping(v, where, BUILD_FIELDS)
    if "context" not in m:
        c.fail(v.line, where, "missing context (the directory to build from)")
    line, x = m["context"]
    ctx = _expand(c.str_(x, f"{where}.context"), base)
    if not os.path.isdir(ctx):
        c.fail(line, f"{where}.context", f"directory not found: {ctx}")
    spec = BuildSpec(context=ctx)
    if "dockerfile" in m:
        spec.dockerfile = c.str_(m["dockerfile"][1], f"{where}.dockerfile")
    if not os.path.isfile(os.path.join(ctx, spec.dockerfile)):
        c.fail(m.get("dockerfile", (v.line,))[0], f"{where}.dockerfile", f"not found in {ctx}: {spec.dockerfile}")
    if "args" in m:
        spec.args = c.str_map(m["args"][1], f"{where}.args")
    if "platform" in m:
        spec.platform = c.str_(m["platform"][1], f"{where}.platform")
    return spec


def _job_file(job_path: str, base: Path) -> Job:
    """`--job FILE`: a YAML file holding a job section (top-level `job:` or the fields directly)."""
    root, c = read_yaml(job_path, "job file")
    if root is None or not isinstance(root.value, dict):
        c.fail(1, "job", "must be a mapping of job fields")
    if set(root.value) == {"job"}:
        root = root.value["job"][1]
    return _job(c, root, Path(job_path).resolve().parent)
