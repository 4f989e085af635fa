"""The `slurm:` section of an inventory: where and how the job goes to a Slurm cluster.

```yaml
slurm:
  partition: gpu            # default: the cluster's default partition
  nodes: 4                  # one task per node (torchrun), node rank = allocation order
  gpus_per_node: 8          # --gpus-per-node; 0: CPU job
  account: proj-123         # optional, as are qos, time, cpus_per_task, mem
  time: "04:00:00"
  container: pyxis          # pyxis (enroot), oci (Slurm's native OCI, runc/crun) or none
  workdir: ~/runner         # on the cluster's shared filesystem: runs/<run-id> is /out
  venv: ~/venvs/trainer     # container none: a virtualenv with the trainer installed
  chdir: ~/src/project      # container none: where tasks start (relative data paths); default: run dir
  login: {host: login.hpc.example.org, user: me}   # optional: submit over SSH from there
job: {...}                  # the same job section as for SSH inventories
```

Validated like the rest of the inventory: one line naming file, line and field. Values that
reach the generated sbatch script are either from a closed set or match a strict pattern
(`sbatch:` options from a closed list, each value's form checked: runner/inventory/sbatch_options.py); what
the cluster itself must confirm (that the partition exists, that it has that many nodes) is
checked at submission, before anything is submitted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from runner.core.errors import UserError
from runner.inventory.load import job_file, node_fields, parse_job
from runner.inventory.model import ARCH_ALIASES, ARCHES, MAX_RANKS, Job, Node
from runner.inventory.sbatch_options import MAX_OPTIONS, option_error
from runner.inventory.schema import Checker, Val, kind, read_yaml, show

CONTAINERS = ("pyxis", "oci", "none")
SLURM_FIELDS = {"partition", "nodes", "gpus_per_node", "cpus_per_task", "mem", "account", "qos", "time",
                "container", "image", "arch", "workdir", "venv", "chdir", "bundle_dir", "login", "sbatch"}
LOGIN_FIELDS = {"host", "port", "user", "identity_file", "known_hosts", "host_key"}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")   # partition, account, qos
TIME_RE = re.compile(r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|INFINITE")
MEM_RE = re.compile(r"\d+[KMGT]?")
MAX_TIME_DAYS = 366          # a time limit past a year is a typo (UNLIMITED says "none")
MAX_MEM_MIB = 1 << 30        # 1024T a node
# Paths go into #SBATCH lines (sbatch's own parser) and the script: no blanks, quotes or $; and into
# pyxis's --container-mounts and OCI bind specs (SRC:DST[:FLAGS], comma-separated): no ':' or ','.
PATH_RE = re.compile(r"~?[A-Za-z0-9_./+@-]*")
IMAGE_RE = re.compile(r"[A-Za-z0-9_./:@#+-]+")


@dataclass
class SlurmSpec:
    nodes: int
    partition: str | None = None
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    mem: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    container: str = "none"
    image: str | None = None       # pyxis: an enroot image (registry#repo:tag or a .sqsh path)
    arch: str = "amd64"            # picks job.image's tag
    workdir: str = "~/runner"
    venv: str | None = None
    chdir: str | None = None       # container none: the tasks' working directory (else the run dir)
    bundle_dir: str | None = None  # oci: where exported images live (default <workdir>/bundles)
    login: Node | None = None
    sbatch: list[str] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)   # field -> line, for errors found later


@dataclass
class SlurmInventory:
    path: str
    slurm: SlurmSpec
    job: Job

    def where(self, key: str) -> str:
        """`file:line: slurm.key` for an error about a field (the section's line if not given)."""
        return f"{self.path}:{self.slurm.lines.get(key, self.slurm.lines.get('', 1))}: slurm.{key}"


def top_level_keys(path: str) -> set[str]:
    """The inventory's sections, without validating them (which scheduler a command is for)."""
    try:
        root, _ = read_yaml(path, "inventory")
    except UserError:
        return set()
    return set(root.value) if root is not None and isinstance(root.value, dict) else set()


def load_slurm_inventory(path: str, *, job_path: str | None = None, check_files: bool = True,
                         with_job: bool = True, parsed: tuple[Val | None, Checker] | None = None) -> SlurmInventory:
    """parsed: the file's read_yaml() when the caller has read it already (runner.api reads it once)."""
    path = str(path)
    root, c = parsed or read_yaml(path, "inventory")
    if root is None or not isinstance(root.value, dict) or "slurm" not in root.value:
        c.fail(1, "slurm", "missing: a Slurm inventory needs a `slurm:` section (nodes, partition, container, ...)")
    base = Path(path).resolve().parent
    sline, sv = root.value["slurm"]
    spec = parse_slurm(c, sv, base, check_files, sline)
    job = Job()
    if with_job:
        if job_path:
            job = job_file(job_path, base)
        elif "job" in root.value and root.value["job"][1].value is not None:
            job = parse_job(c, root.value["job"][1], base)
        world = spec.nodes * (job.nproc_per_node or spec.gpus_per_node or 1)
        if world > MAX_RANKS:
            c.fail(sline, "slurm.nodes", f"{world} ranks (nodes x job.nproc_per_node or gpus_per_node); at most "
                   f"{MAX_RANKS}")
        if job.elastic is not None:
            c.fail(job.elastic.line, "job.elastic", "a Slurm allocation does not shrink node by node; "
                   "remove it (Slurm's own answer is `runner up --requeue`: the job goes back to the queue)")
        if isinstance(job.image, dict) and spec.container != "none" and spec.image is None \
                and spec.arch not in job.image:
            c.fail(spec.lines.get("arch", sline), "job.image", f"no image for arch {spec.arch} (slurm.arch); "
                   f"add `{spec.arch}: <tag>`")
    return SlurmInventory(path=path, slurm=spec, job=job)


def parse_slurm(c: Checker, v: Val, base: Path, check_files: bool, sline: int) -> SlurmSpec:
    m = c.mapping(v, "slurm", SLURM_FIELDS)
    lines = {"": sline, **{k: kl for k, (kl, _) in m.items()}}
    if "nodes" not in m:
        c.fail(v.line, "slurm.nodes", "missing: how many nodes to allocate (one torchrun per node)")
    spec = SlurmSpec(nodes=c.int_(m["nodes"][1], "slurm.nodes", 1, 100000), lines=lines)
    for key, (_, x) in m.items():
        w = f"slurm.{key}"
        if key in ("partition", "account", "qos"):
            setattr(spec, key, _match(c, x, w, NAME_RE, "letters, digits, '.', '_', '+' or '-'"))
        elif key == "time":
            spec.time = _match(c, x, w, TIME_RE, "a Slurm time limit like 90, 04:00:00 or 2-00:00:00", str(x.value))
            if (why := time_error(spec.time)) is not None:
                c.fail(x.line, w, why)
        elif key == "mem":
            spec.mem = _match(c, x, w, MEM_RE, "a size like 64G or 16000M", str(x.value))
            if not mem_mib(spec.mem) <= MAX_MEM_MIB:
                c.fail(x.line, w, f"{spec.mem[:40]!r}: at most {MAX_MEM_MIB >> 20}T (sbatch --mem; no unit: megabytes)")
        elif key == "gpus_per_node":
            spec.gpus_per_node = c.int_(x, w, 0, 64)
        elif key == "cpus_per_task":
            spec.cpus_per_task = c.int_(x, w, 1, 4096)
        elif key == "container":
            s = c.str_(x, w)
            if s not in CONTAINERS:
                c.fail(x.line, w, f"must be one of {', '.join(CONTAINERS)}, got {s!r}")
            spec.container = s
        elif key == "image":
            spec.image = _match(c, x, w, IMAGE_RE, "an image reference (registry#repo:tag) or a .sqsh path")
        elif key == "arch":
            s = c.str_(x, w)
            if s not in ARCH_ALIASES:
                c.fail(x.line, w, f"unknown arch {s!r} (use {' or '.join(ARCHES)})")
            spec.arch = ARCH_ALIASES[s]
        elif key in ("workdir", "venv", "chdir", "bundle_dir"):
            s = _match(c, x, w, PATH_RE, "a path without blanks, quotes, $ or ':'")
            if not (s.startswith("/") or s == "~" or s.startswith("~/")):
                c.fail(x.line, w, f"{s!r}: use an absolute path or ~/... (it must be the same path on every node)")
            setattr(spec, key, s.rstrip("/") or "/")
        elif key == "login":
            fields = node_fields(c, x, w, LOGIN_FIELDS, base, check_files)
            if "host" not in fields:
                c.fail(x.line, f"{w}.host", "missing: the login node's host name or address")
            spec.login = Node(name="login", **fields, line=x.line)
        elif key == "sbatch":
            spec.sbatch = _sbatch(c, x, w)
    for key in ("venv", "chdir"):
        if getattr(spec, key) and spec.container != "none":
            c.fail(lines[key], f"slurm.{key}", f"only for container: none (container is {spec.container}; "
                   "the image sets its own)")
    if spec.login is not None:
        spec.login.workdir = spec.workdir
    return spec


def _sbatch(c: Checker, x: Val, w: str) -> list[str]:
    """slurm.sbatch: a closed list of options, each value's form checked (runner/inventory/sbatch_options.py)."""
    if not isinstance(x.value, list):
        c.fail(x.line, w, f"must be a list of sbatch options like --constraint=a100, got {kind(x.value)}")
    if len(x.value) > MAX_OPTIONS:
        c.fail(x.line, w, f"{len(x.value)} options; at most {MAX_OPTIONS}")
    out = []
    for j, a in enumerate(x.value):
        if not isinstance(a.value, str):
            c.fail(a.line, f"{w}[{j}]", f"{show(a.value)}: use --option or --option=value")
        if why := option_error(a.value):
            c.fail(a.line, f"{w}[{j}]", why)
        out.append(a.value)
    return out


def time_error(t: str) -> str | None:
    """Why a TIME_RE-shaped slurm.time is not a limit sbatch takes, or None: minutes and seconds
    below 60 after another field, hours below 24 after days, at most MAX_TIME_DAYS."""
    if t in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = t.rpartition("-")
    parts = rest.split(":")
    if len(t) > 24:
        return f"{t[:24]!r}...: at most {MAX_TIME_DAYS} days"
    nums = [int(x) for x in parts]
    if days:  # days-hours[:minutes[:seconds]]
        mins = int(days) * 1440 + nums[0] * 60 + sum(n // 60 ** i for i, n in enumerate(nums[1:]))
        bad = nums[0] >= 24 or any(n >= 60 for n in nums[1:])
    else:     # minutes | minutes:seconds | hours:minutes:seconds
        mins = nums[0] if len(nums) < 3 else nums[0] * 60 + nums[1]
        bad = any(n >= 60 for n in nums[1:])
    if bad:
        return f"{t!r}: hours below 24 after days, minutes and seconds below 60 after another field"
    if mins > MAX_TIME_DAYS * 1440:
        return f"{t!r}: at most {MAX_TIME_DAYS} days (UNLIMITED for no limit)"
    return None


def mem_mib(mem: str) -> int:
    """slurm.mem in MiB (sbatch: no unit is megabytes); one past MAX_MEM_MIB for a size that long."""
    digits, unit = (mem[:-1], mem[-1]) if mem[-1:].isalpha() else (mem, "M")
    if len(digits) > 20:
        return MAX_MEM_MIB + 1
    return int(digits) * {"K": 1, "M": 1024, "G": 1024 ** 2, "T": 1024 ** 3}[unit] // 1024


def _match(c: Checker, x: Val, where: str, rx: re.Pattern, what: str, value: str | None = None) -> str:
    s = value if value is not None else c.str_(x, where)
    if isinstance(x.value, bool) or not rx.fullmatch(s):
        c.fail(x.line, where, f"{show(x.value)}: must be {what}")
    return s
