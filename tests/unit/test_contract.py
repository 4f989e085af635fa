"""The one module both wings import (docs/contract.md): the Chrome-trace and seed
timeline formats, metrics.jsonl and the plots live in `contract/`, torch-free; the runner builds no
trace events of its own and imports nothing from the trainer."""

from __future__ import annotations

import re
import subprocess
import sys

from tests import REPO


def test_contract_imports_without_torch_or_the_trainer():
    code = ("import sys, contract.timeline, contract.metrics, contract.plots, contract.memory, contract.model_size, "
            "contract.presets, contract.partition; "
            "print(sorted(m for m in ('torch', 'trainer', 'runner') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_runner_builds_no_trace_events_and_imports_no_trainer_code():
    for f in sorted((REPO / "runner").glob("*.py")):
        text = f.read_text()
        assert not re.search(r"^\s*(from|import) trainer\b", text, re.M), f.name
        assert '"traceEvents"' not in text and '"ph": "X"' not in text, f.name


def test_both_wings_use_the_contract_functions():
    import contract.plots
    import contract.timeline
    import runner.delivery.collect_report
    import trainer.tools.plots
    from trainer.profiling import trace

    assert trace.chrome_trace is contract.timeline.chrome_trace
    assert trace.seed_records is contract.timeline.seed_records
    assert trace.load_trace is contract.timeline.load_trace
    assert trainer.tools.plots.gantt is contract.plots.gantt and trainer.tools.plots.metrics_plot is contract.plots.metrics_plot
    assert runner.delivery.collect_report.seed_to_chrome is contract.timeline.seed_to_chrome  # what collect merges with


def test_seed_records_convert_back_to_the_same_chrome_trace(tmp_path):
    """What the trainer writes in the seed format and what the runner merges read back alike."""
    import json

    from contract.timeline import chrome_trace, load_trace, seed_records

    ev = [{"action": a, "stage": s, "mb": m, "peer": None, "bytes": 0, "start_ns": t0, "end_ns": t0 + 500}
          for a, s, m, t0 in (("forward", 0, 0, 1000), ("backward", 0, 0, 3000))]
    payloads = [{"rank": 0, "node": "n0", "stages": [0], "events": ev, "net": [], "offset_ns": 0, "error_ns": 0},
                {"rank": 1, "node": "n1", "stages": [1], "events": [dict(e, stage=1, start_ns=e["start_ns"] + 700,
                                                                            end_ns=e["end_ns"] + 700) for e in ev],
                 "net": [], "offset_ns": 0, "error_ns": 0}]
    seed = tmp_path / "timeline_batch1_all.json"
    seed.write_text(json.dumps(seed_records(payloads)))
    back = load_trace(seed)
    direct = chrome_trace(payloads, 1, {})
    slices = lambda t: sorted((e["pid"], e["name"], e["ts"], e["dur"]) for e in t["traceEvents"] if e["ph"] == "X")  # noqa: E731
    assert slices(back) == slices(direct)
    assert len(slices(back)) == 4


def test_plots_keep_one_font_cache_where_home_cannot_be_written(tmp_path):
    """HOME unwritable (here a file): matplotlib alone would rebuild its font cache in a new temporary
    dir in every process, with two warnings each time; the plots keep one for every run."""
    import os

    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.write_text("a file, not a directory\n")
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPL", "XDG_"))}
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=str(REPO))
    runs = [subprocess.run([sys.executable, "-c", "from contract.plots import _pyplot; _pyplot()"], env=env,
                           capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    assert runs[1].stderr == ""  # the second run found the first one's cache: nothing rebuilt, nothing said
    assert list((tmp / f"matplotlib-{os.getuid()}").glob("fontlist-*.json"))
