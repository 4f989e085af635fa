"""job.sync, job.mounts and job.registry as the inventory states them (runner/inventory/job_data.py), the
plan's mounts (read-only unless :rw), and the local side of a sync (runner/delivery/sync.py scan): no
network, nothing contacted."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.delivery.sync import _HashCache, scan
from runner.inventory import load_inventory
from runner.planning.plan import Facts, make_plan
from tests import REPO
from tests.support.runner_helpers import no_socket_env


def _inv(tmp_path: Path, job: str) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n"
                 "  - {name: a, host: 10.9.0.1, arch: amd64, workdir: /w}\n"
                 "  - {name: b, host: 10.9.0.2, arch: amd64}\n"
                 f"job:\n  image: t:1\n{job}")
    return p


@pytest.fixture
def data(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"a": 1}\n')
    (d / "sub" / "w.bin").write_bytes(os.urandom(4096))
    (d / "copy.json").write_text('{"a": 1}\n')  # same content as config.json: one blob
    return d


def test_sync_mounts_registry_parsed(tmp_path, data):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello\n")
    inv = load_inventory(_inv(tmp_path, f"  sync:\n    - {{src: {data}, dst: /data/model}}\n"
                                        f"    - {{src: {corpus}, dst: /data/corpus.txt}}\n"
                                        "  mounts: {~/hf: /hf, /nfs/ds: '/ds:rw'}\n"
                                        "  registry: registry.lan:5000\n"), check_files=False)
    job = inv.job
    assert [(s.src, s.dst, s.line) for s in job.sync] == [(str(data), "/data/model", 7), (str(corpus), "/data/corpus.txt", 8)]
    assert [(m.node_path, m.dst, m.rw) for m in job.mounts] == [("~/hf", "/hf", False), ("/nfs/ds", "/ds", True)]
    assert job.registry == "registry.lan:5000"


# (id, job text, expected "line: field" start, a fragment of the reason)
BAD = [
    ("src_missing", "  sync: [{src: /no/such/dir, dst: /data}]\n", ":6: job.sync[0].src", "not found on this machine"),
    ("dst_relative", "  sync: [{src: SRC, dst: data}]\n", ":6: job.sync[0].dst", "relative"),
    ("dst_colon", "  sync: [{src: SRC, dst: '/data:rw'}]\n", ":6: job.sync[0].dst", "bind spec"),
    ("dst_dotdot", "  sync: [{src: SRC, dst: /data/../out}]\n", ":6: job.sync[0].dst", "normalized"),
    ("dst_root", "  sync: [{src: SRC, dst: /}]\n", ":6: job.sync[0].dst", "other than /"),
    ("dst_out", "  sync: [{src: SRC, dst: /out/data}]\n", ":6: job.sync", "overlaps the run dir (/out)"),
    ("dst_parent_of_out", "  sync: [{src: SRC, dst: /out}]\n", ":6: job.sync", "overlaps the run dir"),
    ("dst_runner_own", "  sync: [{src: SRC, dst: /run/runner/x}]\n", ":6: job.sync", "runner's own mounts"),
    ("dst_overlap_mount", "  sync: [{src: SRC, dst: /data}]\n  mounts: {/nfs: /data/nfs}\n", ":7: job.mounts",
     "overlaps /data (job.sync)"),
    ("two_syncs_same_dst", "  sync: [{src: SRC, dst: /d}, {src: SRC, dst: /d}]\n", ":6: job.sync", "overlaps /d"),
    ("sync_not_list", "  sync: {src: SRC}\n", ":6: job.sync", "must be a list"),
    ("sync_missing_dst", "  sync: [{src: SRC}]\n", ":6: job.sync[0].dst", "missing"),
    ("sync_unknown_field", "  sync: [{src: SRC, dst: /d, mode: rw}]\n", ":6: job.sync[0].mode", "unknown field"),
    ("mount_relative", "  mounts: {data: /data}\n", ":6: job.mounts.data", "relative"),
    ("mount_other_home", "  mounts: {'~bob/x': /data}\n", ":6: job.mounts.~bob/x", "own home"),
    ("mount_shell", "  mounts: {'/x;id': /data}\n", ":6: job.mounts./x;id", "letters, digits"),
    ("mount_bad_mode", "  mounts: {/x: '/data:rx'}\n", ":6: job.mounts./x", "ro or rw"),
    ("mount_dst_relative", "  mounts: {/x: data}\n", ":6: job.mounts./x", "relative"),
    ("registry_scheme", "  registry: 'http://r:5000'\n", ":6: job.registry", "not HOST or HOST:PORT"),
    ("registry_port", "  registry: 'r:99999'\n", ":6: job.registry", "not HOST or HOST:PORT"),
    ("registry_option", "  registry: '-H evil'\n", ":6: job.registry", "not HOST or HOST:PORT"),
]


@pytest.mark.parametrize("name,job,where,why", BAD, ids=[b[0] for b in BAD])
def test_bad_job_data_is_one_line(tmp_path, data, name, job, where, why):
    p = _inv(tmp_path, job.replace("SRC", str(data)))
    with pytest.raises(UserError) as ei:
        load_inventory(p, check_files=False)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{p}{where}"), msg
    assert why in msg, msg


def test_cli_refuses_a_missing_sync_src_in_one_line_and_contacts_nothing(tmp_path):
    p = _inv(tmp_path, "  sync: [{src: /no/such/dir, dst: /data}]\n")
    proc = subprocess.run([sys.executable, "-m", "runner", "up", "-i", str(p), "--dry-run"], capture_output=True,
                          text=True, cwd=REPO, env=no_socket_env(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr == f"runner: error: {p}:6: job.sync[0].src: not found on this machine: /no/such/dir\n"


def test_scan_hashes_files_once_and_dedups(tmp_path, data, monkeypatch):
    import runner.delivery.sync as sync_mod
    from runner.inventory.job_data import SyncSpec

    hashed: list[str] = []
    real = sync_mod.sha256_file
    monkeypatch.setattr(sync_mod, "sha256_file", lambda p: hashed.append(os.path.basename(p)) or real(p))
    spec = SyncSpec(str(data), "/data/model")
    (tree,) = scan([spec], _HashCache(tmp_path / "hashes.json"))
    assert [e.rel for e in tree.entries] == ["config.json", "copy.json", "sub/w.bin"]
    assert tree.entries[0].sha == tree.entries[1].sha  # same content, one blob on the node
    assert tree.total_bytes == 9 + 9 + 4096
    assert sorted(hashed) == ["config.json", "copy.json", "w.bin"]
    # A second scan (a new process: the cache file) reads no file again.
    (again,) = scan([spec], _HashCache(tmp_path / "hashes.json"))
    assert again.digest == tree.digest and len(hashed) == 3


def test_scan_cache_follows_changes_and_tree_digest_moves(tmp_path, data):
    from runner.inventory.job_data import SyncSpec

    cache_path = tmp_path / "hashes.json"
    spec = SyncSpec(str(data), "/data/model")
    (t1,) = scan([spec], _HashCache(cache_path))
    (t2,) = scan([spec], _HashCache(cache_path))
    assert t1.digest == t2.digest and cache_path.is_file()
    (data / "sub" / "w.bin").write_bytes(b"changed")
    (t3,) = scan([spec], _HashCache(cache_path))
    changed = {e.rel: e.sha for e in t3.entries}
    assert t3.digest != t1.digest
    assert changed["sub/w.bin"] == hashlib.sha256(b"changed").hexdigest()


def test_scan_refuses_names_a_node_shell_would_misread(tmp_path):
    from runner.inventory.job_data import SyncSpec

    d = tmp_path / "d"
    d.mkdir()
    (d / "a\tb").write_text("x")
    with pytest.raises(UserError) as ei:
        scan([SyncSpec(str(d), "/d")], _HashCache(tmp_path / "h.json"))
    assert "\n" not in str(ei.value) and "rename it" in str(ei.value) and "a\\tb" in str(ei.value)


def test_plan_mounts_sync_read_only_and_mounts_as_asked(tmp_path, data):
    p = _inv(tmp_path, f"  sync: [{{src: {data}, dst: /data/model}}]\n  mounts: {{~/hf: /hf, /nfs/ds: '/ds:rw'}}\n")
    inv = load_inventory(p, check_files=False)
    trees = scan(inv.job.sync, _HashCache(tmp_path / "h.json"))
    facts = {n.name: Facts(arch="amd64", ifname="lo", home=f"/home/{n.name}") for n in inv.nodes}
    plan = make_plan(inv, "r1", facts, master_port=29500, strict=True, trees=trees)
    a, b = plan.node("a"), plan.node("b")
    digest = trees[0].digest
    assert a.mounts == {"/out": "/w/runs/r1", "/data/model": f"/w/data/trees/{digest}",
                        "/hf": "/home/a/hf", "/ds": "/nfs/ds"}
    assert b.mounts["/data/model"] == f"/home/b/runner/data/trees/{digest}"
    assert a.writable == frozenset({"/out", "/ds"})
    text = plan.render()
    assert f"    mount     /w/data/trees/{digest} -> /data/model (ro)" in text
    assert "    mount     /nfs/ds -> /ds (rw)" in text and "    mount     /home/a/hf -> /hf (ro)" in text


def test_single_file_sync_mounts_the_file(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("text\n")
    inv = load_inventory(_inv(tmp_path, f"  sync: [{{src: {f}, dst: /data/corpus.txt}}]\n"), check_files=False)
    trees = scan(inv.job.sync, _HashCache(tmp_path / "h.json"))
    facts = {n.name: Facts(arch="amd64", ifname="lo", home="/root") for n in inv.nodes}
    plan = make_plan(inv, "r1", facts, master_port=29500, strict=True, trees=trees)
    assert plan.node("a").mounts["/data/corpus.txt"] == f"/w/data/trees/{trees[0].digest}/corpus.txt"


def test_backends_without_data_support_refuse_it_in_one_line(tmp_path, data):
    """`export --to kubernetes` (and --scheduler slurm, by the same helper) would drop job.sync and
    job.mounts: it says so and writes nothing."""
    p = _inv(tmp_path, f"  sync: [{{src: {data}, dst: /data/model}}]\n  registry: r.lan:5000\n")
    out = tmp_path / "k.yaml"
    proc = subprocess.run([sys.executable, "-m", "runner", "export", "--to", "kubernetes", "-i", str(p), "-o", str(out),
                           "--run-id", "r1"], capture_output=True, text=True, cwd=REPO, env=no_socket_env(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == ("runner: error: job.sync, job.registry: not supported by export --to kubernetes yet (the SSH "
                           "runner's `runner up` is); put the data on the cluster's shared storage and pass its path in "
                           "job.args\n")
    assert not out.exists()
