"""`python -m bench` runs each benchmark as `python -m bench.NAME`: every one must import that way
(a bench importing its helpers as a top-level module only worked as `python bench/x.py`)."""

from __future__ import annotations

import importlib

import pytest

from bench.__main__ import BENCHES


@pytest.mark.parametrize("name", BENCHES)
def test_bench_module_imports_as_a_package_module(name):
    mod = importlib.import_module(f"bench.{name}")
    assert callable(getattr(mod, "main", None)), f"bench/{name}.py has no main()"


@pytest.mark.slow  # runs the bench's CPU rows (minutes under load): RUN_SLOW=1; the bad-argument checks below run always
def test_gpu_session_smoke_keeps_every_row_and_its_bookkeeping(tmp_path):
    """bench/gpu_session.sh --smoke on CPU: the bench's real rows (trainer defaults, both compiled
    plain loops) measure and agree on the loss, a forced out-of-memory and a hung row are recorded
    as such, the row after the budget as skipped, and the GPU tests skip; every file lands in OUT."""
    import csv
    import json
    import os
    import subprocess
    import sys
    import xml.etree.ElementTree as ET

    from tests import REPO

    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_session.sh"), "--smoke", "out", "1500"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=1600)
    tmp_path = tmp_path / "out"  # a relative OUT is the caller's directory's
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    session = json.loads((tmp_path / "session.json").read_text())
    assert [(p["name"], p["rc"], p["cut_off"]) for p in session["phases"]] == [
        ("environment", 0, False), ("pytest_gpu", 0, False), ("gpu_throughput", 0, False)]
    doc = json.loads((tmp_path / "gpu_throughput.json").read_text())
    assert [(r["name"], r["status"]) for r in doc["rows"]] == [
        ("trainer (defaults)", "ok"), ("plain compiled, per layer", "ok"), ("plain compiled, whole model", "ok"),
        ("smoke: forced out-of-memory", "oom"), ("smoke: hangs into its timeout", "timeout")]
    assert [(r["name"], r["status"], r["why"]) for r in doc["not_run"]] == [("smoke: after the budget", "skipped",
                                                                              "budget")]
    assert doc["complete"] is False and doc["torch"] and doc["transformers"]
    ok = doc["rows"][:3]
    assert all(r["graphs"] >= 1 and r["graph_breaks"] >= 0 and r["sdpa"] == ["flash"] for r in ok), ok
    assert all(r["reps"] == r["reps_planned"] == 2 and len(r["tokens_per_s_windows"]) == 2 for r in ok)
    assert doc["loss_agreement"]["tiny-llama"]["agree"] and doc["loss_agreement"]["tiny-llama"]["rows"] == 3
    assert doc["targets"]["tiny-llama"]["baselines_measured"] == ["plain compiled, per layer",
                                                                  "plain compiled, whole model"]
    assert len(list((tmp_path / "gpu_throughput_logs").iterdir())) == 5
    suite = ET.parse(tmp_path / "pytest_gpu.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 5 and int(suite.get("skipped")) == int(suite.get("tests"))
    assert "torch" in (tmp_path / "environment.txt").read_text()
    with (tmp_path / "gpu_throughput.csv").open() as f:
        flat = list(csv.DictReader(f))
    assert [(r["name"], r["status"]) for r in flat] == [(r["name"], r["status"]) for r in doc["rows"] + doc["not_run"]]


@pytest.mark.parametrize("args, message", [
    ((), "usage: gpu_session.sh [--smoke] OUT [BUDGET_S]"),
    (("{out}", "4m"), "BUDGET_S must be a whole number of seconds, got '4m'"),
])
def test_gpu_session_refuses_bad_arguments(tmp_path, args, message):
    import subprocess

    from tests import REPO

    argv = [a.format(out=tmp_path / "out") for a in args]
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_session.sh"), *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == f"gpu_session: {message}"
    assert not (tmp_path / "out" / "session.log").exists()  # nothing started


def test_gpu_bench_plans_the_headline_first_and_names_sdpa_kernels():
    import argparse

    from bench.gpu_throughput import plan, sdpa_kernels

    rows = plan(argparse.Namespace(smoke=False, quick=False))
    head = [(r.preset, r.name, r.batch) for r in rows[:10]]
    assert head[:6] == [(p, n, b) for p, b in (("smollm-360m", 8), ("qwen3-0.6b", 8), ("smollm-1.7b", 4))
                        for n in ("trainer (defaults)", "plain compiled, per layer")]
    assert head[6] == ("smollm-1.7b", "trainer, largest batch", 8)  # the MFU target's first try
    assert head[7:] == [(p, "plain compiled, whole model", b)
                        for p, b in (("smollm-360m", 8), ("qwen3-0.6b", 8), ("smollm-1.7b", 4))]
    search = [r.batch for r in rows if r.group == "search"]
    assert search == [8, 12, 16, 16, 24, 32]  # increasing: a batch that fails stops the larger ones
    assert [r.group for r in rows[10:15]] == ["search"] * 5 and rows[-1].group == "features"
    assert [r.overrides for r in rows if r.name == "trainer, gc_interval 0"] == [{"train.gc_interval": 0}] * 3
    assert len(plan(argparse.Namespace(smoke=False, quick=True))) == 9
    assert sdpa_kernels(["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "ampere_gemm"]) == [
        "flash"]
    assert sdpa_kernels(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]) == ["cudnn"]
    assert sdpa_kernels(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "aten::_efficient_attention_forward"]) == [
        "efficient"]
    assert sdpa_kernels(["aten::bmm", "aten::softmax"]) == ["none seen"]


def test_gpu_bench_trainer_rows_run_the_loops_garbage_collection_schedule(tmp_path):
    """A trainer row times Trainer.train_step outside Trainer.fit: it must hold train.gc_interval's
    schedule as fit's loop does (automatic collector off, generation 1 every N steps), or the
    bench would measure a trainer its users never run."""
    import gc
    import logging

    import torch

    from bench.gpu_throughput import _config, _trainer_step

    job = {"preset": "tiny-llama", "seq": 32, "batch": 2, "device": "cpu", "backend": "eager",
           "overrides": {"train.gc_interval": 3}}
    was = gc.isenabled()
    log = logging.getLogger("trainer")
    saved = (log.handlers[:], log.propagate, log.level)  # setup_logging replaces them: put them back
    _, step = _trainer_step(_config(job, str(tmp_path)), torch.device("cpu"))
    trainer = next(c.cell_contents for c in step.__closure__ if hasattr(c.cell_contents, "gc"))
    try:
        enabled = []
        for _ in range(7):
            step()
            enabled.append(gc.isenabled())
        assert enabled == [False] * 7 and trainer.step == 7
        assert trainer.gc.collections == 2  # after steps 3 and 6
    finally:
        trainer.close()
        if torch.distributed.is_initialized():  # the one-rank group it made: later tests start with none
            torch.distributed.destroy_process_group()
        gc.enable() if was else gc.disable()
        for h in log.handlers:
            if h not in saved[0]:
                h.close()
        log.handlers[:], log.propagate, log.level = saved


def test_gpu_bench_keeps_a_result_printed_before_the_rows_timeout(tmp_path):
    """A row that printed its result and then outlived its time (a process whose exit waits on
    compile workers; seen on an H200: qwen3-0.6b's whole-model row) keeps that result, marked
    killed_after_result, instead of becoming a timeout."""
    import argparse

    from bench.gpu_throughput import Row, run_row

    args = argparse.Namespace(steps=1, warmup=0, reps=1, seq=8, smoke=True, backend="eager")
    import psutil

    res = run_row(Row("lingers", "plain", "tiny-llama", 2, group="test-oom-linger"), args, 6.0, tmp_path / "row.log")
    assert (res["status"], res.get("killed_after_result")) == ("oom", True)
    assert res["wall_s"] >= res["timeout_s"] == 6  # ended by the row's timeout (its worker sleeps an hour) ...
    lingering = [p.pid for p in psutil.process_iter(["cmdline"])
                 if any('"fault": "oom linger"' in a for a in p.info["cmdline"] or ())]
    assert lingering == [], lingering  # ... and its process group killed: the worker is gone, not left behind


def test_gpu_bench_selects_rows_by_preset_and_name_and_refuses_unknown_ones():
    import argparse
    import subprocess
    import sys

    from bench.gpu_throughput import plan, select

    rows = plan(argparse.Namespace(smoke=False, quick=False))
    picked = select(rows, ["smollm-1.7b", "qwen3-0.6b"], ["trainer (defaults)", "trainer, gc_interval 0"])
    assert [(r.preset, r.name) for r in picked] == [
        ("qwen3-0.6b", "trainer (defaults)"), ("smollm-1.7b", "trainer (defaults)"),
        ("qwen3-0.6b", "trainer, gc_interval 0"), ("smollm-1.7b", "trainer, gc_interval 0")]  # the plan's order
    assert select(rows, [], []) == rows
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_throughput", "--row", "trainer"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("gpu_throughput: no row named 'trainer'; one of: 'plain compiled, per layer', ")


def test_gpu_gap_script_names_rows_and_presets_the_bench_has():
    """bench/gpu_gap.sh runs once on a lent GPU: a row name the bench no longer has would waste it."""
    import argparse
    import re

    from bench.gpu_throughput import plan, select
    from tests import REPO

    text = (REPO / "bench" / "gpu_gap.sh").read_text()
    names, presets = re.findall(r'--row "([^"]+)"', text), re.findall(r'--preset ([a-z]\S+) ', text)
    assert names == ["trainer (defaults)", "plain compiled, per layer", "trainer, largest batch"]
    # the optimizer phase's, the headline presets, the batch search's, the step profile's
    assert presets == ["smollm-1.7b", "smollm-360m", "qwen3-0.6b", "smollm-1.7b", "smollm-1.7b", "smollm-1.7b"]
    presets = presets[1:]
    assert re.findall(r"bench.optimizer_step --device cuda --preset (\S+) ", text) == ["smollm-1.7b"]
    assert re.findall(r"gpu_step_profile .* --preset (\S+) \\\n\s+--batch 4", text) == ["smollm-1.7b"]
    rows = plan(argparse.Namespace(smoke=False, quick=False))
    picked = select(rows, presets[:3], names[:2])
    assert {(r.preset, r.name) for r in picked} == {(p, n) for p in presets[:3] for n in names[:2]}
    search = select(rows, ["smollm-1.7b"], names[2:])
    assert [r.batch for r in search][0] == 8 and all(not r.overrides for r in search)
    # the GPU tests it runs: every -k term names at least one test of tests/gpu/test_gpu.py
    terms = re.search(r'-k "([^"]+)"', text)[1].split(" or ")
    tests = re.findall(r"^def (test_\w+)", (REPO / "tests" / "gpu" / "test_gpu.py").read_text(), re.M)
    assert terms and all(any(t in name for name in tests) for t in terms), (terms, tests)
