"""job.sync against the sandbox cluster (real sshd + dockerd per node): every node ends with the
same bytes, stored by content, mounted read-only; a second sync moves nothing, a changed file
moves alone, and neither a cut nor a corrupted transfer leaves a file a later sync trusts."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.delivery.sync import Entry, _HashCache, _send, scan, sync_node
from runner.inventory import load_inventory
from runner.inventory.job_data import SyncSpec
from runner.planning.paths import NodePaths
from runner.transport.ssh import Remote
from tests.support.runner_helpers import containers_created, node_workdir, runner, write_job

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")
SYNC_RE = re.compile(r"^(\S+)\s+(\S+)\s+(present|updated)\s+files (\d+)/(\d+)\s+([\d.]+) MB of ([\d.]+) MB", re.M)


def parse_sync(out: str) -> dict[tuple[str, str], dict]:
    return {(m[1], m[2]): {"action": m[3], "sent": int(m[4]), "total": int(m[5]), "mb": float(m[6]),
                           "total_mb": float(m[7])} for m in SYNC_RE.finditer(out)}


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tree_files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "shards").mkdir(parents=True)
    # Contents no other test has synced (the nodes' blob store is shared): this test's bytes only.
    config = f'{{"hidden": 64, "test": "{os.urandom(8).hex()}"}}\n'
    (d / "config.json").write_text(config)
    (d / "tokenizer.json").write_text(config)  # same bytes as config.json
    for i in range(3):
        (d / "shards" / f"w{i}.bin").write_bytes(os.urandom(1 << 20))
    return d


def test_sync_mirrors_stores_by_content_and_moves_only_changes(sandbox, pushed, tmp_path, model_dir):
    job = write_job(tmp_path, extra={"sync": [{"src": str(model_dir), "dst": "/data/model"}]})
    env = {"RUNNER_SYNC_CACHE": str(tmp_path / "hashes.json")}
    first = runner("sync", "-i", str(sandbox), "--job", str(job), env=env)
    assert first.returncode == 0, first.stderr
    rows = parse_sync(first.stdout)
    size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    assert set(rows) == {(n, "/data/model") for n in NODES}
    for r in rows.values():
        # 5 files, 4 distinct contents: the duplicate json travels once (tar headers on top).
        assert r["action"] == "updated" and r["sent"] == r["total"] == 5, r
        assert abs(r["mb"] - size / 1e6) <= 0.06 and r["total_mb"] == round(size / 1e6, 1), r  # printed as 0.1 MB
    # The nodes' data dirs are shared with the other tests (their trees and blobs may be there):
    # this test looks at its own tree and its own blobs only.
    want = tree_files(model_dir)
    digest = scan_digest(model_dir, tmp_path)
    assert len(set(want.values())) == 4
    for node in NODES:
        data = node_workdir(sandbox, node) / "data"
        tree = data / "trees" / digest
        assert tree_files(tree) == want
        for rel, h in want.items():  # by content: each file of the tree is its blob (4 blobs for 5 files)
            blob = data / "blobs" / h
            assert stat.S_IMODE(blob.stat().st_mode) == 0o444 and sha(blob) == h
            assert (tree / rel).stat().st_ino == blob.stat().st_ino, rel
        assert not list((data / "blobs").glob(".incoming-*")) and not list((data / "trees").glob(".building-*"))

    again = runner("sync", "-i", str(sandbox), "--job", str(job), env=env)
    assert again.returncode == 0, again.stderr
    assert all(r["action"] == "present" and r["sent"] == 0 and r["mb"] == 0.0 for r in parse_sync(again.stdout).values())

    (model_dir / "shards" / "w1.bin").write_bytes(os.urandom(1 << 20))
    changed = runner("sync", "-i", str(sandbox), "--job", str(job), env=env)
    assert changed.returncode == 0, changed.stderr
    for r in parse_sync(changed.stdout).values():
        assert r["action"] == "updated" and r["sent"] == 1 and 1.0 <= r["mb"] <= 1.1, r
    for node in NODES:
        trees = node_workdir(sandbox, node) / "data" / "trees"
        assert tree_files(trees / scan_digest(model_dir, tmp_path)) == tree_files(model_dir)


def scan_digest(src: Path, tmp: Path) -> str:
    (t,) = scan([SyncSpec(str(src), "/data/model")], _HashCache(tmp / "hashes.json"))
    return t.digest


def test_a_job_reads_synced_data_read_only_in_its_container(sandbox, pushed, tmp_path, model_dir):
    """`up` syncs before launching; the container sees the bytes at dst and cannot write there."""
    script = ("import hashlib, os, pathlib\n"
              "out = pathlib.Path('/out') / ('seen-' + os.environ['NODE_NAME'] + '.txt')\n"
              "root = pathlib.Path('/data/model')\n"
              "lines = [f'{p.relative_to(root)} {hashlib.sha256(p.read_bytes()).hexdigest()}'\n"
              "         for p in sorted(root.rglob('*')) if p.is_file()]\n"
              "try:\n"
              "    (root / 'new').write_text('x'); lines.append('writable')\n"
              "except OSError as e:\n"
              "    lines.append(f'read-only {e.errno}')\n"
              "lines.append(pathlib.Path('/data/corpus.txt').read_text().strip())\n"
              "out.write_text('\\n'.join(lines) + '\\n')\n")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the corpus\n")
    job = write_job(tmp_path, extra={"command": ["python", "-c", script],
                                     "sync": [{"src": str(model_dir), "dst": "/data/model"},
                                              {"src": str(corpus), "dst": "/data/corpus.txt"}]})
    proc = runner("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(tmp_path / "logs"),
                  env={"RUNNER_SYNC_CACHE": str(tmp_path / "hashes.json")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    want = [f"{k} {v}" for k, v in tree_files(model_dir).items()] + ["read-only 30", "the corpus"]  # EROFS
    for node in NODES:
        seen = (node_workdir(sandbox, node) / "runs" / run_id / f"seen-{node}.txt").read_text().splitlines()
        assert seen == want, (node, seen)


def _connect(sandbox: Path, node: str) -> Remote:
    return Remote(load_inventory(sandbox, with_job=False).node(node)).connect()


def test_cut_and_corrupted_transfers_leave_nothing_trusted(sandbox, pushed, tmp_path):
    """A stream cut mid-file, and a file whose bytes do not match its name, leave no blob and no
    tree; the next sync then completes with the right bytes."""
    src = tmp_path / "big"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(8 << 20))
    spec = SyncSpec(str(src), "/data/big")
    (tree,) = scan([spec], _HashCache(tmp_path / "h.json"))
    node = "node-1"
    wd = node_workdir(sandbox, node)
    paths = NodePaths(str(wd))
    blob = wd / "data" / "blobs" / tree.entries[0].sha

    class CutAfterFirstMB:
        """Stands in for rich's Progress: kills our ssh once the first MB went out."""
        def add_task(self, *a, **k):
            return 0

        def remove_task(self, task):
            pass

        def update(self, task, advance):
            import psutil

            for p in psutil.Process().children(recursive=True):
                if p.name() == "ssh":
                    p.kill()

    with _connect(sandbox, node) as r:
        with pytest.raises(UserError) as exc:
            sync_node(r, paths, [tree], CutAfterFirstMB())
        assert str(exc.value).startswith(f"node {node}: job.sync {src}: transfer failed"), exc.value
        assert not blob.exists() and not (wd / "data" / "trees" / tree.digest).exists()

        # Bytes that do not hash to their name: refused on the node, nothing kept.
        liar = tmp_path / "liar.bin"
        liar.write_bytes(b"not what the name says")
        fake = Entry("a.bin", str(liar), liar.stat().st_size, tree.entries[0].sha)
        with pytest.raises(UserError) as exc:
            _send(r, paths.data_blobs, [fake], spec, None)
        assert str(exc.value) == (f"node {node}: job.sync {src}: files arrived corrupted "
                                  f"(sha256 mismatch: {tree.entries[0].sha}); rerun")
        assert not blob.exists()
        assert not list((wd / "data" / "blobs").glob(".incoming-*"))

        (res,) = sync_node(r, paths, [tree])
    assert res.files_sent == 1 and res.bytes_sent >= 8 << 20
    assert sha(wd / "data" / "trees" / tree.digest / "a.bin") == tree.entries[0].sha


def test_sync_names_the_node_and_starts_nothing_when_a_node_cannot_store(sandbox, pushed, tmp_path, model_dir):
    """A node whose data dir cannot be written (a read-only or full disk): one line naming the
    node and the sync; `up` starts no container anywhere."""
    node = "node-2"
    data = node_workdir(sandbox, node) / "data"
    data.mkdir(exist_ok=True)
    blocked = data / "blobs"
    moved = None
    if blocked.exists():
        moved = data / "blobs.keep"
        blocked.rename(moved)
    blocked.write_text("a file where the blob dir should be\n")
    try:
        job = write_job(tmp_path, extra={"sync": [{"src": str(model_dir), "dst": "/data/model"}]})
        since = time.time()
        proc = runner("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(tmp_path / "logs"),
                      env={"RUNNER_SYNC_CACHE": str(tmp_path / "hashes.json")})
    finally:
        blocked.unlink()
        if moved:
            moved.rename(blocked)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errs = [ln for ln in proc.stderr.splitlines() if ln.startswith("runner: error:")]
    assert len(errs) == 1 and f"node {node}" in errs[0], proc.stderr
    assert "started" not in proc.stdout
    assert containers_created(sandbox, since) == {n: [] for n in NODES}  # none, not even a created one
