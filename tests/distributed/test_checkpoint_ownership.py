"""A checkpoint save never deletes or replaces what the trainer did not write (trainer/checkpoint/ownership.py).

Written as an unlucky user meets it: a folder of their own where the trainer puts a checkpoint
(`S/step-2/thesis.tex`), a crash leftover's name, a look-alike with a trainer_state.json that
pruning would take for an old checkpoint, a `latest` that is not the trainer's pointer, a folder
that appears while the run trains; one process and two ranks over gloo. Each is refused in one
line (exit 2, nothing of the user's touched) or passed over; the trainer's own checkpoints, old
unmarked ones included, are still replaced and pruned."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.trainer_run import REPO, held, hold_env, release, run_trainer, start_trainer, trainer_env
from trainer.checkpoint import ownership

RUN = ("--data.source", "synthetic", "--train_steps", "2", "--checkpoint.enabled", "true")
THESIS = "\\documentclass{article} notes\n"


def _user_folder(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "thesis.tex").write_text(THESIS)
    return d


def _one_line_refusal(proc, *words: str) -> str:
    """The run ended with exit 2 (one process) and an `error:` line naming words, no traceback."""
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert errors, proc.stderr[-3000:]
    assert all(w in errors[0] for w in words), errors[0]
    assert "Traceback" not in proc.stderr.split("torch.distributed.elastic")[0], proc.stderr[-3000:]
    return errors[0]


def test_a_save_never_deletes_a_folder_it_did_not_write(tmp_path):
    """The issue's reproduction: exit 0, no warning and thesis.tex gone before."""
    s = tmp_path / "S"
    _user_folder(s / "step-2")
    proc = run_trainer(tmp_path / "out", *RUN, "--checkpoint.dir", str(s), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _one_line_refusal(proc, str(s / "step-2"), "did not write", "move it")
    assert (s / "step-2" / "thesis.tex").read_text() == THESIS
    assert sorted(p.name for p in s.iterdir()) == ["step-2"]
    assert sorted(p.name for p in (s / "step-2").iterdir()) == ["thesis.tex"]


@pytest.mark.parametrize("where", [".tmp-step-2", "latest"])
def test_a_leftover_name_or_latest_that_is_not_the_trainers_is_refused(tmp_path, where):
    s = tmp_path / "S"
    _user_folder(s / where)
    proc = run_trainer(tmp_path / "out", *RUN, "--checkpoint.dir", str(s), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _one_line_refusal(proc, str(s / where))
    assert (s / where / "thesis.tex").read_text() == THESIS
    assert sorted(p.name for p in s.iterdir()) == [where]


def test_a_latest_file_of_the_users_is_never_replaced(tmp_path):
    s = tmp_path / "S"
    s.mkdir()
    (s / "latest").write_text("my latest results:\n0.93 on the hold-out set\n")
    proc = run_trainer(tmp_path / "out", *RUN, "--checkpoint.dir", str(s), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _one_line_refusal(proc, str(s / "latest"), "not a pointer the trainer wrote")
    assert (s / "latest").read_text().startswith("my latest results")


def _lookalike(d: Path, step: int) -> None:
    _user_folder(d)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))


def test_pruning_passes_over_lookalikes_it_did_not_write(tmp_path):
    """keep_last 1 and one .preempt at a time: a user's step-0 and step-0.preempt with a
    trainer_state.json each were the oldest checkpoints to prune before."""
    s = tmp_path / "S"
    _lookalike(s / "step-0", 0)
    _lookalike(s / "step-0.preempt", 0)
    proc = run_trainer(tmp_path / "out", "--data.source", "synthetic", "--train_steps", "4", "--checkpoint.dir",
                       str(s), "--checkpoint.interval", "2", "--checkpoint.preempt_interval", "1",
                       "--checkpoint.keep_last", "1")
    assert sorted(p.name for p in s.iterdir()) == ["latest", "step-0", "step-0.preempt", "step-3.preempt", "step-4"]
    for d in ("step-0", "step-0.preempt"):
        assert (s / d / "thesis.tex").read_text() == THESIS
        assert f"{s / d} looks like a checkpoint but the trainer did not write it" in proc.stdout + proc.stderr
    assert (s / "latest").read_text() == "step-4\n"


def test_the_trainers_own_checkpoints_are_still_replaced_old_unmarked_ones_too(tmp_path):
    """The same command twice in one directory (no resume) replaces its own step-2; a checkpoint of
    a trainer before the marker (no marker, complete by its manifests) is the trainer's too."""
    s, out = tmp_path / "S", tmp_path / "out"
    run_trainer(out, *RUN, "--checkpoint.dir", str(s))
    # The directory's inode, not trainer_state.json: its saved_at has one-second resolution and two
    # runs of the warm trainer often end within the same second (the test failed then). The new
    # step-2 is made as .tmp-step-2 while the old one still stands, so a replaced one has a new inode.
    first = (s / "step-2").stat().st_ino
    assert (s / "step-2" / ownership.MARKER).read_bytes() == ownership.MARKER_TEXT
    (s / "step-2" / ownership.MARKER).unlink()  # as an older trainer left it
    manifest = s / "step-2" / "manifest.rank0.json"
    files = json.loads(manifest.read_text())
    del files[ownership.MARKER]
    manifest.write_text(json.dumps(files))
    assert ownership.is_ours(s / "step-2")
    run_trainer(out, *RUN, "--checkpoint.dir", str(s))
    assert (s / "step-2").stat().st_ino != first  # a new directory in its place
    assert (s / "step-2" / ownership.MARKER).read_bytes() == ownership.MARKER_TEXT  # written again
    assert ownership.MARKER in json.loads(manifest.read_text())  # the new manifest lists it again
    assert sorted(p.name for p in s.iterdir()) == ["latest", "step-2"]


@pytest.mark.multiproc
def test_two_ranks_refuse_together_and_leave_the_folder(tmp_path):
    """Two ranks over gloo: the writing rank (rank 0) decides, both end with the same line, no rank
    waits for the collective timeout."""
    s = tmp_path / "S"
    _user_folder(s / "step-2")
    proc = run_trainer(tmp_path / "out", *RUN, "--checkpoint.dir", str(s), nproc=2, check=False, timeout=300)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "error: " in ln and "did not write" in ln]
    assert len(lines) == 2, proc.stderr[-3000:]
    assert (s / "step-2" / "thesis.tex").read_text() == THESIS
    assert sorted(p.name for p in s.iterdir()) == ["step-2"]


@pytest.mark.multiproc
def test_a_folder_made_while_the_run_trains_is_not_replaced(tmp_path):
    """The folder appears after the start (the run is held after step 1): the save of step 2
    itself refuses, on both ranks, before it writes anything."""
    s, out = tmp_path / "S", tmp_path / "out"
    proc = start_trainer(out, *RUN, "--checkpoint.dir", str(s), nproc=2, env=hold_env("step:1"))
    try:
        _wait(lambda: held(out, "step-1", range(2)) or proc.poll() is not None)
        _user_folder(s / "step-2")
        release(out, "step-1")
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert len([ln for ln in err.splitlines() if f"error: {s / 'step-2'}" in ln]) == 2, err[-3000:]
    assert sorted(p.name for p in (s / "step-2").iterdir()) == ["thesis.tex"]
    assert not any(p.name.startswith(".tmp-") for p in s.iterdir())


def _wait(cond, timeout: float = 300) -> None:
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


# --- the rule itself -------------------------------------------------------------------------

def test_ownership_rule(tmp_path):
    ours = tmp_path / "step-1"
    ownership.make(ours)
    assert ownership.is_ours(ours) and ownership.in_the_way(ours) is None
    (tmp_path / "link").symlink_to(ours)
    assert not ownership.is_ours(tmp_path / "link")  # a link to a checkpoint is not one
    assert "a link" in ownership.in_the_way(tmp_path / "link")
    (tmp_path / "file").write_text("x")
    assert "a file" in ownership.in_the_way(tmp_path / "file")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / ownership.MARKER).write_text("something else\n")  # only the trainer's own text counts
    assert not ownership.is_ours(fake)
    assert ownership.remove(fake) is False and fake.is_dir()
    assert ownership.remove(ours) is True and not ours.exists()
    names = ownership.name_pattern("step-{step}", "")
    assert names.fullmatch("step-12") and names.fullmatch("step-3.preempt") and not names.fullmatch("step-x")
    root = tmp_path / "root"
    root.mkdir()
    (root / "latest").write_text("step-9\n")  # names a checkpoint that is gone, in this run's naming
    assert ownership.pointer_problem(root, names) is None
    (root / "latest").write_text("notes\n")
    assert "not a pointer" in ownership.pointer_problem(root, names)
    ownership.make(root / "mine-1")
    (root / "latest").write_text("mine-1\n")  # another naming, but the trainer's checkpoint
    assert ownership.pointer_problem(root, names) is None
    (root / "latest").unlink()
    ownership.write_pointer(root, "step-4")
    assert (root / "latest").read_text() == "step-4\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "mine-1"]


def test_a_marker_that_cannot_be_written_leaves_no_directory(tmp_path, monkeypatch):
    real_open = os.open

    def full(path, flags, mode=0o777):
        if str(path).endswith(ownership.MARKER):
            raise OSError(28, "No space left on device")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(OSError):
        ownership.make(tmp_path / ".tmp-step-1")
    assert not (tmp_path / ".tmp-step-1").exists()


def _export(ckpt: Path, out: Path):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "trainer", "export", str(ckpt), str(out)], capture_output=True,
                          text=True, env=trainer_env(), cwd=REPO, timeout=300)


def test_an_export_never_writes_into_a_folder_of_the_users(tmp_path):
    """`trainer export CKPT DIR` with DIR another model of the user's: save_pretrained replaced its
    config.json and weights. Refused in one line, nothing written; a new DIR, then the same DIR
    again (an earlier export), is written."""
    s, out = tmp_path / "S", tmp_path / "out"
    run_trainer(out, *RUN, "--checkpoint.dir", str(s))
    mine = _user_folder(tmp_path / "my-model")
    (mine / "config.json").write_text('{"model_type": "mine"}')
    proc = _export(s, mine)
    assert proc.returncode == 2, proc.stderr[-2000:]
    _one_line_refusal(proc, str(mine), "did not write")
    assert (mine / "config.json").read_text() == '{"model_type": "mine"}'
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "thesis.tex"]
    hf = tmp_path / "hf"
    for _ in range(2):
        proc = _export(s, hf)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert (hf / "config.json").is_file() and (hf / ".trainer-export").is_file()
