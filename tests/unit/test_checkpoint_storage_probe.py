"""The checkpoint directory's sharing probe (trainer/checkpoint/storage.py) waits for late probe files
only where another machine's file can show up late: a network file system (NFS attribute caching).
On a node's own disk what a rank does not see after the barrier is on another disk: the probe
answered at once there. Before, it waited 2 x 0.5 s on every start and every in-place regroup of a
run whose nodes keep their own checkpoints (1.0 s of the 1.3 s from `resumed` to a regroup's first
step on the namespaced sandbox: bench/elastic.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.checkpoint import storage

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:25 / /mnt/nfs rw,relatime shared:5 - nfs4 srv:/export rw,vers=4.2
31 30 8:2 / /mnt/nfs/local rw,relatime shared:6 - xfs /dev/sdb1 rw
32 22 0:40 / /home/u/with\\040space rw - fuse.sshfs u@pi:/ rw
33 22 0:41 / /out rw - tmpfs tmpfs rw
34 22 0:42 / /out rw - nfs srv:/runs rw
"""


@pytest.mark.parametrize("path,kind", [
    ("/", "ext4"), ("/srv/ckpt", "ext4"), ("/mnt/nfs/run/ckpt", "nfs4"), ("/mnt/nfs/local/ckpt", "xfs"),
    ("/mnt/nfsish/ckpt", "ext4"),               # a prefix of a name is not its parent
    ("/home/u/with space/ckpt", "fuse.sshfs"),  # mountinfo's octal escapes
    ("/out/checkpoints", "nfs"),                # the later of two mounts on one point shadows the first
])
def test_the_file_system_of_a_path_is_its_innermost_mounts(path, kind):
    assert storage.fs_type(Path(path), MOUNTINFO) == kind


def test_only_a_network_file_system_or_an_unknown_one_is_waited_for():
    assert [storage.late_files_possible(k) for k in ("ext4", "xfs", "tmpfs", "overlay", "btrfs")] == [False] * 5
    assert [storage.late_files_possible(k) for k in ("nfs", "nfs4", "cifs", "fuse.sshfs", "lustre", "ceph",
                                                     "virtiofs", None)] == [True] * 8


def test_a_probe_on_a_local_disk_answers_without_waiting(tmp_path, monkeypatch):
    """Two ranks on two disks (rank 1's probe never shows up here): no sleep on this machine's own
    disk; on one that says nfs, the two looks again as before."""
    sleeps = []
    monkeypatch.setattr(storage, "_distributed", lambda: True)
    monkeypatch.setattr(storage.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(storage.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(storage.dist, "broadcast_object_list", lambda box, src: None)
    monkeypatch.setattr(storage.dist, "barrier", lambda: None)
    monkeypatch.setattr(storage.dist, "all_gather_object", lambda out, seen: out.__setitem__(slice(None), [seen, [1]]))
    monkeypatch.setattr(storage.time, "sleep", sleeps.append)
    assert storage.probe(tmp_path).leaders == (0, 1) and sleeps == []
    monkeypatch.setattr(storage, "fs_type", lambda path: "nfs")
    assert storage.probe(tmp_path).leaders == (0, 1) and sleeps == [0.5, 0.5]
