"""The runner on a laptop whose `tar` is bsdtar (libarchive: macOS's tar), not GNU tar: the local
tar commands of `job.sync` and `push` work with it as they are. (Collect runs no local tar at all:
tests/unit/test_collect_untar.py.) The node keeps GNU tar; only this machine's PATH changes."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from runner.delivery.images import Exported
from runner.delivery.sync import _HashCache, scan, sync_node
from runner.inventory.job_data import SyncSpec
from runner.planning.paths import NodePaths
from runner.transport.ssh import Remote
from tests.conftest import require
from tests.support.hostile_node import HostileNode


@pytest.fixture
def bsdtar_first(tmp_path, monkeypatch) -> str:
    """PATH with bsdtar as `tar`; returns the PATH the node keeps."""
    real = shutil.which("bsdtar")
    require("bsdtar", real is not None, "Debian's libarchive-tools")
    shim = tmp_path / "laptop-bin"
    shim.mkdir()
    (shim / "tar").symlink_to(real)
    node_path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{shim}:{node_path}")
    assert b"bsdtar" in subprocess.run(["tar", "--version"], capture_output=True).stdout
    return node_path


def test_sync_sends_with_bsdtar(tmp_path, bsdtar_first):
    src = tmp_path / "model"
    (src / "shards").mkdir(parents=True)
    files = {"config.json": b'{"hidden": 64}\n', "shards/w0.bin": os.urandom(200_000), "shards/w1.bin": os.urandom(3)}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    (src / "tokenizer.json").symlink_to("config.json")  # a link inside the source: sent as its target's bytes
    (tree,) = scan([SyncSpec(str(src), "/data/model")], _HashCache(tmp_path / "hashes.json"))
    node = HostileNode(tmp_path / "node", fourth=43)
    node.rewrite = lambda c: f"PATH={bsdtar_first}; {c}"
    paths = NodePaths(str(tmp_path / "node" / "home" / "wd"))
    with node, Remote(node.node()).connect() as r:
        (res,) = sync_node(r, paths, [tree])
    assert res.files_sent == 4 and not res.reused, res
    built = Path(paths.data_tree(tree.digest))
    got = {str(p.relative_to(built)): p.read_bytes() for p in sorted(built.rglob("*")) if p.is_file()}
    assert got == {**files, "tokenizer.json": files["config.json"]}
    for data in files.values():
        assert (Path(paths.data_blobs) / hashlib.sha256(data).hexdigest()).read_bytes() == data


def test_push_archive_with_bsdtar_holds_what_gnu_tar_writes(tmp_path, bsdtar_first):
    """The `docker load` archive push streams: the tag's manifest, the config and the layers asked for,
    at the archive paths `docker load` reads (compared with GNU tar's archive of the same export)."""
    d = tmp_path / "export"
    exp = Exported(tag="runner-trainer:latest", image_id="sha256:" + "a" * 64, dir=d, config="c" * 64 + ".json",
                   layers=[f"{i:02d}" * 32 + "/layer.tar" for i in range(3)], diff_ids=[], sizes=[])
    exp.tag_manifest.parent.mkdir(parents=True)
    exp.tag_manifest.write_text('[{"Config": "x"}]')
    (d / exp.config).write_text("{}")
    for i, layer in enumerate(exp.layers):
        (d / layer).parent.mkdir(parents=True)
        (d / layer).write_bytes(os.urandom(1000 + i))

    def members(tar: str) -> dict[str, bytes]:
        argv = exp.archive_cmd([0, 2])
        out = subprocess.run([tar, *argv[1:]], capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(out)) as tf:
            return {m.name: tf.extractfile(m).read() for m in tf if m.isreg()}

    assert exp.archive_cmd([0])[0] == "tar"
    bsd = members("tar")
    assert bsd == members("/bin/tar" if os.path.exists("/bin/tar") else "/usr/bin/tar")
    assert sorted(bsd) == sorted(["manifest.json", exp.config, exp.layers[0], exp.layers[2]])
