"""The job's data: what a job needs besides its image, as the inventory says it.

    job.sync:     [{src: LOCAL_PATH, dst: CONTAINER_PATH}]   copied to every node (runner/delivery/sync.py),
                                                             mounted read-only at dst
    job.mounts:   {NODE_PATH: CONTAINER_PATH[:ro|:rw]}        already on the nodes (an HF cache, NFS),
                                                             read-only unless :rw
    job.unsafe_mounts: [NODE_PATH, ...]                      mounts that give the job the node itself
                                                             (engine socket, /, /proc, writable /etc...):
                                                             refused unless named here
    job.registry: HOST[:PORT]                                 nodes `docker pull` the job's tags from
                                                             there instead of a push (runner/delivery/registry.py)

Parsing only (no I/O beyond checking that a sync source exists). Every path that reaches a node's
shell or a docker bind spec is refused unless made of plain characters, and container paths may
not overlap /out, the runner's own mounts or each other: a sync mounted over /out would hide the
run's checkpoints. Every path must be normal (no '.', '..' or '//': POSIX keeps a leading '//').
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
from dataclasses import dataclass

# A bind spec splits on ':' and ','; a shell reads the rest. Same rule as a node's workdir.
PLAIN_PATH_RE = re.compile(r"[A-Za-z0-9._+@/-]+")
REGISTRY_RE = re.compile(r"(?P<host>[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
                         r"(:(?P<port>[0-9]{1,5}))?")
OUT = "/out"
RUNNER_OWN = "/run/runner"  # the secrets file and the gate dir are mounted under it
KERNEL_PATHS = ("/proc", "/sys", "/dev")  # on the node, and as mount points in the container
# job.mounts node paths that give the job the node itself (host_access): refused unless
# job.unsafe_mounts names them. One rule: a node path EQUAL to, INSIDE or ABOVE one of these
# (component by component, `*` matching one component, `~` the SSH user's home) is refused:
# `/proc/1/root` is the node's root as surely as `/proc` is, and `/home` holds every `~/.ssh`.
# By name only: the runner cannot see the node's links at plan time (docs/security.md).
KERNEL = "the node's kernel interfaces or devices"
ENGINE = "the node's container engine sockets or runtime dirs (root on the node, read-only or not)"
KEYS = "the node's SSH keys or credentials (read-only too)"
WRITABLE = "the node's system files or SSH keys, writable"
CREDENTIAL_DIRS = (".ssh", ".gnupg", ".docker", ".kube", ".aws")
PROTECTED: tuple[tuple[str, str], ...] = (  # (pattern, what): refused read-only too
    *((k, KERNEL) for k in KERNEL_PATHS),
    *((e, ENGINE) for e in ("/run", "/var/run", "/var/lib/docker", "/var/lib/containerd", "/var/lib/containers",
                            "/var/lib/kubelet", "/etc/kubernetes", "/tmp/.X11-unix")),
    *((k, KEYS) for k in ("/etc/ssh", "/etc/shadow", "/etc/gshadow", "/root", "/tmp/ssh-*",
                          *(f"{home}/{d}" for home in ("/home/*", "~") for d in CREDENTIAL_DIRS))),
)
PROTECTED_WRITABLE = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/var/lib",
                      "/var/spool", "/home/*/.*", "~/.*")  # refused writable: code the node runs, as root or the user
SOCKET_SUFFIXES = (".sock", ".socket")  # an engine's (or an agent's) API, wherever it is kept


@dataclass(frozen=True)
class SyncSpec:
    src: str    # absolute, on this machine: a file or a directory
    dst: str    # absolute, in the container
    line: int = 0


@dataclass(frozen=True)
class MountSpec:
    node_path: str   # absolute or ~/... (the SSH user's home), on each node
    dst: str
    rw: bool = False
    line: int = 0


def _normal(p: str) -> bool:
    """No '.', '..' or empty component, no trailing '/': the path is what it says (POSIX keeps a
    leading '//' through normpath, so '//out' would pass a normpath comparison and not be /out)."""
    parts = p.split("/")[1:]
    return bool(parts) and all(x not in ("", ".", "..") for x in parts)


def container_path_error(p: str) -> str | None:
    """Why p cannot be a container mount point, or None."""
    if not p.startswith("/"):
        return f"{p!r} is relative: a container path must be absolute"
    if not PLAIN_PATH_RE.fullmatch(p):
        return f"{p!r}: use letters, digits and . _ - + @ / only (a docker bind spec splits on ':' and ',')"
    if not _normal(p):
        return f"{p!r}: give a normalized path other than / (no '..', '.', '//' or trailing '/')"
    if any(p == k or p.startswith(k + "/") for k in KERNEL_PATHS):
        return (f"{p!r} is in the container's kernel interfaces or devices (/proc, /sys, /dev): a mount there "
                "reaches the node's kernel; mount it somewhere else (e.g. /data/...)")
    return None


def node_path_error(p: str) -> str | None:
    if p.startswith("~") and not (p == "~" or p.startswith("~/")):
        return f"{p!r}: only ~ or ~/path (the SSH user's own home) is allowed"
    if not p.startswith(("/", "~")):
        return f"{p!r} is relative: use an absolute path or ~/path on the node (docker takes a relative one for a named volume)"
    if not PLAIN_PATH_RE.fullmatch(p.replace("~", "", 1)):
        return f"{p!r}: use letters, digits and . _ - + @ / only (the path reaches a shell and a docker bind spec)"
    rest = p[1:] if p.startswith("~") else p    # "" for ~ itself
    if rest not in ("", "/") and not _normal(rest[:-1] if rest.endswith("/") else rest):
        return f"{p!r}: give a normalized path (no '..', '.' or '//')"
    return None


def _parts(p: str) -> list[str]:
    """A normal node path's components; `~` (the SSH user's home) is a component of its own."""
    return ["~", *p[1:].split("/")[1:]] if p.startswith("~") else [x for x in p.split("/") if x]


def related(path: str, pattern: str) -> bool:
    """path is pattern, lies inside it, or holds it (an ancestor of what it names): their common
    leading components match, each by fnmatch (a path's own components are plain characters)."""
    a, b = _parts(path), _parts(pattern)
    n = min(len(a), len(b))
    return all(fnmatch.fnmatchcase(x, y) for x, y in zip(a[:n], b[:n], strict=True))


def host_access(m: MountSpec) -> str | None:
    """What a job.mounts entry hands the job beyond data, or None: one rule for every protected
    path (PROTECTED, and PROTECTED_WRITABLE when the mount is writable), equal, inside or above."""
    p = m.node_path
    if p == "/":
        return "the node's whole filesystem (its engine socket too: root on the node)"
    if posixpath.basename(p).endswith(SOCKET_SUFFIXES):
        return ENGINE
    kernel = next((what for pat, what in PROTECTED if what == KERNEL and related(p, pat)), None)
    if kernel:
        return kernel
    if m.rw and any(related(p, w) for w in PROTECTED_WRITABLE):
        return WRITABLE
    return next((what for pat, what in PROTECTED if related(p, pat)), None)


def overlaps(a: str, b: str) -> bool:
    """One path is the other or lies under it."""
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def parse_sync(c, v, base_expand) -> list[SyncSpec]:
    """c: the inventory's checker (fail/str_/mapping), v: the `job.sync` value (line-numbered)."""
    w = "job.sync"
    if not isinstance(v.value, list):
        c.fail(v.line, w, "must be a list of {src: LOCAL_PATH, dst: CONTAINER_PATH}")
    out = []
    for i, item in enumerate(v.value):
        wi = f"{w}[{i}]"
        m = c.mapping(item, wi, {"src", "dst"})
        for req in ("src", "dst"):
            if req not in m:
                c.fail(item.line, f"{wi}.{req}", "missing (each entry needs src, a local path, and dst, a container path)")
        sline, sv = m["src"]
        src = base_expand(c.str_(sv, f"{wi}.src"))
        if not os.path.exists(src):
            c.fail(sline, f"{wi}.src", f"not found on this machine: {src}")
        if not (os.path.isfile(src) or os.path.isdir(src)):
            c.fail(sline, f"{wi}.src", f"{src} is neither a file nor a directory")
        dline, dv = m["dst"]
        dst = c.str_(dv, f"{wi}.dst")
        if why := container_path_error(dst):
            c.fail(dline, f"{wi}.dst", why)
        out.append(SyncSpec(os.path.abspath(src), dst, dline))
    return out


def parse_mounts(c, v) -> list[MountSpec]:
    w = "job.mounts"
    if not isinstance(v.value, dict):
        c.fail(v.line, w, "must be a mapping of NODE_PATH: CONTAINER_PATH (append :rw for a writable mount)")
    out = []
    for node_path, (kline, x) in v.value.items():
        wk = f"{w}.{node_path}"
        if why := node_path_error(str(node_path)):
            c.fail(kline, wk, why)
        spec = c.str_(x, wk)
        dst, sep, mode = spec.rpartition(":")
        if not sep:
            dst, mode = spec, "ro"
        if mode not in ("ro", "rw"):
            c.fail(x.line, wk, f"{spec!r}: the mode after ':' must be ro or rw")
        if why := container_path_error(dst):
            c.fail(x.line, wk, why)
        out.append(MountSpec(str(node_path).rstrip("/") or "/", dst, mode == "rw", x.line))
    return out


def parse_unsafe_mounts(c, v) -> list[str]:
    """`job.unsafe_mounts: [NODE_PATH, ...]`: the job.mounts entries that hand the job the node
    (host_access), mounted on purpose: each as written under job.mounts."""
    w = "job.unsafe_mounts"
    if not isinstance(v.value, list):
        c.fail(v.line, w, "must be a list of job.mounts node paths")
    return [c.str_(x, f"{w}[{i}]") for i, x in enumerate(v.value)]


def check_unsafe_mounts(c, mounts: list[MountSpec], allowed: list[str], line: int) -> None:
    """Every mount that hands the job the node is named in job.unsafe_mounts, and every name there is a mount."""
    named = {p.rstrip("/") or "/" for p in allowed}
    for m in mounts:
        if (what := host_access(m)) and m.node_path not in named:
            c.fail(m.line, f"job.mounts.{m.node_path}", f"gives the job {what}; if that is meant, name it in "
                   f"job.unsafe_mounts: [{m.node_path}]")
    extra = named - {m.node_path for m in mounts}
    if extra:
        c.fail(line, "job.unsafe_mounts", f"{sorted(extra)[0]!r} is not a job.mounts node path")


def parse_registry(c, v) -> str:
    reg = c.str_(v, "job.registry").strip()
    m = REGISTRY_RE.fullmatch(reg)
    if not m or (m["port"] and not 1 <= int(m["port"]) <= 65535):
        c.fail(v.line, "job.registry", f"{reg!r} is not HOST or HOST:PORT (e.g. registry.lan:5000)")
    return reg


def check_destinations(c, sync: list[SyncSpec], mounts: list[MountSpec]) -> None:
    """No container path may overlap /out, the runner's own mounts, or another sync/mount."""
    seen: list[tuple[str, str]] = []
    for kind, dst, line in [("job.sync", s.dst, s.line) for s in sync] + [("job.mounts", m.dst, m.line) for m in mounts]:
        for reserved, what in ((OUT, "the run dir (/out)"), (RUNNER_OWN, "the runner's own mounts (/run/runner)")):
            if overlaps(dst, reserved):
                c.fail(line, kind, f"{dst} overlaps {what}; mount it somewhere else (e.g. /data/...)")
        for other_kind, other in seen:
            if overlaps(dst, other):
                c.fail(line, kind, f"{dst} overlaps {other} ({other_kind}); give each its own directory")
        seen.append((kind, dst))


def registry_ref(registry: str, tag: str) -> str:
    """The reference a node pulls for tag: tag itself when it already names the registry."""
    return tag if tag.startswith(registry + "/") else f"{registry}/{tag}"


def refuse_for(job, backend: str) -> None:
    """The backends that do not carry job.sync/mounts/registry yet say so instead of dropping them."""
    from runner.core.errors import UserError

    used = [name for name, on in (("job.sync", job.sync), ("job.mounts", job.mounts), ("job.registry", job.registry),
                                  ("job.perseus", getattr(job, "perseus", None))) if on]
    if used:
        raise UserError(f"{', '.join(used)}: not supported by {backend} yet (the SSH runner's `runner up` is); "
                        "put the data on the cluster's shared storage and pass its path in job.args")
