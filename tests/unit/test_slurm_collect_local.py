"""`runner collect` of a Slurm run without a login node (mirror_local): the run dir is on a
filesystem the job shares, so the job can swap what was listed before it is copied. Each race is
made deterministic: the swap happens in the disk-room check, which runs right after the listing
and before the first byte is copied. Every collect runs in a child process with RLIMIT_FSIZE set,
so a copy that follows a link to /dev/zero is stopped at a few MiB instead of filling the disk."""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = "20240101-000000-abcd"
FSIZE = 8 << 20   # the most one file the collect writes may grow to before the kernel stops it

_CHILD = r"""
import json, os, shutil, sys
from pathlib import Path
from runner.backends.slurm import collect
from runner.delivery import disk_room
from runner.delivery.collect_files import NodeCollect

src, dest, swaps = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
check_room = disk_room.check_room

def swap_after_listing(*a, **kw):
    check_room(*a, **kw)
    for s in swaps:
        p = Path(s["path"])
        if s.get("append"):
            with open(p, "ab") as f:
                f.write(s["append"].encode())
            continue
        if s.get("aside"):
            os.rename(p, s["aside"])
        elif p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        if s.get("link_to"):
            os.symlink(s["link_to"], p)
        if s.get("hardlink_to"):
            os.link(s["hardlink_to"], p)

disk_room.check_room = swap_after_listing
res = NodeCollect("slurm")
collect.mirror_local(src, dest, res, "run")
print(json.dumps({"errors": res.errors, "copied": res.copied, "files": res.files}))
"""


def _limit_fsize():
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))


def _collect(src: Path, dest: Path, swaps: list[dict]) -> dict:
    p = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dest), json.dumps(swaps)],
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=60, preexec_fn=_limit_fsize)
    assert p.returncode == 0, f"collect died (rc {p.returncode}): {p.stderr[-2000:]}"
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # Python ignores SIGXFSZ: a write past RLIMIT_FSIZE fails with EFBIG, which the collect names.
    assert not any("File too large" in e for e in got["errors"]), f"a copy ran past {FSIZE} bytes: {got}"
    return got


def _run_dir(tmp_path: Path) -> Path:
    src = tmp_path / "shared" / "runs" / RUN
    (src / "sub").mkdir(parents=True)
    (src / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 0.5}\n' * 3)
    (src / "sub" / "rank0.log").write_bytes(b"rank 0 says hello\n")
    (src / "decoy.txt").write_bytes(b"x" * 60)
    return src


def _dest_bytes(dest: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*")
            if p.is_file() and not p.is_symlink() and p.name != ".collect-manifest.json"}


def _others_collected(src: Path, dest: Path, got: dict, skip: str) -> None:
    files = _dest_bytes(dest)
    for rel in ("metrics.jsonl", "sub/rank0.log", "decoy.txt"):
        if not skip.startswith(rel.split("/")[0]) and rel != skip:
            assert files[rel] == (src / rel).read_bytes(), rel
    assert not any(n.startswith(".collect-staging") for n in os.listdir(dest))


def _one_problem(got: dict, rel: str) -> str:
    assert len(got["errors"]) == 1, got
    (err,) = got["errors"]
    assert err.startswith(f"{rel}: ") and "\n" not in err, err
    return err


def test_a_file_swapped_for_a_link_to_dev_zero_is_refused_not_copied(tmp_path):
    src, dest = _run_dir(tmp_path), tmp_path / "art" / RUN / "slurm"
    got = _collect(src, dest, [{"path": str(src / "decoy.txt"), "link_to": "/dev/zero"}])
    err = _one_problem(got, "decoy.txt")
    assert "symlink" in err and "not followed" in err
    assert "decoy.txt" not in _dest_bytes(dest)
    assert got["copied"] == 2 and got["files"] == 3
    _others_collected(src, dest, got, "decoy.txt")


def test_a_file_swapped_for_a_link_to_a_same_size_secret_copies_nothing_of_it(tmp_path):
    src, dest = _run_dir(tmp_path), tmp_path / "art" / RUN / "slurm"
    secret = tmp_path / "home" / ".ssh" / "id_ed25519"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(b"S3CRET-KEY-" + b"k" * 49)
    assert secret.stat().st_size == (src / "decoy.txt").stat().st_size
    got = _collect(src, dest, [{"path": str(src / "decoy.txt"), "link_to": str(secret)}])
    err = _one_problem(got, "decoy.txt")
    assert "symlink" in err
    assert not any(b"S3CRET" in b for b in _dest_bytes(dest).values())
    assert b"S3CRET" not in (dest / ".collect-manifest.json").read_bytes()
    assert got["copied"] == 2
    _others_collected(src, dest, got, "decoy.txt")


def test_a_directory_on_the_path_swapped_for_a_link_is_not_followed(tmp_path):
    src, dest = _run_dir(tmp_path), tmp_path / "art" / RUN / "slurm"
    outside = tmp_path / "home" / "secrets"
    outside.mkdir(parents=True)
    (outside / "rank0.log").write_bytes(b"S3CRET-TOKEN-0001\n")  # same name and size as the listed one
    assert (outside / "rank0.log").stat().st_size == (src / "sub" / "rank0.log").stat().st_size
    got = _collect(src, dest, [{"path": str(src / "sub"), "link_to": str(outside)}])
    err = _one_problem(got, "sub/rank0.log")
    assert "'sub' on its path is now a symlink" in err
    assert not any(b"S3CRET" in b for b in _dest_bytes(dest).values())
    assert not (dest / "sub" / "rank0.log").exists()
    assert got["copied"] == 2
    _others_collected(src, dest, got, "sub/rank0.log")


def test_a_directory_on_the_path_swapped_for_a_link_to_dev_is_not_followed(tmp_path):
    src, dest = _run_dir(tmp_path), tmp_path / "art" / RUN / "slurm"
    (src / "sub" / "zero").write_bytes(b"z" * 60)
    got = _collect(src, dest, [{"path": str(src / "sub"), "link_to": "/dev"}])
    assert sorted(e.split(": ")[0] for e in got["errors"]) == ["sub/rank0.log", "sub/zero"], got
    assert all("'sub' on its path is now a symlink" in e for e in got["errors"]), got
    assert not (dest / "sub").exists() or not any((dest / "sub").iterdir())
    assert got["copied"] == 2


def test_a_file_replaced_by_another_regular_file_since_the_listing_is_refused(tmp_path):
    """Same size, a regular file, but not the one listed (a hard link to something else): refused."""
    src, dest = _run_dir(tmp_path), tmp_path / "art" / RUN / "slurm"
    other = tmp_path / "shared" / "other"
    other.write_bytes(b"S3CRET" + b"y" * 54)
    got = _collect(src, dest, [{"path": str(src / "decoy.txt"), "hardlink_to": str(other)}])
    err = _one_problem(got, "decoy.txt")
    assert "replaced since the listing" in err
    assert not any(b"S3CRET" in b for b in _dest_bytes(dest).values())
    _others_collected(src, dest, got, "decoy.txt")


def test_a_file_that_grew_since_the_listing_is_named_as_before_and_not_placed(tmp_path):
    src, dest = _run_dir(tmp_path), tmp_path / "art" / RUN / "slurm"
    got = _collect(src, dest, [{"path": str(src / "metrics.jsonl"), "append": '{"step": 2}\n'}])
    err = _one_problem(got, "metrics.jsonl")
    assert err == "metrics.jsonl: changed while being copied (sha256 differs); collect again"
    assert not (dest / "metrics.jsonl").exists()
    assert got["copied"] == 2


def test_normal_files_are_copied_with_their_mode_and_times_then_skipped_when_unchanged(tmp_path):
    src, dest = _run_dir(tmp_path), tmp_path / "art" / RUN / "slurm"
    os.chmod(src / "decoy.txt", 0o640)
    os.utime(src / "decoy.txt", ns=(1_600_000_000_123_456_789, 1_600_000_001_987_654_321))
    (src / "empty").write_bytes(b"")
    os.chmod(src / "metrics.jsonl", 0o6755)  # the job's setuid and setgid bits: not kept, as over SSH
    got = _collect(src, dest, [])
    assert got == {"errors": [], "copied": 4, "files": 4}
    assert _dest_bytes(dest) == {r: (src / r).read_bytes() for r in ("metrics.jsonl", "sub/rank0.log", "decoy.txt", "empty")}
    st = (dest / "decoy.txt").stat()
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_mtime_ns == 1_600_000_001_987_654_321
    assert stat.S_IMODE((dest / "metrics.jsonl").stat().st_mode) == 0o755
    man = json.loads((dest / ".collect-manifest.json").read_text())
    assert man["decoy.txt"]["size"] == 60 and man["decoy.txt"]["mtime"] == 1_600_000_001
    again = _collect(src, dest, [])
    assert again == {"errors": [], "copied": 0, "files": 4}


def test_a_job_file_under_collects_own_names_is_not_taken_and_the_next_collect_works(tmp_path):
    """As for SSH nodes (collect_files.own_name): a job's `.collect-manifest.json/x` made the
    manifest's path a directory here too, and every later collect of the run failed."""
    src, dest = _run_dir(tmp_path), tmp_path / "art" / RUN / "slurm"
    (src / ".collect-manifest.json").mkdir()
    (src / ".collect-manifest.json" / "x").write_bytes(b"x")
    for copied in (3, 0):
        got = _collect(src, dest, [])
        assert got["errors"] == [".collect-manifest.json/x: not collected: names that begin .collect- are "
                                 "collect's own here"], got
        assert got["copied"] == copied and got["files"] == 3
        assert _dest_bytes(dest) == {r: (src / r).read_bytes() for r in ("metrics.jsonl", "sub/rank0.log", "decoy.txt")}
        assert (dest / ".collect-manifest.json").is_file()
