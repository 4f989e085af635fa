"""Paths a node hands the runner, as an attacker would hand them (issue 23): collect's SFTP listing
and the files that follow it, then `up --resume`'s checkpoint listing. The node is a real SSH
server that lies (tests/support/hostile_node.py); the runner's real code walks, streams, hashes and places."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from runner.core import safe_path
from runner.core.errors import UserError
from runner.delivery.collect_files import collect_node, place_verified
from runner.transport.digest import sha256_file
from runner.transport.ssh import Remote
from tests.support.hostile_node import HostileNode, entry

pytestmark = [pytest.mark.timeout(120)]
ATTACKER_KEY = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOmallory mallory@evil\n"
RUN = "20250101-000000-abcd"


def _planting_node(tmp: Path) -> tuple[HostileNode, Path]:
    """A node whose run dir lists `x` (a symlink to d/e/f/g) as a regular file, hides .ssh/, and
    lists a name that climbs out through x: the runner's own tar, hash and placement do the rest."""
    rd = tmp / "node" / "wd" / "runs" / RUN
    (rd / "d/e/f/g").mkdir(parents=True)
    (rd / "d/e/f/g/pad").write_bytes(b"pad\n")
    (rd / ".ssh").mkdir()
    (rd / ".ssh/authorized_keys").write_bytes(ATTACKER_KEY)
    os.symlink("d/e/f/g", rd / "x")
    climb = "x/../../../../.ssh/authorized_keys"

    def lie(path: str, real):
        if path != str(rd):
            return real
        return [entry("x"), entry(climb, size=len(ATTACKER_KEY)), *(e for e in real if e.filename == "d")]

    return HostileNode(tmp / "node", lister=lie), rd


def test_collect_plants_nothing_from_a_listing_that_climbs_out(tmp_path):
    home = tmp_path / "home"
    dest_root = home / "artifacts"  # `runner collect` run from a home directory: the default --dest
    node, rd = _planting_node(tmp_path)
    with node, Remote(node.node(workdir=str(rd.parents[1]))).connect() as r:
        with pytest.raises(UserError) as exc:
            collect_node(r, RUN, dest_root)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("node evil: ") and "x/../../../../.ssh/authorized_keys" in msg, msg
    assert not (home / ".ssh").exists(), "the node planted ~/.ssh/authorized_keys"
    assert not dest_root.exists() or not any(p.is_file() for p in dest_root.rglob("*")), "something was placed"
    assert not any("tar" in c for c in node.commands), node.commands  # refused before any transfer


@pytest.mark.parametrize("name, why", [
    # (`.` and `..` entries are dropped by paramiko's listdir itself: safe_path's own test covers them)
    ("", "an empty name"), ("../x", "a '/' inside one name"), ("/etc/passwd", "a '/' inside one name"),
    ("a\0b", "a NUL byte"), ("a\nb", "a control character"), ("a\x1b]52;c;eA==\x07", "a control character"),
    ("a\x9bb", "a control character"), ("x" * 256, "a name over 255 bytes"),
])
def test_every_hostile_listing_name_is_refused_naming_node_and_path(tmp_path, name, why):
    rd = tmp_path / "node" / "wd" / "runs" / RUN
    rd.mkdir(parents=True)
    (rd / "ok").write_bytes(b"ok")
    node = HostileNode(tmp_path / "node", lister=lambda p, real: [*real, entry(name, size=2)] if p == str(rd) else real)
    with node, Remote(node.node(workdir=str(rd.parents[1]))).connect() as r:
        with pytest.raises(UserError) as exc:
            collect_node(r, RUN, tmp_path / "art")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("node evil: ") and why in msg and "\x1b" not in msg, msg
    assert not (tmp_path / "art" / RUN / "evil" / "ok").exists()


def test_a_directory_the_node_lists_inside_itself_forever_is_bounded(tmp_path):
    rd = tmp_path / "node" / "wd" / "runs" / RUN
    rd.mkdir(parents=True)
    # Every directory answers with one more directory: a tree with no end (long names: few round trips).
    node = HostileNode(tmp_path / "node", lister=lambda p, real: [entry("d" * 250, kind="dir")] if p.startswith(str(rd))
                       else real)
    with node, Remote(node.node(workdir=str(rd.parents[1]))).connect() as r:
        with pytest.raises(UserError) as exc:
            r.walk(str(rd))
    assert "node evil: " in str(exc.value) and "4096" in str(exc.value), exc.value


def test_place_refuses_a_link_already_in_the_destination(tmp_path):
    """A link left in artifacts/ (by hand, or an older collect) must not carry a node's file out."""
    outside = tmp_path / "victim"
    outside.mkdir()
    dest = tmp_path / "art" / RUN / "n"
    dest.mkdir(parents=True)
    os.symlink(outside, dest / "sub")
    staging = dest / ".staging"
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "f").write_bytes(b"data")
    with pytest.raises(ValueError, match="leads out of"):
        place_verified(staging, dest, "sub/f", 4, sha256_file(staging / "sub" / "f"), None)
    assert not (outside / "f").exists()
    assert (staging / "sub" / "f").exists()  # nothing moved


def test_place_refuses_a_link_the_stream_put_in_staging(tmp_path):
    """The node's tar may carry a symlink of its own: the staged file must resolve inside staging."""
    secret = tmp_path / "home" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"mine")
    dest = tmp_path / "art" / RUN / "n"
    staging = dest / ".staging"
    staging.mkdir(parents=True)
    os.symlink(secret.parent, staging / "ln")
    with pytest.raises(ValueError, match="leads out of"):
        place_verified(staging, dest, "ln/secret", 4, sha256_file(secret), None)
    assert secret.read_bytes() == b"mine" and not (dest / "ln").exists()


def test_safe_path_under_accepts_plain_names_and_a_root_that_is_a_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "root")
    assert safe_path.under(tmp_path / "root", "a/b.c") == tmp_path / "root" / "a" / "b.c"
    assert safe_path.rel_error("checkpoints/step-10/__0_0.distcp") is None
    assert safe_path.rel_error("/etc/passwd") == "an absolute path"
    for rel, why in (("a/../b", "'..' as a name"), ("./a", "'.' as a name"), ("a//b", "an empty name"),
                     ("a/", "an empty name")):
        assert safe_path.rel_error(rel) == why, rel
        with pytest.raises(ValueError, match=why.replace(".", r"\.")):
            safe_path.under(tmp_path / "root", rel)


# --- up --resume: checkpoint listings and files from the nodes (runner/delivery/resume_sync.py) ------------

def _checkpoint(run_dir: Path, rank: int, name: str = "step-2", **override: bytes) -> None:
    """What the trainer leaves on node `rank` of a 2-node run without shared storage."""
    import json
    import zlib

    ck = run_dir / "checkpoints" / name
    ck.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(name + "\n")
    files = {".metadata": b"meta", "trainer_state.json": json.dumps({"step": 2, "world_size": 2}).encode(),
             "config.yaml": b"a: 1\n", f"__{rank}_0.distcp": bytes([rank]) * 100, f"rank{rank}.pt": b"rng"}
    mine = {f: b for f, b in files.items() if rank == 0 or f.startswith(("__", "rank"))}
    manifest = {f: [len(b), zlib.crc32(b)] for f, b in mine.items()}
    files[f"manifest.rank{rank}.json"] = json.dumps(manifest).encode()
    files.update(override)
    for f, b in files.items():
        (ck / f).write_bytes(b)


def _resume(tmp: Path, before_sync=None, **override_node1: bytes):  # trainer_state.json: on both nodes
    """Two real nodes (no lies in their listings: what the job wrote is hostile enough), the resume
    sync run for real between them; before_sync(run_dirs) once their checkpoints are written.
    (result or UserError, run dirs)."""
    from runner.delivery.resume_sync import sync_checkpoints

    nodes = [HostileNode(tmp / f"n{k}", fourth=10 + k) for k in range(2)]
    run_dirs = {}
    for k in range(len(nodes)):
        run_dirs[f"n{k}"] = tmp / f"n{k}" / "run"
        both = {f: b for f, b in override_node1.items() if f == "trainer_state.json"}
        _checkpoint(run_dirs[f"n{k}"], k, **(override_node1 if k == 1 else both))
    if before_sync:
        before_sync(run_dirs)
    for n in nodes:
        n.start()
    remotes = {f"n{k}": Remote(n.node(name=f"n{k}")).connect() for k, n in enumerate(nodes)}
    try:
        return sync_checkpoints(remotes, {k: str(v) for k, v in run_dirs.items()}), run_dirs
    except UserError as exc:
        return exc, run_dirs
    finally:
        for r in remotes.values():
            r.close()
        for n in nodes:
            n.stop()


def test_resume_between_real_nodes_completes_each_node(tmp_path):
    """The control for the hostile cases below: the same nodes, honest files, synced."""
    res, dirs = _resume(tmp_path)
    assert not isinstance(res, UserError), res
    assert res.checkpoint == "step-2" and set(res.copied) == {"n0", "n1"}
    for d in dirs.values():
        got = {p.name for p in (d / "checkpoints" / "step-2").iterdir()}
        assert {"__0_0.distcp", "__1_0.distcp", "manifest.rank0.json", "manifest.rank1.json"} <= got


@pytest.mark.parametrize("name, content, shows", [
    # A file name with a newline: a listing line of its own, naming the run dir as a checkpoint.
    ("x\nfile\t4\t..", b"meta", "a control character"),
    ("x\x1b]0;owned\x07", b"", "a control character"),
    # Malformed checkpoint files: each a traceback before.
    ("manifest.rank1.json", b'{"__1_0.distcp": 100}', "manifest.rank1.json"),
    ("manifest.rank1.json", b'{"__1_0.distcp": ["big", 0]}', "manifest.rank1.json"),
    ("manifest.rank1.json", b'{"../../x": [1, 0], "__1_0.distcp": [100, null]}', "manifest.rank1.json"),
    ("manifest.rank1.json", b"[1, 2", "manifest.rank1.json"),
    ("manifest.rank1.json", b'{"__1_0.distcp": [100000000000000000000000000, 0]}', "manifest.rank1.json"),
    ("trainer_state.json", b'{"step": 2, "world_size": 100000000000000000000}', "trainer_state.json"),
    ("trainer_state.json", b'{"step": "2", "world_size": -1}', "trainer_state.json"),
])
def test_resume_refuses_hostile_checkpoint_files_in_one_line(tmp_path, name, content, shows):
    res, dirs = _resume(tmp_path, **{name: content})
    assert isinstance(res, UserError), res
    msg = str(res)
    assert "\n" not in msg and "\x1b" not in msg and shows in msg, msg
    assert re.search(r"node n1: |node n0: .*trainer_state", msg), msg  # the node that holds the file
    assert not (dirs["n0"] / "checkpoints" / "step-2" / "__1_0.distcp").exists()  # nothing copied
    assert not list(dirs["n0"].rglob(".runner-sync-*"))


# --- job.sync: links in the folders it sends (runner/delivery/sync.py scan) --------------------------------

def _fake_etc_ssh(tmp: Path) -> Path:
    d = tmp / "etc-ssh"
    d.mkdir()
    (d / "ssh_host_ed25519_key").write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    return d


@pytest.mark.parametrize("link", ["dir", "file"])
def test_sync_refuses_a_link_out_of_the_source_before_reading_behind_it(tmp_path, link):
    from runner.delivery.sync import _HashCache, scan
    from runner.inventory.job_data import SyncSpec

    keys = _fake_etc_ssh(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    if link == "dir":
        os.symlink(keys, model / "tokenizer")
    else:
        os.symlink(keys / "ssh_host_ed25519_key", model / "weights.bin")
    cache = tmp_path / "hashes.json"
    with pytest.raises(UserError) as exc:
        scan([SyncSpec(str(model), "/data/model")], _HashCache(cache))
    msg = str(exc.value)
    name = "tokenizer" if link == "dir" else "weights.bin"
    assert "\n" not in msg and f"{model / name}" in msg and "outside" in msg, msg
    assert not cache.exists() or "ssh_host" not in cache.read_text()  # never hashed, never read


def test_up_dry_run_refuses_the_link_and_contacts_nothing(tmp_path):
    import subprocess
    import sys

    from tests import REPO
    from tests.support.runner_helpers import no_socket_env

    keys = _fake_etc_ssh(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    os.symlink(keys, model / "keys")
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64}\n"
                   f"job:\n  image: t:1\n  sync:\n    - {{src: {model}, dst: /data/model}}\n")
    env = {**no_socket_env(tmp_path), "RUNNER_SYNC_CACHE": str(tmp_path / "hashes.json")}
    proc = subprocess.run([sys.executable, "-m", "runner", "up", "-i", str(inv), "--dry-run"], capture_output=True,
                          text=True, cwd=REPO, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and f"{model / 'keys'}" in proc.stderr, proc.stderr
    assert not (tmp_path / "hashes.json").exists()


def _hf_cache(tmp: Path) -> tuple[Path, dict[str, bytes]]:
    """A Hugging Face hub cache repo as huggingface_hub lays it out: snapshot files are relative
    links into ../../blobs/<sha256>."""
    import hashlib

    repo = tmp / "hub" / "models--org--tiny"
    files = {"config.json": b'{"d": 64}', "model.safetensors": os.urandom(2048)}
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name, data in files.items():
        h = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / h).write_bytes(data)
        os.symlink(f"../../blobs/{h}", snap / name)
    return repo, files


def test_sync_of_a_hugging_face_snapshot_or_whole_repo_follows_its_own_links(tmp_path):
    import hashlib

    from runner.delivery.sync import _HashCache, scan
    from runner.inventory.job_data import SyncSpec

    repo, files = _hf_cache(tmp_path)
    snap = repo / "snapshots" / "abc123"
    (t,) = scan([SyncSpec(str(snap), "/data/tiny")], _HashCache(tmp_path / "h.json"))
    assert {e.rel: e.sha for e in t.entries} == {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    (whole,) = scan([SyncSpec(str(repo), "/data/hub")], _HashCache(tmp_path / "h.json"))
    rels = {e.rel for e in whole.entries}
    assert {"snapshots/abc123/config.json", "snapshots/abc123/model.safetensors", "refs/main"} <= rels
    # A link in the snapshot that leaves the repo is refused like any other.
    os.symlink(_fake_etc_ssh(tmp_path), snap / "extra")
    with pytest.raises(UserError, match="outside"):
        scan([SyncSpec(str(snap), "/data/tiny")], _HashCache(tmp_path / "h.json"))


def test_slurm_local_collect_keeps_files_under_the_destination(tmp_path):
    """Without a login node the shared filesystem is read here: a link already in artifacts/ must
    not carry a run's file out of it."""
    from runner.backends.slurm.collect import mirror_local
    from runner.delivery.collect_files import NodeCollect

    src = tmp_path / "shared" / "runs" / RUN
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "authorized_keys").write_bytes(ATTACKER_KEY)
    (src / "ok.txt").write_text("ok\n")
    victim = tmp_path / "home" / ".ssh"
    victim.mkdir(parents=True)
    dest = tmp_path / "art" / RUN / "slurm"
    dest.mkdir(parents=True)
    os.symlink(victim, dest / "sub")
    res = NodeCollect("slurm")
    mirror_local(src, dest, res)
    assert not (victim / "authorized_keys").exists()
    assert (dest / "ok.txt").read_text() == "ok\n" and res.copied == 1
    assert len(res.errors) == 1 and "sub/authorized_keys" in res.errors[0] and "leads out of" in res.errors[0]
