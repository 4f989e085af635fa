"""Reading an inventory (and a `--job` file): every field checked, with ~/.ssh/config filling in
what a node leaves out; the first problem is one line naming file, line and field, e.g.
``hosts/pis.yaml:7: nodes[1].port: must be an integer in 1..65535, got 'ssh'``."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from runner.core.errors import UserError
from runner.inventory.elastic_spec import check_nodes as check_elastic_nodes
from runner.inventory.elastic_spec import parse_elastic
from runner.inventory.job_data import (
    check_destinations,
    check_unsafe_mounts,
    parse_mounts,
    parse_registry,
    parse_sync,
    parse_unsafe_mounts,
)
from runner.inventory.model import (
    ARCH_ALIASES,
    ARCHES,
    BUILD_FIELDS,
    DEFAULT_FIELDS,
    DP_SYNC_MODES,
    FINGERPRINT_RE,
    IMAGE_RE,
    JOB_FIELDS,
    MAX_MEMORY,
    MAX_NODES,
    MAX_RANKS,
    MIN_MEMORY,
    NAME_RE,
    NODE_FIELDS,
    PUSH_MODES,
    ROLES,
    TOP_FIELDS,
    USER_RE,
    BuildSpec,
    Inventory,
    Job,
    Node,
    memory_bytes,
    read_env_file,
    workdir_error,
)
from runner.inventory.notify_spec import COMMAND_FROM_A_FILE, file_url_error
from runner.inventory.notify_spec import parse as parse_notify
from runner.inventory.perseus_spec import check_world, parse_perseus
from runner.inventory.schema import (
    Checker,
    Val,
    canonical_host,
    digest_b64,
    expand,
    host_error,
    kind,
    read_yaml,
    same_host,
    show,
)
from runner.inventory.ssh_config import Resolver, field_value

# --- parsing -----------------------------------------------------------------------------

def load_inventory(path: str | os.PathLike, *, check_files: bool = True, job_path: str | None = None,
                   with_job: bool = True, parsed: tuple[Val | None, Checker] | None = None) -> Inventory:
    """Parse and validate. check_files=False skips files needed only to connect (SSH keys, known_hosts), so a
    dry-run works on a laptop without the cluster's keys. with_job=False ignores the job section (status, logs,
    down, collect only need the nodes). parsed: the file's read_yaml(), when the caller read it (runner.api)."""
    path = str(path)
    root, c = parsed or read_yaml(path, "inventory")
    if root is None:
        c.fail(1, "nodes", "inventory is empty; it needs at least a `nodes:` list")
    top = c.mapping(root, "", TOP_FIELDS)
    base = Path(path).resolve().parent

    defaults: dict[str, Any] = {}
    if "defaults" in top:
        dline, dv = top["defaults"]
        if dv.value is not None:
            c.scope = "every node"
            defaults = node_fields(c, dv, "defaults", DEFAULT_FIELDS, base, check_files)
            c.scope = None

    if "nodes" not in top:
        c.fail(1, "nodes", "missing; list at least one node with name and host")
    nline, nv = top["nodes"]
    if not isinstance(nv.value, list) or not nv.value:
        c.fail(nv.line if nv.value is not None else nline, "nodes",
               f"must be a non-empty list of nodes, got {kind(nv.value) if nv.value else 'nothing'}")
    if len(nv.value) > MAX_NODES:
        c.fail(nv.line, "nodes", f"{len(nv.value)} nodes; at most {MAX_NODES}")
    ssh_config = Resolver(c, check_files)
    nodes: list[Node] = []
    seen: dict[str, int] = {}
    addrs: dict[tuple, str] = {}
    for i, item in enumerate(nv.value):
        where = f"nodes[{i}]"
        named = item.value.get("name") if isinstance(item.value, dict) else None
        name_v = named[1].value if named and isinstance(named[1].value, str) else None
        # A name is only checked later: shown quoted where it holds a control character (one line).
        c.scope = None if name_v is None else f"node {name_v if name_v.isprintable() else repr(name_v)}"
        fields = node_fields(c, item, where, NODE_FIELDS, base, check_files)
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
        job = job_file(job_path, base)
        top.pop("job", None)
    elif "job" in top and top["job"][1].value is not None:
        job = parse_job(c, top["job"][1], base)
    if isinstance(job.image, dict):
        for n in nodes:
            if n.arch and n.arch not in job.image:
                jv = top["job"][1].value if "job" in top else {}
                c.fail(jv["image"][0] if isinstance(jv, dict) and "image" in jv else n.line, "job.image",
                       f"no image for arch {n.arch} (node {n.name}); add `{n.arch}: <tag>`")
    _check_counts(c, nv.line, nodes, job)
    return Inventory(path=path, nodes=nodes, job=job)


def _check_counts(c: Checker, line: int, nodes: list[Node], job: Job) -> None:
    """The job's ranks bounded (MAX_RANKS), and as many as its Perseus plans hold; elastic's
    min_nodes no more than the nodes."""
    world = sum(job.nproc_per_node or n.slots for n in nodes)
    if world > MAX_RANKS:
        c.fail(line, "nodes", f"{world} ranks (each node's slots, or job.nproc_per_node, summed); at most {MAX_RANKS}")
    if job.perseus is not None:
        check_world(job.perseus, world)
    if job.elastic is not None:
        check_elastic_nodes(c, job.elastic, len(nodes))



def node_fields(c: Checker, v: Val, where: str, allowed: set[str], base: Path,
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
            p = expand(c.str_(x, w), base)
            if check_files and not os.path.isfile(p):
                c.fail(x.line, w, f"file not found: {p}")
            out[key] = p
        elif key in ("ssh_config", "proxy_jump"):
            out[key] = field_value(c, key, x.line, w, c.str_(x, w), base, check_files)
        elif key in ("host_key", "proxy_jump_host_key"):
            s = c.str_(x, w)
            if not FINGERPRINT_RE.fullmatch(s):
                c.fail(x.line, w, "must be an OpenSSH SHA256 fingerprint like 'SHA256:<43 base64 chars>' "
                       "(ssh-keyscan -p PORT HOST | ssh-keygen -lf -)")
            if not digest_b64(s[7:]):
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
                c.fail(x.line, w, f"must be a number of CPUs in 0.01..1024 (Docker --cpus, e.g. 0.5), got {show(x.value)}")
            out[key] = float(x.value)
        elif key == "memory":
            raw = str(x.value) if isinstance(x.value, (str, int)) and not isinstance(x.value, bool) else None
            size = memory_bytes(raw) if raw is not None else None
            if size is None or not MIN_MEMORY <= size <= MAX_MEMORY:
                c.fail(x.line, w, f"must be a size like 512m or 4g (Docker --memory, at least 6m, at most "
                       f"{MAX_MEMORY >> 30}g), got {show(x.value)}")
            out[key] = raw.strip().lower()
        elif key == "compress":
            if not isinstance(x.value, bool) and x.value != "auto":
                c.fail(x.line, w, f"must be true, false or auto (the default: compress where the link is slower "
                       f"than this machine's zlib), got {show(x.value)}")
            out[key] = None if x.value == "auto" else x.value
        elif key == "gpus":
            if x.value == "all" or x.value is None:
                out[key] = x.value
            else:
                out[key] = c.int_(x, w, 0, 1024)
        elif key == "env":
            out[key] = c.str_map(x, w, env=True)
    return out


def parse_dp_sync(c: Checker, x: Val) -> str:
    """job.dp_sync: auto chooses from the measured links at plan time (runner/planning/dp_sync.py)."""
    if x.value not in DP_SYNC_MODES:
        c.fail(x.line, "job.dp_sync", f"must be one of {', '.join(DP_SYNC_MODES)}, got {show(x.value)}")
    return x.value


def parse_hang_timeout(c: Checker, x: Val) -> int | None:
    """job.hang_timeout: contract/hang.py's steady budget (the trainer gets it as --watch.hang_timeout_s)."""
    if x.value == "auto":
        return None
    if isinstance(x.value, str):
        c.fail(x.line, "job.hang_timeout", f"must be 'auto' or whole seconds in 10..86400, got {x.value!r}")
    return c.int_(x, "job.hang_timeout", 10, 86400)


JOB_PARSERS = {"mounts": parse_mounts, "unsafe_mounts": parse_unsafe_mounts, "registry": parse_registry,
               "elastic": parse_elastic, "dp_sync": parse_dp_sync,
               "hang_timeout": parse_hang_timeout}


def parse_job(c: Checker, v: Val, base: Path) -> Job:
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
            p = expand(c.str_(x, w), base)
            if not os.path.isfile(p):
                c.fail(x.line, w, f"config file not found: {p}")
            job.config = p
        elif key in ("args", "command"):
            if not isinstance(x.value, list):
                c.fail(x.line, w, f"must be a list of strings, got {kind(x.value)}")
            vals = []
            for j, a in enumerate(x.value):
                if isinstance(a.value, (dict, list)) or a.value is None:
                    c.fail(a.line, f"{w}[{j}]", f"must be a string or number, got {kind(a.value)}")
                vals.append(str(a.value).lower() if isinstance(a.value, bool) else str(a.value))
            setattr(job, key, vals)
        elif key == "env":
            job.env = c.str_map(x, w, env=True)
        elif key == "env_file":
            p = expand(c.str_(x, w), base)
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
                c.fail(x.line, w, f"must be seconds in 0..3600, got {show(x.value)}")
            job.grace_period = float(x.value)
        elif key == "build":
            job.build = _build(c, x, w, base)
        elif key == "sync":
            job.sync = parse_sync(c, x, lambda p: expand(p, base))
        elif key in JOB_PARSERS:  # mounts, unsafe_mounts, registry, elastic, dp_sync: their own checks
            setattr(job, key, JOB_PARSERS[key](c, x))
        elif key == "perseus":
            job.perseus = parse_perseus(c, x, lambda p: expand(p, base))
        elif key == "notify":
            try:
                job.notify = parse_notify([a.value for a in x.value] if isinstance(x.value, list) else x.value)
            except ValueError as exc:
                c.fail(x.line, w, str(exc))
            if job.notify.argv:  # as ssh_config's Match exec: a file named here never runs a command here
                c.fail(x.line, w, COMMAND_FROM_A_FILE)
            if why := file_url_error(job.notify.url):  # nor posts to this machine's own services
                c.fail(x.line, w, why)
            job.notify = replace(job.notify, from_file=True)
        elif key == "push":
            job.push = c.str_(x, w)
            if job.push not in PUSH_MODES:
                c.fail(x.line, w, f"must be {' or '.join(PUSH_MODES)}, got {job.push!r}")
    check_destinations(c, job.sync, job.mounts)
    check_unsafe_mounts(c, job.mounts, job.unsafe_mounts, m["unsafe_mounts"][0] if "unsafe_mounts" in m else v.line)
    return job


def _image(c: Checker, v: Val, where: str) -> str:
    tag = c.str_(v, where)
    if not IMAGE_RE.fullmatch(tag):
        c.fail(v.line, where, f"{tag!r} is not an image reference (like name:tag or registry/name:tag)")
    return tag


def _build(c: Checker, v: Val, where: str, base: Path) -> dict[str, BuildSpec]:
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


def _build_spec(c: Checker, v: Val, where: str, base: Path) -> BuildSpec:
    m = c.mapping(v, where, BUILD_FIELDS)
    if "context" not in m:
        c.fail(v.line, where, "missing context (the directory to build from)")
    line, x = m["context"]
    ctx = expand(c.str_(x, f"{where}.context"), base)
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


def job_file(job_path: str, base: Path) -> Job:
    """`--job FILE`: a YAML file holding a job section (top-level `job:` or the fields directly)."""
    root, c = read_yaml(job_path, "job file")
    if root is None or not isinstance(root.value, dict):
        c.fail(1, "job", "must be a mapping of job fields")
    if set(root.value) == {"job"}:
        root = root.value["job"][1]
    return parse_job(c, root, Path(job_path).resolve().parent)
