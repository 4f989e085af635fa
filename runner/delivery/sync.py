"""`job.sync`: local files and directories (weights, a corpus) mirrored to every node, mounted
read-only into the job's containers.

On a node, data is stored by content under <workdir>/data/:

    blobs/<sha256>           each distinct file once, read-only; only a file whose sha256 the node
                             itself computed equal to its name is ever moved here
    trees/<tree digest>/     one synced source as the job sees it: hard links into blobs/; it
                             appears (an atomic rename) only once complete, and never changes

so a second run, another job or another source with the same files moves nothing, a changed
file moves alone, and a transfer cut mid-file leaves at most an `.incoming-*` directory that
nothing trusts. Local sha256s are cached by (path, size, mtime, inode) so a 1 GB checkpoint is
hashed once, not at every `up`.

One direction: scan (local) -> plan (which blobs each node lacks) -> transfer (tar | ssh) ->
verify (on the node) -> assemble the tree. Files only: empty directories are not reproduced,
and every synced file is read-only (mode 0444) in the container.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shlex
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from runner.core import safe_path
from runner.core.errors import UserError
from runner.inventory.job_data import SyncSpec
from runner.planning.paths import NodePaths
from runner.transport.digest import sha256_file
from runner.transport.ssh import Remote
from runner.transport.stream import ssh_stream, transfer_progress

log = logging.getLogger("runner.sync")
HASH_CACHE = Path(os.environ.get("RUNNER_SYNC_CACHE", os.path.expanduser("~/.cache/runner/sync-hashes.json")))
STALL_S = 120.0
BAD_NAME_CHARS = ("\n", "\t", "\r", "\\")
HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


@dataclass(frozen=True)
class Entry:
    rel: str      # path inside the tree ('/'-separated); for a file source, its basename
    path: str     # on this machine
    size: int
    sha: str


@dataclass
class Tree:
    spec: SyncSpec
    entries: list[Entry]
    file_name: str | None   # a single-file source: the name it has inside the tree dir

    @property
    def digest(self) -> str:
        doc = json.dumps([self.file_name, sorted((e.rel, e.sha, e.size) for e in self.entries)])
        return hashlib.sha256(doc.encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def mount_source(self, paths: NodePaths) -> str:
        d = paths.data_tree(self.digest)
        return f"{d}/{self.file_name}" if self.file_name else d


@dataclass
class SyncResult:
    node: str
    dst: str
    files_sent: int = 0
    files_total: int = 0
    bytes_sent: int = 0
    bytes_total: int = 0
    seconds: float = 0.0
    reused: bool = False   # the whole tree was already there


# ---------------------------------------------------------------------------- local scan

class _HashCache:
    """sha256 of local files, reused while (size, mtime_ns, inode) stay the same."""

    def __init__(self, path: Path = HASH_CACHE):
        self.path = path
        try:
            self.data = json.loads(path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.dirty = False

    def sha(self, path: str, st: os.stat_result) -> str:
        key = os.path.realpath(path)
        sig = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.data.get(key)
        if hit and hit[:3] == sig:
            return hit[3]
        h = sha256_file(path)
        self.data[key] = [*sig, h]
        self.dirty = True
        return h

    def save(self) -> None:
        if not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def link_root(src: str) -> str:
    """Where the links under a sync source may lead: the source itself (resolved), or, for a folder
    inside a Hugging Face cache repo (`models--org--name/`, `datasets--...`, `spaces--...` holding
    blobs/ and snapshots/), that repo folder: a snapshot's files are links into its ../../blobs/,
    so syncing `snapshots/<rev>/` and syncing the whole `models--org--name/` both work."""
    real = os.path.realpath(src)
    p = real
    while p != os.path.dirname(p):
        if (os.path.basename(p).startswith(HF_REPO_PREFIXES) and os.path.isdir(os.path.join(p, "blobs"))
                and os.path.isdir(os.path.join(p, "snapshots"))):
            return p
        p = os.path.dirname(p)
    return real


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def scan(specs: list[SyncSpec], cache: _HashCache | None = None) -> list[Tree]:
    """Every file of every source, hashed (cached). A link is followed only where it resolves
    inside the source's link_root(); one leading anywhere else (a model folder with a link to
    /etc/ssh) is refused naming it, before anything behind it is read. A name a node's shell could
    misread, a dangling link, or an unreadable file: one line naming it."""
    cache = cache or _HashCache()
    trees = []
    for spec in specs:
        if os.path.isfile(spec.src):
            # The file the inventory names is taken for what it is, a link or not (its author's choice).
            name = os.path.basename(spec.src)
            _check_name(spec, name)
            st = os.stat(spec.src)
            trees.append(Tree(spec, [Entry(name, spec.src, st.st_size, _sha(cache, spec, spec.src, st))], name))
            continue
        root_ok = link_root(spec.src)
        entries = []
        seen_dirs: set[str] = set()
        for root, dirs, files in os.walk(spec.src, followlinks=True):
            real = os.path.realpath(root)
            if real in seen_dirs:  # a directory link looping back: walk each directory once
                dirs[:] = []
                continue
            seen_dirs.add(real)
            dirs.sort()
            for d in dirs:
                _check_link(spec, os.path.join(root, d), root_ok)  # before os.walk lists what is behind it
            for f in sorted(files):
                p = os.path.join(root, f)
                rel = os.path.relpath(p, spec.src).replace(os.sep, "/")
                _check_name(spec, rel)
                target = _check_link(spec, p, root_ok)
                try:
                    st = os.stat(target)
                except OSError:
                    raise UserError(f"job.sync: {p}: a dangling link or unreadable file; fix or remove it "
                                    f"(src {spec.src})") from None
                if not stat.S_ISREG(st.st_mode):
                    continue  # sockets, fifos: not data
                entries.append(Entry(rel, target, st.st_size, _sha(cache, spec, target, st)))
        trees.append(Tree(spec, entries, None))
    cache.save()
    return trees


def _check_link(spec: SyncSpec, path: str, root: str) -> str:
    """path resolved; a UserError naming it if it resolves outside root."""
    real = os.path.realpath(path)
    if not _inside(real, root):
        raise UserError(f"job.sync: {path!r} is a link to {real!r}, outside {root!r}: refused (a link out of a "
                        f"synced folder would copy that file to every node); copy the file in or remove the link "
                        f"(src {spec.src})")
    return real


def _sha(cache: _HashCache, spec: SyncSpec, path: str, st: os.stat_result) -> str:
    try:
        return cache.sha(path, st)
    except OSError as exc:
        raise UserError(f"job.sync: cannot read {path}: {exc.strerror} (src {spec.src})") from None


def _check_name(spec: SyncSpec, rel: str) -> None:
    if any(ch in rel for ch in BAD_NAME_CHARS) or not rel.isprintable() or safe_path.rel_error(rel):
        raise UserError(f"job.sync: {os.path.join(spec.src, rel)!r}: a file name with a tab, newline, backslash "
                        "or control character cannot be synced; rename it")


# ---------------------------------------------------------------------------- node side

def _receive_script(blobs: str, token: str) -> str:
    """Unpack blobs named by their sha256 into a private dir, keep only those whose content
    hashes to their name. Exit 1: some did not (named on stderr)."""
    b = shlex.quote(blobs)
    return f"""set -u
blobs={b}; in="$blobs/.incoming-{token}"
trap 'rm -rf "$in"' EXIT HUP INT TERM
mkdir -p "$in" && tar -xf - -C "$in" --no-same-owner || exit 3
cd "$in" || exit 3
bad=0
for f in *; do
  [ -f "$f" ] || continue
  h=$(sha256sum < "$f" | cut -c1-64)
  if [ "$h" = "$f" ]; then chmod 0444 "$f" && mv -f "$f" "$blobs/$f" || exit 3
  else echo "sha256 mismatch: $f" >&2; bad=1; fi
done
exit $bad"""


def _assemble_script(blobs: str, trees: str, digest: str, token: str) -> str:
    """Build the tree from 'sha<TAB>path' lines on stdin in a private dir, then rename it into
    place: trees/<digest> exists only complete."""
    return f"""set -u
blobs={shlex.quote(blobs)}; final={shlex.quote(f"{trees}/{digest}")}; t={shlex.quote(f"{trees}/.building-{token}")}
[ -d "$final" ] && exit 0
trap 'rm -rf "$t"' EXIT HUP INT TERM
mkdir -p "$t" || exit 3
tab=$(printf '\\t')
while IFS= read -r line; do
  h=${{line%%"$tab"*}}; p=${{line#*"$tab"}}
  case "$p" in */*) mkdir -p "$t/${{p%/*}}" || exit 3;; esac
  ln "$blobs/$h" "$t/$p" 2>/dev/null || cp "$blobs/$h" "$t/$p" || exit 4
done
mv -T "$t" "$final" 2>/dev/null || [ -d "$final" ] || exit 5"""


def sync_node(remote: Remote, paths: NodePaths, trees: list[Tree], progress=None) -> list[SyncResult]:
    name = remote.node.name
    blobs, tree_root = paths.data_blobs, paths.data_trees
    out = []
    for tree in trees:
        t0 = time.time()
        res = SyncResult(name, tree.spec.dst, files_total=len(tree.entries), bytes_total=tree.total_bytes)
        final = paths.data_tree(tree.digest)
        if remote.stat(final) is not None:
            res.reused, res.seconds = True, time.time() - t0
            out.append(res)
            continue
        remote.makedirs(blobs)
        remote.makedirs(tree_root)
        have = set(remote.sftp.listdir(blobs))
        missing: dict[str, Entry] = {}
        for e in tree.entries:
            if e.sha not in have:
                missing.setdefault(e.sha, e)
        if missing:
            res.bytes_sent = _send(remote, blobs, list(missing.values()), tree.spec, progress)
            res.files_sent = sum(1 for e in tree.entries if e.sha in missing)
            still = set(missing) - set(remote.sftp.listdir(blobs))
            if still:
                raise UserError(f"node {name}: job.sync {tree.spec.src}: {len(still)} file(s) did not arrive; "
                                "rerun (what arrived verified is kept)")
        lines = "".join(f"{e.sha}\t{e.rel}\n" for e in tree.entries).encode()
        r = remote.run(["sh", "-c", _assemble_script(blobs, tree_root, tree.digest, secrets.token_hex(6))],
                       stdin=lines, timeout=600)
        if r.rc != 0:
            raise UserError(f"node {name}: job.sync {tree.spec.src}: assembling {final} failed (exit {r.rc}): "
                            f"{r.err.strip()[-200:] or 'no output'}")
        res.seconds = time.time() - t0
        out.append(res)
    return out


def _send(remote: Remote, blobs: str, entries: list[Entry], spec: SyncSpec, progress) -> int:
    """tar (dereferencing links named by sha256) | ssh node receive+verify. Bytes streamed."""
    name = remote.node.name
    size = sum(e.size for e in entries)
    task = progress.add_task(f"{name}: {spec.dst} ({len(entries)} files)", total=size or 1) if progress else None
    with tempfile.TemporaryDirectory(prefix="runner-sync-") as tmp:
        for e in entries:
            os.symlink(os.path.abspath(e.path), os.path.join(tmp, e.sha))
        listing = os.path.join(tmp, ".names")
        Path(listing).write_text("".join(f"{e.sha}\n" for e in entries))
        local = [["tar", "-chf", "-", "-C", tmp, "--no-recursion", "-T", listing]]
        on_chunk = (lambda n: progress.update(task, advance=n)) if progress else None
        try:
            res = ssh_stream(remote, shlex.join(["sh", "-c", _receive_script(blobs, secrets.token_hex(6))]), local,
                             upload=True, on_chunk=on_chunk, stall_s=STALL_S, size=size)
        finally:
            if task is not None:
                progress.remove_task(task)
    if res.stalled:
        raise UserError(f"node {name}: job.sync {spec.src}: the transfer stalled (nothing moved for {STALL_S:.0f}s)")
    if not res.broken and any(rc for rc in res.local_rcs):
        raise UserError(f"node {name}: job.sync {spec.src}: reading local files failed: {res.local_err or 'tar failed'}")
    if res.ssh_rc == 1:
        raise UserError(f"node {name}: job.sync {spec.src}: files arrived corrupted ({res.ssh_err}); rerun")
    if res.ssh_rc != 0 or res.broken or res.unfinished:
        raise UserError(f"node {name}: job.sync {spec.src}: transfer failed (exit {res.ssh_rc}"
                        f"{', mid-stream' if res.broken else ''}): {res.ssh_err or 'no output'}")
    return res.moved


def sync_to_nodes(cl, homes: dict[str, str], trees: list[Tree], quiet: bool = False) -> list[SyncResult]:
    """Every tree onto every connected node, nodes in parallel; one error naming each node that failed."""
    from runner.planning.paths import node_paths

    remotes = [cl[n.name] for n in cl.inv.nodes]
    with transfer_progress(quiet) as progress:
        res = cl.map(remotes, lambda r: sync_node(r, node_paths(r.node, homes[r.node.name]), trees, progress))
    out, errors = [], []
    for r, val, err in res:
        if err is not None:
            errors.append(str(err) if isinstance(err, UserError) else f"node {r.node.name}: job.sync: {err}")
        else:
            out.extend(val)
    for s in out:
        log.info("sync %s: %s %s (%d/%d files, %.1f MB sent of %.1f MB, %.1fs)", s.node, s.dst,
                 "present" if s.reused else "updated", s.files_sent, s.files_total, s.bytes_sent / 1e6,
                 s.bytes_total / 1e6, s.seconds)
    if errors:
        raise UserError("; ".join(errors))
    return out
