"""Room on this machine's disk (runner/delivery/disk_room.py): what a node lists is checked against the
free space where it would go before a byte is written. Real filesystems that fill (a small tmpfs:
tests/support/small_fs.py) and a real SSH node (tests/support/hostile_node.py: honest, or lying about a size)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

from contract.memory import disk_keep_free, size_text
from runner.core.errors import UserError
from runner.delivery import disk_room
from runner.delivery.collect_files import collect_node
from runner.transport.ssh import Remote
from tests.support.hostile_node import HostileNode, entry
from tests.support.small_fs import fill, small_fs

pytestmark = [pytest.mark.timeout(120)]
RUN = "20250101-000000-abcd"
MiB = 1 << 20


def test_keep_free_is_a_gib_or_a_twentieth_of_a_small_filesystem():
    assert disk_keep_free(500 << 30) == 1 << 30
    assert disk_keep_free(20 << 30) == 1 << 30
    assert disk_keep_free(16 * MiB) == int(16 * MiB * 0.05)
    assert [size_text(n) for n in (0, 512, 1536, 3 * MiB, (5 << 30) // 4, 16 << 40)] == \
        ["0 B", "512 B", "1.5 KiB", "3.0 MiB", "1.25 GiB", "16.00 TiB"]


def test_a_missing_destination_is_measured_where_it_would_be_made(tmp_path):
    assert disk_room.existing(tmp_path / "a" / "b" / "c") == tmp_path
    disk_room.check_room(tmp_path / "a" / "b", 1, "x", "y")  # fits: no error, nothing made
    assert not (tmp_path / "a").exists()


def _node(tmp: Path, files: dict[str, int], lister=None) -> tuple[HostileNode, Path]:
    rd = tmp / "node" / "wd" / "runs" / RUN
    rd.mkdir(parents=True)
    for name, size in files.items():
        (rd / name).write_bytes(os.urandom(size))
    return HostileNode(tmp / "node", lister=lister), rd


def test_a_node_that_lists_16_tib_is_refused_before_any_transfer(tmp_path):
    """The listing is the node's word: 16 TiB claimed for a 2-byte file. Before, collect streamed
    until the bound the listing itself set (16 TiB) or the disk filled."""
    def lie(path, real):
        return [entry("huge.distcp", size=16 << 40), *real] if path.endswith(RUN) else real

    node, rd = _node(tmp_path, {"ok": 2}, lister=lie)
    dest_root = tmp_path / "art"
    with node, Remote(node.node(workdir=str(rd.parents[1]))).connect() as r:
        with pytest.raises(UserError) as exc:
            collect_node(r, RUN, dest_root)
    msg = str(exc.value)
    assert "\n" not in msg and exc.value.exit_code == 2, msg
    assert re.search(rf"collect of run {RUN} from evil \(2 new or changed files\) needs 16\.00 TiB, and {tmp_path} has "
                     r"[\d.]+ [KMGT]iB free \([\d.]+ [KMGT]iB of it kept free\); nothing was written: "
                     r"free space there, or collect into a larger filesystem with --dest$", msg), msg
    assert not dest_root.exists(), "collect made its destination"
    assert not any("tar" in c for c in node.commands), node.commands


def test_collect_onto_a_small_filesystem_fits_or_writes_nothing(tmp_path):
    """3 MiB of checkpoint onto a 3 MiB tmpfs (keeping 5%): refused whole; onto 8 MiB: collected."""
    node, rd = _node(tmp_path, {"__0_0.distcp": 2 * MiB, "__1_0.distcp": MiB, "metrics.jsonl": 100})
    with small_fs(tmp_path / "small", 3 * MiB) as fs, node, \
            Remote(node.node(workdir=str(rd.parents[1]))).connect() as r:
        with pytest.raises(UserError) as exc:
            collect_node(r, RUN, fs / "artifacts")
        assert "needs 3.0 MiB" in str(exc.value) and "(153.6 KiB of it kept free)" in str(exc.value), exc.value
        assert os.listdir(fs) == [] and not any("tar" in c for c in node.commands)
    with small_fs(tmp_path / "big", 8 * MiB) as fs, node, \
            Remote(node.node(workdir=str(rd.parents[1]))).connect() as r:
        res = collect_node(r, RUN, fs / "artifacts")
        assert (res.copied, res.errors) == (3, [])
        got = fs / "artifacts" / RUN / "evil"
        assert all((got / f).read_bytes() == (rd / f).read_bytes() for f in os.listdir(rd))


def test_a_recollect_counts_only_what_changed(tmp_path):
    """Files already collected (manifest, same size and mtime) need no room a second time."""
    node, rd = _node(tmp_path, {"__0_0.distcp": 3 * MiB})
    with small_fs(tmp_path / "fs", 5 * MiB) as fs, node, \
            Remote(node.node(workdir=str(rd.parents[1]))).connect() as r:
        assert collect_node(r, RUN, fs / "art").copied == 1
        (rd / "metrics.jsonl").write_bytes(b"{}\n")  # new since; 3 MiB of 5 now used
        res = collect_node(r, RUN, fs / "art")
        assert (res.copied, res.skipped) == (1, 1)


def test_slurm_local_collect_onto_a_full_filesystem_writes_nothing(tmp_path):
    from runner.backends.slurm.collect import mirror_local
    from runner.delivery.collect_files import NodeCollect

    src = tmp_path / "shared" / "runs" / RUN
    src.mkdir(parents=True)
    (src / "model.safetensors").write_bytes(os.urandom(2 * MiB))
    with small_fs(tmp_path / "fs", 2 * MiB) as fs:
        dest = fs / "art" / RUN / "slurm"
        with pytest.raises(UserError, match=rf"collect of run {RUN} \(1 new or changed files\) needs 2\.0 MiB, .* nothing was written"):
            mirror_local(src, dest, NodeCollect("slurm"), RUN)
        assert os.listdir(fs) == []


def test_resume_relay_through_a_full_temp_folder_is_refused_before_touching_a_node(tmp_path, monkeypatch):
    from tests.unit.test_collect_paths import _resume

    with small_fs(tmp_path / "tmpfs", MiB) as fs:
        fill(fs, 16 << 10)  # 16 KiB free, under the 51 KiB kept free
        monkeypatch.setattr(tempfile, "tempdir", str(fs))
        res, dirs = _resume(tmp_path / "nodes")
    assert isinstance(res, UserError), res
    assert re.fullmatch(r"--resume: relaying step-2/[\w.]+ from node n[01] through this machine needs "
                        rf"1\d\d B, and {fs} has 16\.0 KiB free \(51\.2 KiB of it kept free\); nothing was written: "
                        r"free space there, or point TMPDIR at a larger filesystem", str(res)), res
    assert not (dirs["n0"] / "checkpoints" / "step-2" / "__1_0.distcp").exists()
    assert not (dirs["n1"] / "checkpoints" / "step-2" / "__0_0.distcp").exists()


def test_resume_onto_a_node_without_room_is_refused_before_touching_a_node(tmp_path):
    """Node n1's run dir is a full 1 MiB tmpfs (it keeps 51.2 KiB free): it cannot take node n0's
    files of step-2. Before, the upload to n1 ended in paramiko's `size mismatch in put!  0 != 100`,
    after whatever had been copied already; now nothing is copied to either node."""
    from tests.unit.test_collect_paths import _resume

    nodes = tmp_path / "nodes"
    with small_fs(nodes / "n1" / "run", MiB) as fs:
        res, dirs = _resume(nodes, before_sync=lambda run_dirs: fill(fs, 0))
        assert isinstance(res, UserError) and res.exit_code == 2, res
        assert re.fullmatch(rf"--resume: completing step-2 on node n1 \(3 files\) needs 269 B, and node n1's {fs}/"
                            r"checkpoints has 0 B free \(51\.2 KiB of it kept free\); nothing was written: free "
                            r"space there \(or lower checkpoint.keep_last\), then run again", str(res)), res
        assert not (dirs["n0"] / "checkpoints" / "step-2" / "__1_0.distcp").exists()
        assert not (dirs["n1"] / "checkpoints" / "step-2" / "__0_0.distcp").exists()


def _answering(out: str):
    """A node (its `run`) whose `df -Pk` answers `out`."""
    from types import SimpleNamespace

    return SimpleNamespace(node=SimpleNamespace(name="n9"), run=lambda *a, **k: SimpleNamespace(out=out, err="", rc=0))


HEAD = "Filesystem 1024-blocks Used Available Capacity Mounted on\n"


@pytest.mark.parametrize("out", ["", HEAD, HEAD + "/dev/x 10 5 lots 50% /\n", HEAD + "/dev/x 1 2 " + "9" * 40 + " 50% /\n"])
def test_a_node_df_answer_that_is_not_sizes_is_one_line(out):
    """df's answer is the node's word: one that holds no sizes is named, nothing written."""
    with pytest.raises(UserError, match=r"^node n9: `df -Pk` of /x failed or answered no sizes"):
        disk_room.node_room(_answering(out), "/x")


def test_a_node_df_answer_is_read_as_posix_df_writes_it():
    assert disk_room.node_room(_answering(HEAD + "/dev/x 2048 1024 1000 50% /mnt/a b\n"), "/x") == (1000 << 10, 2048 << 10)
