"""The warm trainer the tests fork their single-process runs from (tests/support/trainer_zygote.py) runs
them as a fresh interpreter would: same metrics, files, output and status; a run whose
import-time environment differs gets a real process; a timed-out run is gone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import psutil
import pytest

from tests import REPO
from tests.support.trainer_run import numeric_metrics, run_trainer, trainer_env
from tests.support.trainer_zygote import import_time_env, zygote_for

TINY = ("configs/tiny.yaml", "--train.steps", "3")


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def test_a_forked_run_equals_a_fresh_process(tmp_path):
    warm = run_trainer(tmp_path / "warm", *TINY)
    fresh = run_trainer(tmp_path / "fresh", *TINY, fresh=True)
    assert numeric_metrics(tmp_path / "warm") == numeric_metrics(tmp_path / "fresh")
    assert len(numeric_metrics(tmp_path / "warm")) == 3
    assert _files(tmp_path / "warm") == _files(tmp_path / "fresh")
    assert _lines(warm.stdout, tmp_path / "warm") == _lines(fresh.stdout, tmp_path / "fresh")
    assert warm.stderr == fresh.stderr == ""


def _lines(text: str, out: Path) -> list[str]:
    """The output's lines with the run's directory and every number (times, rates) abstracted."""
    return [re.sub(r"\s*[-+]?\d+(\.\d+)?(e[+-]\d+)?[KMG]?", " N", ln.replace(str(out), "OUT")) for ln in text.splitlines()]


def test_status_and_error_line_are_a_processes(tmp_path):
    bad = ("configs/tiny.yaml", "--train.stepz", "3")
    warm = run_trainer(tmp_path / "w", *bad, check=False)
    fresh = run_trainer(tmp_path / "f", *bad, check=False, fresh=True)
    assert (warm.returncode, warm.stderr) == (fresh.returncode, fresh.stderr) == (2, fresh.stderr)
    assert fresh.stderr.startswith("error: unknown config key 'train.stepz'")


def test_an_import_time_variable_of_its_own_gets_a_real_process():
    base = trainer_env()
    assert zygote_for(base, base, REPO) is not None
    for key in ("HF_HUB_OFFLINE", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "PYTHONHASHSEED"):
        env = {**base, key: "7"}
        assert import_time_env(env) != import_time_env(base)
        assert zygote_for(env, base, REPO) is None, key
    assert zygote_for({**base, "TRAINER_TEST_HOLD": "step:1"}, base, REPO) is not None  # read at run time


def test_a_timed_out_run_is_killed_and_the_next_one_runs(tmp_path):
    out = tmp_path / "held"
    with pytest.raises(subprocess.TimeoutExpired):
        run_trainer(out, *TINY, env={"TRAINER_TEST_HOLD": "step:1"}, timeout=20)
    marker = out / ".hold" / "step-1.held.rank0"
    assert marker.is_file()  # it was running, held at step 1, when the timeout came
    zygote = zygote_for(trainer_env(), trainer_env(), REPO)
    assert psutil.Process(zygote.proc.pid).children(recursive=True) == []  # the held run is gone
    run_trainer(tmp_path / "next", *TINY)
    assert len(numeric_metrics(tmp_path / "next")) == 3


def test_a_torchrun_with_forked_workers_equals_torchrun_m_trainer(tmp_path):
    """nproc=2 through torchrun's own CLI either way: workers forked from the warm launcher, or
    `torchrun -m trainer` in new interpreters; the same losses, files and per-rank logs."""
    args = (*TINY, "--parallel.sharding", "zero3")
    run_trainer(tmp_path / "warm", *args, nproc=2)
    run_trainer(tmp_path / "fresh", *args, nproc=2, fresh=True)
    assert numeric_metrics(tmp_path / "warm") == numeric_metrics(tmp_path / "fresh")
    assert _files(tmp_path / "warm") == _files(tmp_path / "fresh")
    assert "logs/rank1.log" in _files(tmp_path / "warm")
    for rank in (0, 1):
        warm, fresh = ((tmp_path / d / "logs" / f"rank{rank}.log").read_text() for d in ("warm", "fresh"))
        assert _lines(_untimed(warm), tmp_path / "warm") == _lines(_untimed(fresh), tmp_path / "fresh")


def _untimed(log: str) -> str:
    """A rank log without the timestamps its lines start with."""
    return "\n".join(ln.split(" ", 2)[-1] if ln[:1].isdigit() else ln for ln in log.splitlines())


def test_importing_the_trainer_here_does_not_change_the_runs_import_time_env(monkeypatch):
    """trainer/data/text_sources.py sets the Hub's offline variables in whatever process imports it, and
    torch's inductor its cache dir the first time it looks; an in-process test that does either must
    not change what the next run is compared on (else every later run silently starts a fresh
    interpreter: TESTS_ZYGOTE_LOG=FILE says why each one did)."""
    import importlib

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    import trainer.data.text_sources

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(key, raising=False)
    before = import_time_env(trainer_env())
    importlib.reload(trainer.data.text_sources)
    cache_dir()
    assert import_time_env(trainer_env()) == before
