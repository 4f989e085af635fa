"""`job.mounts` and `job.sync` written by someone who wants the node (issue 54, item 2): a path
INSIDE a protected one (`/proc/1/root`, `/sys/kernel`, a block device, another engine's socket, a
user's runtime dir, the node's `/etc/ssh`, `/etc/shadow`, `/root/.ssh`, `/home/*/.ssh`, `/boot`
written, `/var/lib/docker`...) hands the job the node as surely as the protected path itself.
Before, only paths ABOVE the protected ones were refused (`/proc/1/root:rw` planned as
`mount /proc/1/root -> /host (rw)`). One rule now (runner/inventory/job_data.py `host_access`):
a node path equal to, inside or above a protected one, checked by name after the path is shown
normal; `job.unsafe_mounts` still names a mount meant on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from tests.support.runner_helpers import run_cli


def _inv(tmp_path: Path, job: str) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64}\njob:\n  image: t:1\n" + job)
    return p


def _refused(p: Path, where: str, why: str = "") -> str:
    with pytest.raises(UserError) as exc:
        load_inventory(p, check_files=False)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{p}:") and f": {where}: " in msg and why in msg, msg
    return msg


# node path, mode: each hands the job the node (or its keys) from INSIDE a protected path
INSIDE = [
    ("/proc/1/root", "rw"), ("/proc/1/root", "ro"), ("/proc/self/root/etc", "ro"),
    ("/sys/kernel", "rw"), ("/sys/fs/cgroup", "ro"),
    ("/dev/sda", "ro"), ("/dev/nvme0n1p1", "rw"), ("/dev/mem", "ro"),
    ("/run/containerd/containerd.sock", "ro"), ("/run/podman/podman.sock", "ro"),
    ("/var/run/crio/crio.sock", "ro"), ("/run/user/1000", "ro"), ("/run/user/1000/podman/podman.sock", "ro"),
    ("/srv/engine/containerd.sock", "ro"), ("/opt/k3s/agent/containerd.sock", "ro"),
    ("/etc/ssh", "ro"), ("/etc/ssh/ssh_host_ed25519_key", "ro"), ("/etc/shadow", "ro"), ("/etc/sudoers.d", "rw"),
    ("/root/.ssh", "ro"), ("/home/alice/.ssh", "ro"), ("/home/alice/.ssh/authorized_keys", "rw"),
    ("~/.ssh", "ro"), ("~/.ssh/id_ed25519", "ro"),
    ("/boot/grub", "rw"), ("/var/lib/docker/volumes", "ro"), ("/var/lib/containerd/io.containerd.content.v1", "rw"),
    ("/etc/cron.d", "rw"), ("/usr/local/bin", "rw"), ("/home/alice/.bashrc", "rw"), ("~/.bashrc", "rw"),
    ("/var/lib/kubelet/pods", "ro"), ("/etc/kubernetes/admin.conf", "ro"),
]


@pytest.mark.parametrize("node_path, mode", INSIDE)
def test_a_mount_inside_a_protected_path_is_refused(tmp_path, node_path, mode):
    """Before: every one of these loaded, and --dry-run planned `mount <path> -> /host (<mode>)`."""
    p = _inv(tmp_path, f"  mounts: {{'{node_path}': '/host:{mode}'}}\n")
    msg = _refused(p, f"job.mounts.{node_path}", "gives the job")
    assert f"job.unsafe_mounts: [{node_path}]" in msg
    # named on purpose, it is mounted as asked
    ok = load_inventory(_inv(tmp_path, f"  mounts: {{'{node_path}': '/host:{mode}'}}\n"
                                       f"  unsafe_mounts: ['{node_path}']\n"), check_files=False)
    assert [(m.node_path, m.rw) for m in ok.job.mounts] == [(node_path, mode == "rw")]


@pytest.mark.parametrize("node_path", ["/home", "/home/alice", "~/", "/etc", "/root", "/var/lib", "/var"])
def test_a_mount_above_a_protected_path_is_refused_read_only_too(tmp_path, node_path):
    """`/home` read-only holds every user's `.ssh`; `~` holds the SSH user's own keys."""
    shown = node_path.rstrip("/")
    msg = _refused(_inv(tmp_path, f"  mounts: {{'{node_path}': /host}}\n"), f"job.mounts.{shown}", "gives the job")
    assert f"job.unsafe_mounts: [{shown}]" in msg


@pytest.mark.parametrize("node_path", ["/proc/1/root/", "/run/user/1000/"])
def test_a_trailing_slash_is_the_same_path(tmp_path, node_path):
    _refused(_inv(tmp_path, f"  mounts: {{'{node_path}': /host}}\n"), f"job.mounts.{node_path.rstrip('/')}",
             "gives the job")


@pytest.mark.parametrize("node_path", ["/proc/../etc/ssh", "//proc/1/root", "/proc/./1/root", "/data/../../proc"])
def test_paths_that_hide_where_they_go_are_refused(tmp_path, node_path):
    _refused(_inv(tmp_path, f"  mounts: {{'{node_path}': /host}}\n"), f"job.mounts.{node_path}", "normalized")


@pytest.mark.parametrize("node_path, mode", [
    ("/data", "rw"), ("/nfs/datasets", "ro"), ("~/hf-cache", "rw"), ("/home/alice/data", "rw"), ("/etc/ssl", "ro"),
    ("/srv/runs", "rw"), ("/opt/models", "ro"), ("/mnt/scratch", "rw"), ("/tmp/cache", "rw"), ("/boot", "ro"),
    ("/usr/share/dict", "ro"), ("/var/cache/models", "rw"), ("/home/alice/.cache/huggingface", "ro"),
])
def test_data_mounts_are_still_mounts(tmp_path, node_path, mode):
    inv = load_inventory(_inv(tmp_path, f"  mounts: {{'{node_path}': '/host:{mode}'}}\n"), check_files=False)
    assert [(m.node_path, m.rw) for m in inv.job.mounts] == [(node_path, mode == "rw")]


@pytest.mark.parametrize("dst", ["/proc/sys/kernel/core_pattern", "/sys/fs/cgroup/x", "/dev/shm/x", "/proc"])
def test_a_sync_or_mount_destination_in_the_containers_kernel_paths_is_refused(tmp_path, dst):
    """The same rule for container destinations: a mount over the container's /proc, /sys or /dev
    (a core_pattern written through /proc/sys is the node's kernel running a program as root)."""
    src = tmp_path / "d"
    src.mkdir()
    _refused(_inv(tmp_path, f"  sync: [{{src: {src}, dst: '{dst}'}}]\n"), "job.sync[0].dst", "kernel")
    _refused(_inv(tmp_path, f"  mounts: {{/data: '{dst}'}}\n"), "job.mounts./data", "kernel")


def test_dry_run_plans_no_mount_of_proc_1_root(tmp_path, no_network, capsys):
    """The issue's reproduction: `/proc/1/root: /host:rw` planned `mount /proc/1/root -> /host (rw)`."""
    p = _inv(tmp_path, "  mounts: {/proc/1/root: '/host:rw'}\n")
    rc, out = run_cli("up", "-i", str(p), "--dry-run")
    err = capsys.readouterr().err
    assert rc == 2 and "/proc/1/root -> /host" not in out, out
    assert len(err.strip().splitlines()) == 1 and "job.unsafe_mounts" in err, err
