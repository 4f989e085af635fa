"""collect against hostile or stuck nodes (issue 15): what a container made arrives as plain files
owned by the caller, and a node that freezes in the middle of its stream costs only its own files."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import psutil
import pytest
import rich.progress

from tests import IMAGE
from tests.support.runner_helpers import node_workdir, runner, sandbox_node

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")


def _in_container(sandbox: Path, node: str, run_dir: Path, script: str) -> None:
    """Run script as root in a container on the node's own engine, with run_dir as /out."""
    res = subprocess.run(["docker", "-H", sandbox_node(sandbox, node).docker_host, "run", "--rm", "--network", "none",
                          "-v", f"{run_dir}:/out", IMAGE, "sh", "-c", script],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_collect_of_container_made_setuid_and_foreign_owned_files_gives_plain_files(sandbox, pushed, tmp_path):
    run_id = "hc-perm-" + secrets.token_hex(3)
    rd = node_workdir(sandbox, "node-1") / "runs" / run_id
    rd.mkdir(parents=True)
    try:
        _in_container(sandbox, "node-1", rd, "echo x > /out/suid && chmod 4755 /out/suid && "
                      "echo y > /out/sgid && chmod 2770 /out/sgid && "
                      "mkdir /out/sub && echo z > /out/sub/owned && chown -R 1234:1234 /out/sub && chmod 0600 /out/sub/owned")
        dest = tmp_path / "art"
        proc = runner("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet", "--no-plots")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = dest / run_id / "node-1"
        for rel, want in (("suid", 0o755), ("sgid", 0o750), ("sub/owned", 0o600)):
            st = os.lstat(got / rel)
            assert stat.S_ISREG(st.st_mode), rel
            assert stat.S_IMODE(st.st_mode) & 0o7000 == 0 and stat.S_IMODE(st.st_mode) == want & ~_umask(), (rel, oct(st.st_mode))
            assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid()), (rel, st.st_uid, st.st_gid)
        st = os.lstat(got / "sub")
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    finally:
        shutil.rmtree(rd, ignore_errors=True)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _stream_processes(run_dir: Path) -> list[psutil.Process]:
    """The node-side tar sending run_dir, and the sshd session processes carrying it."""
    procs = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.info["name"] == "tar" and p.cwd() == str(run_dir):
                procs.append(p)
                procs += [a for a in p.parents() if a.name().startswith("sshd") and a.ppid() != 1]
        except psutil.Error:
            continue
    return procs


@pytest.mark.timeout(180)  # before the fix: collect hung here forever
def test_a_node_frozen_mid_collect_is_named_and_the_others_collected(sandbox, pushed, tmp_path, monkeypatch, capsys):
    run_id = "hc-frozen-" + secrets.token_hex(3)
    dirs = {n: node_workdir(sandbox, n) / "runs" / run_id for n in NODES}
    for n, d in dirs.items():
        d.mkdir(parents=True)
        (d / "small.txt").write_text(f"{n}\n")
    with open(dirs["node-1"] / "big.bin", "wb") as fh:  # far more than every buffer on the way
        fh.truncate(256 << 20)
    frozen: list[psutil.Process] = []

    class FreezeNode1OnFirstBytes(rich.progress.Progress):
        """Progress bar whose first advance of node-1's task SIGSTOPs the session streaming it."""

        def update(self, task_id, **kw):
            if kw.get("advance") and not frozen and self._tasks[task_id].description == "node-1":
                for p in _stream_processes(dirs["node-1"]):
                    p.suspend()
                    frozen.append(p)
            return super().update(task_id, **kw)

    # runner.transport.stream.transfer_progress builds its bar from rich.progress at call time.
    monkeypatch.setattr(rich.progress, "Progress", FreezeNode1OnFirstBytes)
    import runner.transport.stream

    monkeypatch.setattr(runner.transport.stream, "STALL_S", 5.0)  # the stall watchdog shared by push and collect
    from runner.cli.main import main

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = main(["collect", run_id, "-i", str(sandbox), "--dest", str(tmp_path / "art"), "--quiet", "--no-plots"])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        for p in frozen:
            try:
                p.resume()
            except psutil.Error:
                pass
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    out, err = capsys.readouterr()
    assert frozen, "node-1's stream was never seen"
    assert rc == 3, err
    errors = [ln for ln in err.splitlines() if ln.startswith("runner: error:")]
    assert len(errors) == 1 and "node-1" in errors[0] and "node-0" not in errors[0], err
    for n in ("node-0", "node-2"):
        assert (tmp_path / "art" / run_id / n / "small.txt").read_text() == f"{n}\n"
    assert not (tmp_path / "art" / run_id / "node-1" / "big.bin").exists()


def test_collect_takes_the_nodes_that_fit_and_names_the_others_writing_nothing_of_them(sandbox, tmp_path):
    """Two nodes with 10 MiB each, a 16 MiB filesystem (0.8 MiB kept free): node-0's files fit,
    node-1's then do not. node-0 is collected; node-1 is named with what it needs, nothing of it
    written (exit 3, as for any node not collected); with room, the next collect takes node-1 only.
    Before: node-0's 10 MiB were written and node-1's stream hit a full disk half-way. A node that
    lists more than there is room for costs only its own files, as a node's failure always did."""
    from tests.support.small_fs import small_fs

    run_id = "hc-room-" + secrets.token_hex(3)
    dirs = {n: node_workdir(sandbox, n) / "runs" / run_id for n in NODES[:2]}
    try:
        for d in dirs.values():
            d.mkdir(parents=True)
            (d / "shard.distcp").write_bytes(os.urandom(10 << 20))
        with small_fs(tmp_path / "fs", 16 << 20) as fs:
            proc = runner("collect", run_id, "-i", str(sandbox), "--dest", str(fs), "--quiet", "--no-plots")
            assert proc.returncode == 3, proc.stdout + proc.stderr
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("runner: error:")]
            assert len(errors) == 1 and "node-0" not in errors[0], proc.stderr
            assert re.search(r"node-1: nothing collected: its 1 new or changed files need 10\.0 MiB, and "
                             rf"{fs} has [\d.]+ MiB of room left \([\d.]+ MiB free, 819\.2 KiB of it kept free\); "
                             "free space there, or collect into a larger filesystem with --dest", errors[0]), errors
            assert (fs / run_id / "node-0" / "shard.distcp").read_bytes() == (dirs["node-0"] / "shard.distcp").read_bytes()
            assert not (fs / run_id / "node-1").exists(), "something of node-1 was written"
            subprocess.run(["mount", "-o", "remount,size=32m", str(fs)], check=True)  # now it fits
            proc = runner("collect", run_id, "-i", str(sandbox), "--dest", str(fs), "--quiet", "--no-plots")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert re.search(r"node-0 +1 files: 0 copied .*1 unchanged", proc.stdout), proc.stdout
            for n, d in dirs.items():
                assert (fs / run_id / n / "shard.distcp").read_bytes() == (d / "shard.distcp").read_bytes()
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


def test_a_node_file_under_collects_own_names_is_not_taken_and_the_next_collect_works(sandbox, tmp_path):
    """Found by an audit: a node listing `.collect-manifest.json/x` had it placed, so the manifest's
    path became a directory: that collect's manifest write failed, and every later collect of the
    node too, until the user removed it by hand. Names collect keeps for itself (`.collect-*`) are
    not taken from a node, one error each; the rest is collected and the next collect works."""
    run_id = "hc-own-" + secrets.token_hex(3)
    d = node_workdir(sandbox, "node-0") / "runs" / run_id
    try:
        (d / ".collect-manifest.json").mkdir(parents=True)
        (d / ".collect-manifest.json" / "x").write_text("x")
        (d / ".collect-staging-1").mkdir()
        (d / ".collect-staging-1" / "y").write_text("y")
        (d / "ok.txt").write_text("fine")
        dest = tmp_path / "dest"
        for attempt in (1, 2):
            proc = runner("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet", "--no-plots")
            assert proc.returncode == 3, (attempt, proc.stdout + proc.stderr)
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("runner: error:")]
            assert len(errors) == 1, proc.stderr
            assert (".collect-manifest.json/x: not collected: names that begin .collect- are collect's own here"
                    in errors[0]) and ".collect-staging-1/y: not collected" in errors[0], errors
            node = dest / run_id / "node-0"
            assert (node / "ok.txt").read_text() == "fine"
            assert list(json.loads((node / ".collect-manifest.json").read_text())) == ["ok.txt"]
            assert not (node / ".collect-staging-1").exists()
        assert re.search(r"node-0 +1 files: 0 copied .*1 unchanged", proc.stdout), proc.stdout
    finally:
        shutil.rmtree(d, ignore_errors=True)
