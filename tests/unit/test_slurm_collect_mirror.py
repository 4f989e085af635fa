"""`runner collect` of a Slurm run without a login node, in this process: the run dir on the shared
filesystem (here a directory of this machine) mirrored to artifacts/<run>/slurm/ with the manifest
that makes the next collect incremental (runner/backends/slurm/collect.py). The races of a job
swapping its files mid-collect are tests/unit/test_slurm_collect_local.py's, in child processes
with a file-size limit; here the ordinary paths, through the API as a program calls it."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from runner import api
from runner.backends.slurm.collect import mirror_local
from runner.core.errors import UserError
from runner.delivery.collect_files import MANIFEST, NodeCollect

RUN = "20260101-000000-abcd"


def _backend(tmp: Path):
    inv = tmp / "slurm.yaml"
    inv.write_text(yaml.safe_dump({
        "slurm": {"partition": "debug", "nodes": 2, "container": "none", "workdir": str(tmp / "shared")},
        "job": {"image": "runner-trainer:latest", "command": ["python", "-c", "print(1)"]}}))
    return api.backend_for(api.load_inventory(inv))


def _run_dir(tmp: Path, files: dict[str, bytes]) -> Path:
    """A Slurm run's dir (its slurm/run.json makes it one) holding files, each 0640 and dated 2001."""
    run = tmp / "shared" / "runs" / RUN
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "run.json").write_text(json.dumps({"run_id": RUN, "submissions": []}))
    for rel, data in files.items():
        p = run / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(0o640)
        os.utime(p, (1_000_000_000, 1_000_000_000))
    return run


FILES = {"node0.out": b"step 1 loss 2.5\n", "checkpoints/step-2/model.pt": os.urandom(70_000),
         "metrics/rank0.jsonl": b'{"step": 1}\n'}


def test_collect_mirrors_the_run_dir_with_modes_times_and_a_verified_manifest(tmp_path):
    _run_dir(tmp_path, FILES)
    rep = _backend(tmp_path).collect(RUN, str(tmp_path / "artifacts"), plots=False)
    assert rep.ok and rep.run_id == RUN and rep.dest == tmp_path / "artifacts" / RUN
    (node,) = rep.nodes
    assert (node.node, node.files, node.copied, node.skipped) == ("slurm", 4, 4, 0)  # the record is a file too
    assert node.bytes_copied == sum(len(b) for b in FILES.values()) + len((rep.dest / "slurm/slurm/run.json").read_bytes())
    out = rep.dest / "slurm"
    manifest = json.loads((out / MANIFEST).read_text())
    for rel, data in FILES.items():
        assert (out / rel).read_bytes() == data
        st = (out / rel).stat()
        assert (stat.S_IMODE(st.st_mode), int(st.st_mtime)) == (0o640, 1_000_000_000)
        assert manifest[rel] == {"size": len(data), "mtime": 1_000_000_000, "sha256": hashlib.sha256(data).hexdigest()}
    assert not [p for p in out.iterdir() if p.name.startswith(".collect-staging")]


def test_a_second_collect_copies_only_what_changed(tmp_path):
    run = _run_dir(tmp_path, FILES)
    backend, dest = _backend(tmp_path), str(tmp_path / "artifacts")
    backend.collect(RUN, dest, plots=False)
    (run / "node0.out").write_bytes(b"step 1 loss 2.5\nstep 2 loss 2.1\n")   # the log grew
    (run / "node1.out").write_bytes(b"new\n")
    (node,) = backend.collect(RUN[:10], dest, plots=False).nodes              # a unique prefix names the run
    assert (node.files, node.copied, node.skipped) == (5, 2, 3)
    assert (tmp_path / "artifacts" / RUN / "slurm" / "node0.out").read_bytes().endswith(b"step 2 loss 2.1\n")


def test_a_copy_deleted_here_is_copied_again(tmp_path):
    _run_dir(tmp_path, FILES)
    backend, dest = _backend(tmp_path), str(tmp_path / "artifacts")
    backend.collect(RUN, dest, plots=False)
    (tmp_path / "artifacts" / RUN / "slurm" / "node0.out").unlink()
    (node,) = backend.collect(RUN, dest, plots=False).nodes
    assert (node.copied, node.skipped) == (1, 3)


def test_links_in_the_run_dir_are_not_followed_and_a_link_here_is_not_written_through(tmp_path):
    """A job's symlink (to a file it cannot give away) is not listed; a name in dest that is a link
    out of it (left there by anyone) is named as an error, and what it points at keeps its bytes."""
    run = _run_dir(tmp_path, FILES)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the job's")
    (run / "stolen").symlink_to(secret)
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    dest = tmp_path / "artifacts" / RUN / "slurm"
    dest.mkdir(parents=True)
    (dest / "node0.out").symlink_to(victim)
    res = NodeCollect("slurm", dest=str(dest))
    mirror_local(run, dest, res, RUN)
    assert (res.files, res.copied) == (4, 3)
    (err,) = res.errors
    assert err == f"'node0.out': leads out of {dest} through a link (to {victim})"
    assert victim.read_bytes() == b"mine" and not (dest / "stolen").exists()


def test_a_job_file_under_collects_own_names_is_named_and_the_rest_collected(tmp_path):
    run = _run_dir(tmp_path, FILES)
    (run / ".collect-manifest.json").mkdir()
    (run / ".collect-manifest.json" / "x").write_bytes(b"job")
    res = NodeCollect("slurm")
    mirror_local(run, tmp_path / "out", res, RUN)
    assert res.copied == 4 and len(res.errors) == 1 and "names that begin .collect- are collect's own" in res.errors[0]
    assert json.loads((tmp_path / "out" / MANIFEST).read_text()).keys() == {*FILES, "slurm/run.json"}


def test_collect_without_runs_is_one_line_naming_where_it_looked(tmp_path):
    (tmp_path / "shared" / "runs").mkdir(parents=True)
    with pytest.raises(UserError) as exc:
        _backend(tmp_path).collect(None, str(tmp_path / "artifacts"), plots=False)
    assert str(exc.value) == f"no Slurm runs in {tmp_path / 'shared'}/runs on this machine"
    assert not (tmp_path / "artifacts").exists()
