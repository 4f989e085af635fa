"""Before `runner up --resume` relaunches a run: make the checkpoint it resumes from complete on
every node, for nodes WITHOUT shared storage (Raspberry Pis: each node's /out is its own disk).

The trainer finalizes every node's `checkpoints/<name>/` on its own: DCP's `.metadata`, rank 0's
description files, and the shards, RNG files and manifests of that node's ranks only. DCP writes
a replicated tensor once (a DDP model: by rank 0), so a rank may need a shard that lives on
another node; every rank checks on load that every manifest and every file they list is in its
node's copy. So the runner gives each node the union of all nodes' files:

1. list `checkpoints/` on every node (names and sizes; `latest`);
2. take the newest checkpoint whose union over the nodes is complete: `.metadata`, the
   manifest of every rank of the saving run, every file they list with the listed size, no two
   nodes disagreeing on a file (size, then sha256) -- the one every node's `latest` names first.
   A node may lack it altogether (a node that rejoins an elastic run, or one that crashed before
   its rename while another kept a replica of its files: `checkpoint.replicas`);
3. copy each node the files it lacks, relayed through this host (SFTP get from a node that has
   the file, put to the one that lacks it), checked against sha256 (and the manifest's crc32)
   at every hop, written under a temporary name and renamed; an existing file is never replaced.

Steps 2's choice and the copy plan are pure (`choose`, `plan_copies`); the rest is I/O.
Shared storage needs nothing: every node lists the same files and nothing is copied.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runner.core import safe_path
from runner.core.errors import UserError
from runner.delivery import disk_room
from runner.transport.digest import remote_sha256, sha256_file
from runner.transport.ssh import Remote

log = logging.getLogger("runner.resume")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
METADATA = ".metadata"
TMP_PREFIX = ".tmp-"          # the trainer's unfinished saves: never a candidate
SWAP_SUFFIX = ".old"          # the trainer's swap while overwriting a name
SYNC_TMP = ".runner-sync-"    # our own partial copies


@dataclass(frozen=True)
class Listing:
    """One node's checkpoints dir: its `latest` and {checkpoint: {file: size}}."""

    latest: str | None
    checkpoints: dict[str, dict[str, int]]


@dataclass(frozen=True)
class Description:
    """What the checkpoint's own files say (read from whichever node holds them)."""

    step: int | None = None
    world_size: int | None = None
    manifests: dict[int, dict[str, tuple[int, int | None]]] = field(default_factory=dict)  # rank -> {file: (size, crc32)}
    bad: str | None = None   # "node N: name/file: why": a description file that is there but malformed


@dataclass(frozen=True)
class Copy:
    file: str
    src: str
    dst: str
    size: int
    sha256: str


def candidates(listings: dict[str, Listing], steps: dict[str, int | None]) -> list[str]:
    """Checkpoints present on any node, preferred first: the one every node's `latest` names,
    then the others newest first by (step, name), the trainer's own order. Whether the nodes'
    copies together make it whole is `incomplete`'s to say."""
    common = set().union(*(set(li.checkpoints) for li in listings.values())) if listings else set()
    order = sorted(common, key=lambda n: (steps.get(n) if steps.get(n) is not None else -1, n), reverse=True)
    latest = {li.latest for li in listings.values()}
    if len(latest) == 1 and (only := latest.pop()) in common:
        order.remove(only)
        order.insert(0, only)
    return order


def incomplete(name: str, listings: dict[str, Listing], desc: Description) -> str | None:
    """Why the union of the nodes' copies of `name` cannot be resumed from (None: it can)."""
    if desc.bad:
        return desc.bad
    union: dict[str, tuple[int, str]] = {}  # file -> (size, node)
    for node, li in listings.items():
        for f, size in li.checkpoints.get(name, {}).items():
            if f in union and union[f][0] != size:
                return f"{name}/{f} is {union[f][0]} bytes on {union[f][1]} but {size} on {node}"
            union.setdefault(f, (size, node))
    for f in (METADATA, STATE_FILE):
        if f not in union:
            return f"{name}/{f} is on no node"
    if desc.world_size is None:
        return f"{name}/{STATE_FILE} is unreadable"
    for j in range(desc.world_size):
        if j not in desc.manifests:
            return f"{name}/manifest.rank{j}.json (rank {j}'s shard set) is on no node or unreadable"
        for f, (size, _) in desc.manifests[j].items():
            if f not in union:
                return f"{name}/{f} (listed in manifest.rank{j}.json) is on no node"
            if union[f][0] != size:
                return f"{name}/{f} is {union[f][0]} bytes on {union[f][1]}, manifest.rank{j}.json says {size}"
    return None


def plan_copies(name: str, listings: dict[str, Listing], hashes: dict[str, dict[str, str]]) -> list[Copy]:
    """Every (file, node lacking it) of checkpoint `name`, each file from one node holding it
    (spread so no single node serves everything). UserError if two nodes hold different contents."""
    holders: dict[str, list[str]] = {}
    for node in listings:
        for f in sorted(listings[node].checkpoints.get(name, {})):
            holders.setdefault(f, []).append(node)
    served: dict[str, int] = dict.fromkeys(listings, 0)
    order = {n: i for i, n in enumerate(listings)}  # (a list.index per file was O(nodes^2))
    copies: list[Copy] = []
    for f in sorted(holders):
        have = holders[f]
        digests = {hashes[n][f] for n in have}
        if len(digests) > 1:
            raise UserError(f"checkpoint {name}: {f} differs between {', '.join(have)} (sha256); "
                            "not resuming from it")
        digest, size = digests.pop(), listings[have[0]].checkpoints[name][f]
        # Never replace a file a node already has (it matched every other copy).
        lacking = [n for n in listings if n not in have]
        if not lacking:
            continue
        # One source per file: it is fetched once to this host and put to every node lacking it.
        src = min(have, key=lambda n: (served[n], order[n]))
        served[src] += size
        copies += [Copy(f, src, dst, size, digest) for dst in lacking]
    return copies


# --- I/O ---------------------------------------------------------------------------------

# What a node says about its checkpoints is as hostile as the job that wrote them: names are
# checked one component at a time (runner/core/safe_path.py), sizes and counts bounded, and the
# checkpoint's own JSON files read with a cap and checked for shape. A bad name or size is one
# line naming the node and file; a malformed description passes that checkpoint over, naming them.
MAX_FILE_BYTES = 1 << 44      # 16 TiB: no shard is bigger; a node saying so is lying
MAX_FILES = 100_000           # files under checkpoints/ on one node
MAX_JSON_BYTES = 16 << 20     # trainer_state.json, manifest.rank<r>.json
MAX_WORLD = 1 << 20
# The listing's own bound: MAX_FILES records of a checked name pair (2 x 255 bytes) and a size fit
# in it, so an honest node is stopped by MAX_FILES' line, not by Remote.run's 8 MiB default.
MAX_LISTING_BYTES = 64 << 20

# NUL-separated records: no file name can break a record (a newline in a name is just a name).
LIST_SCRIPT = r"""
cd "$1" 2>/dev/null || exit 0
printf 'latest\0%s\0' "$(head -c 256 latest 2>/dev/null | head -n 1)"
for d in */; do
  d=${d%/}
  [ -d "$d" ] || continue
  for f in "$d"/* "$d"/.[!.]*; do
    [ -f "$f" ] && printf 'file\0%s\0%s\0' "$(stat -c %s "$f")" "$f"
  done
done
exit 0
"""


def list_node(remote: Remote, root: str) -> Listing:
    node = remote.node.name
    res = remote.run(["sh", "-c", LIST_SCRIPT, "list", root], timeout=120, max_output=MAX_LISTING_BYTES)
    if res.rc != 0:
        raise UserError(f"node {node}: listing {root} failed: {res.err.strip()[:200]!r}")
    latest: str | None = None
    ckpts: dict[str, dict[str, int]] = {}
    fields = res.out.split("\0")
    i, files = 0, 0
    while i < len(fields) - 1:
        kind = fields[i]
        if kind == "latest":
            latest = fields[i + 1].strip() or None
            i += 2
            continue
        if kind != "file" or i + 2 >= len(fields):
            raise UserError(f"node {node}: listing {root} answered {safe_path.shown(kind)}; not a listing")
        size, path = fields[i + 1], fields[i + 2]
        i += 3
        d, _, f = path.partition("/")
        if d.startswith(TMP_PREFIX) or d.endswith(SWAP_SUFFIX) or f.startswith(SYNC_TMP):
            continue
        why = ("not UTF-8" if "\ufffd" in path else safe_path.name_error(d) or safe_path.name_error(f))
        if why:
            raise UserError(f"node {node}: {root}/{safe_path.shown(path)}: {why} in a checkpoint file's name; "
                            "not resuming (remove or rename it on the node)")
        if not (size.isdigit() and int(size) <= MAX_FILE_BYTES):
            raise UserError(f"node {node}: {root}/{safe_path.shown(path)}: size {safe_path.shown(size)} is not "
                            f"a size up to {MAX_FILE_BYTES} bytes; not resuming")
        files += 1
        if files > MAX_FILES:
            raise UserError(f"node {node}: {root}: more than {MAX_FILES} checkpoint files; not resuming")
        ckpts.setdefault(d, {})[f] = int(size)
    return Listing(latest, ckpts)


def _read_json(remote: Remote, path: str) -> tuple[object, str | None]:
    """(document, None) or (None, why not), read with a cap."""
    try:
        with remote.sftp.open(path, "rb") as fh:
            data = fh.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    if len(data) > MAX_JSON_BYTES:
        return None, f"over {MAX_JSON_BYTES >> 20} MiB"
    try:
        return json.loads(data), None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None, "not JSON"


def _size(v: object) -> bool:
    return type(v) is int and 0 <= v <= MAX_FILE_BYTES


def _manifest(doc: object) -> tuple[dict[str, tuple[int, int | None]] | None, str | None]:
    """{file: (size, crc32)} from a manifest.rank<r>.json document, or why it is not one."""
    if not isinstance(doc, dict):
        return None, "not a manifest ({file: [size, crc32]})"
    out = {}
    for k, v in doc.items():
        if why := safe_path.name_error(k):
            return None, f"lists {safe_path.shown(k)} ({why})"
        if not (isinstance(v, list) and 1 <= len(v) <= 2 and _size(v[0])
                and (len(v) == 1 or v[1] is None or (type(v[1]) is int and 0 <= v[1] < 1 << 32))):
            return None, f"{safe_path.shown(k)}: not [size, crc32] with a size up to {MAX_FILE_BYTES} bytes"
        out[k] = (v[0], v[1] if len(v) > 1 else None)
    return out, None


def describe(name: str, listings: dict[str, Listing], remotes: dict[str, Remote], roots: dict[str, str]) -> Description:
    """Read trainer_state.json and every manifest of `name` from a node that holds it. A file that
    is there but malformed makes `bad` name the node and the file."""
    bad: list[str] = []

    def read(f: str) -> tuple[object, str] | None:
        n = next((n for n, li in listings.items() if f in li.checkpoints.get(name, {})), None)
        if n is None:
            return None
        if listings[n].checkpoints[name][f] > MAX_JSON_BYTES:
            bad.append(f"node {n}: {name}/{f}: {listings[n].checkpoints[name][f]} bytes, over {MAX_JSON_BYTES >> 20} MiB")
            return None
        doc, why = _read_json(remotes[n], f"{roots[n]}/{name}/{f}")
        if why:
            bad.append(f"node {n}: {name}/{f}: {why}")
            return None
        return doc, n

    step = world = None
    got = read(STATE_FILE)
    if got:
        state, n = got
        s, w = (state.get("step"), state.get("world_size")) if isinstance(state, dict) else (None, None)
        if type(s) is int and s >= 0 and type(w) is int and 1 <= w <= MAX_WORLD:
            step, world = s, w
        else:
            bad.append(f"node {n}: {name}/{STATE_FILE}: step {safe_path.shown(str(s))} and world_size "
                       f"{safe_path.shown(str(w))} are not a step >= 0 and a world size in 1..{MAX_WORLD}")
    manifests: dict[int, dict[str, tuple[int, int | None]]] = {}
    files = {f for li in listings.values() for f in li.checkpoints.get(name, {})}
    for f in sorted(files):
        if f.startswith("manifest.rank") and f.endswith(".json") and f[13:-5].isdigit() and len(f) < 24:
            got = read(f)
            if got:
                doc, n = got
                m, why = _manifest(doc)
                if why:
                    bad.append(f"node {n}: {name}/{f}: {why}")
                elif m is not None:  # (_manifest gives a manifest or why not)
                    manifests[int(f[13:-5])] = m
    return Description(step=step, world_size=world, manifests=manifests, bad=bad[0] if bad else None)


def sha256_node(remote: Remote, directory: str, files: list[str], total_bytes: int = 0) -> dict[str, str]:
    """{file: sha256} on the node, every one of them or a UserError."""
    if not files:
        return {}
    sums, failed = remote_sha256(remote, directory, files, total_bytes)
    if failed:
        raise UserError(f"node {remote.node.name}: sha256sum in {directory} failed for "
                        f"{', '.join(list(failed)[:3])}: {next(iter(failed.values()))[:160]}")
    return sums


@dataclass
class SyncResult:
    checkpoint: str | None
    step: int | None = None
    all_latest: bool = True                  # every node's `latest` already names it
    copied: dict[str, list[str]] = field(default_factory=dict)   # dst node -> files
    bytes_copied: int = 0
    passed_over: list[str] = field(default_factory=list)         # newer checkpoints, and why not

    def summary(self) -> str:
        if self.checkpoint is None:
            return "no checkpoint on the nodes yet: the run starts from step 0"
        head = f"resuming from {self.checkpoint} (step {self.step})"
        if not self.copied:
            return head + ": complete on every node"
        per = ", ".join(f"{len(fs)} to {n}" for n, fs in self.copied.items())
        return head + f": copied {per} ({self.bytes_copied / 1e6:.1f} MB, sha256 checked)"


def sync_checkpoints(remotes: dict[str, Remote], run_dirs: dict[str, str],
                     progress: Callable[[str], None] | None = None) -> SyncResult:
    """Pick the checkpoint to resume from and complete it on every node (see the module doc)."""
    roots = {n: posixpath.join(d, CHECKPOINTS) for n, d in run_dirs.items()}
    listings = {n: list_node(remotes[n], roots[n]) for n in run_dirs}
    if not any(li.checkpoints for li in listings.values()):
        return SyncResult(None)
    names = set().union(*(set(li.checkpoints) for li in listings.values()))
    descs = {name: describe(name, listings, remotes, roots) for name in names}
    passed: list[str] = []
    for name in candidates(listings, {n: d.step for n, d in descs.items()}):
        why = incomplete(name, listings, descs[name])
        if why is None:
            hashes = {n: sha256_node(remotes[n], f"{roots[n]}/{name}", sorted(listings[n].checkpoints[name]),
                                     sum(listings[n].checkpoints[name].values()))
                      for n in listings if name in listings[n].checkpoints}
            try:
                copies = plan_copies(name, listings, hashes)
            except UserError as exc:
                why = str(exc)
        if why is not None:
            passed.append(why)
            log.warning("resume: not from %s: %s", name, why)
            continue
        res = SyncResult(name, descs[name].step, all_latest=all(li.latest == name for li in listings.values()),
                         passed_over=passed)
        _execute(copies, name, remotes, roots, descs[name], res, progress)
        return res
    raise UserError("--resume: no checkpoint is complete across the nodes: " + "; ".join(passed[:3]))


def _crc_of(desc: Description, f: str) -> int | None:
    for m in desc.manifests.values():
        if f in m:
            return m[f][1]
    return None


def _execute(copies: list[Copy], name: str, remotes: dict[str, Remote], roots: dict[str, str], desc: Description,
             res: SyncResult, progress: Callable[[str], None] | None) -> None:
    by_file: dict[str, list[Copy]] = {}
    for c in copies:
        by_file.setdefault(c.file, []).append(c)
    if by_file:  # one file at a time passes through this machine's temp folder: the largest must fit
        f, cs = max(by_file.items(), key=lambda kv: kv[1][0].size)
        disk_room.check_room(Path(tempfile.gettempdir()), cs[0].size,
                             f"--resume: relaying {name}/{f} from node {cs[0].src} through this machine",
                             "free space there, or point TMPDIR at a larger filesystem")
    for dst in sorted({c.dst for c in copies}):  # every node has room for what it receives, before any is written
        mine = [c for c in copies if c.dst == dst]
        disk_room.check_node_room(remotes[dst], roots[dst], sum(c.size for c in mine),
                                  f"--resume: completing {name} on node {dst} ({len(mine)} files)",
                                  "free space there (or lower checkpoint.keep_last), then run again")
    for dst in sorted({c.dst for c in copies}):
        remotes[dst].makedirs(f"{roots[dst]}/{name}")  # for a node that lacks the checkpoint altogether
    with tempfile.TemporaryDirectory(prefix="runner-resume-") as tmp:
        for f, cs in by_file.items():
            local = os.path.join(tmp, "blob")
            src = cs[0].src
            _fetch(remotes[src], f"{roots[src]}/{name}/{f}", local, cs[0].size)
            digest, crc, size = sha256_file(local, crc32=True)
            if size != cs[0].size or digest != cs[0].sha256:
                raise UserError(f"node {src}: {roots[src]}/{name}/{f} changed while copying "
                                f"({size} bytes, sha256 {digest[:12]}); not resuming")
            want_crc = _crc_of(desc, f)
            if want_crc is not None and crc != want_crc:
                raise UserError(f"node {src}: {roots[src]}/{name}/{f}: crc32 differs from its manifest (corrupt); "
                                "not resuming from it")
            for c in cs:
                _put(remotes[c.dst], local, f"{roots[c.dst]}/{name}", f, c.sha256, c.size)
                res.copied.setdefault(c.dst, []).append(f)
                res.bytes_copied += c.size
                if progress:
                    progress(f"{name}/{f}: {c.src} -> {c.dst} ({c.size / 1e6:.1f} MB)")
            os.unlink(local)


FETCH_WINDOW = 32 << 20  # the reads in flight at once (1,024 of paramiko's 32 KiB requests)


def _fetch(remote: Remote, path: str, local: str, size: int) -> None:
    """SFTP get of at most `size` bytes: a node that sends more than it listed is named, and this
    host's disk holds no more than the listing said. Read a window at a time: paramiko's
    prefetch(size) lists every request of the whole size up front and sends them all at once
    (a node listing 16 TiB made that list alone ~50 GiB here; an honest 4 GB shard came back
    whole into memory when the disk wrote slower than the link)."""
    node = remote.node.name
    try:
        with remote.sftp.open(path, "rb") as fh, open(local, "wb") as out:
            pos = 0
            while pos < size:
                want = min(FETCH_WINDOW, size - pos)
                got = b"".join(fh.readv([(pos, want)]))
                out.write(got)
                pos += len(got)
                if len(got) < want:  # shorter than listed: the size and sha256 checks name it
                    break
            left = 0 if pos == size and fh.read(1) else 1  # one more byte: more than listed
    except OSError as exc:
        raise UserError(f"node {node}: {path}: cannot read it ({exc.strerror or exc}); not resuming") from None
    if left <= 0:
        raise UserError(f"node {node}: {path}: more than the {size} bytes listed (changed while copying); "
                        "not resuming")


def _put(remote: Remote, local: str, directory: str, f: str, sha256: str, size: int) -> None:
    """Upload under a temporary name, check size and sha256 on the node, then rename. SFTP's
    rename (not posix-rename) refuses to replace an existing file: a copy that appeared meanwhile
    is kept if it is the same file, and is an error otherwise."""
    node = remote.node.name
    tmp = f"{directory}/{SYNC_TMP}{os.getpid()}-{f}"
    final = f"{directory}/{f}"
    try:
        try:
            remote.sftp.put(local, tmp)
        except PermissionError:
            raise UserError(f"node {node}: cannot write into {directory} (permission denied: owned by another "
                            f"user than {remote.node.user}?); not resuming") from None
        except OSError as exc:
            raise UserError(f"node {node}: cannot write {tmp}: {exc.strerror or exc}; not resuming") from None
        st = remote.stat(tmp)
        got = sha256_node(remote, directory, [posixpath.basename(tmp)], size)[posixpath.basename(tmp)]
        if st is None or st.st_size != size or got != sha256:
            raise UserError(f"node {node}: {tmp}: copy does not match its source (size or sha256)")
        try:
            remote.sftp.rename(tmp, final)
        except OSError:
            if remote.stat(final) is None:
                raise UserError(f"node {node}: cannot rename {tmp} to {final}") from None
            if sha256_node(remote, directory, [f], size)[f] != sha256:
                raise UserError(f"node {node}: {final} appeared during the copy with other contents; "
                                "not replacing it") from None
    finally:
        try:
            remote.sftp.remove(tmp)
        except OSError:
            pass
