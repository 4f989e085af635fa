"""`job.perseus` plan files written, or swapped, by someone who wants code run on the master (issue
54, item 4). Before: the whole file was read before its 4 MiB bound was checked (a 1.5 GB sparse
file took 1.6 GB at --dry-run), the bytes sent to the master were a second, unchecked read, and
Zeus's PointSolution `eval()`ed the file it found on the master when a job registered. Now: read
once, bounded before reading, validated to plain data (known instruction names, frequencies in
range), and a canonical re-serialisation of the validated value is what reaches the master; the
server validates again and hands Zeus values, never a file to eval."""

from __future__ import annotations

import ast
import json
import os
import tracemalloc
import urllib.request
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from tests.support.perseus_helpers import perseus_server, write_plan

F = [("forward", 1410), ("backward", 1410)]
EVIL = "__import__('pathlib').Path({marker!r}).touch() or [[('forward', 1410), ('backward', 1410)]]\n"


def _inventory(tmp_path: Path, plan: Path, ranks: int = 1) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n  - {{name: m, host: 10.9.0.1, arch: amd64, slots: {ranks}}}\n"
                 f"job:\n  image: t:1\n  perseus:\n    plan: {plan}\n")
    return p


def test_a_plan_swapped_after_it_was_checked_never_reaches_the_master(tmp_path, monkeypatch):
    """The file is replaced by code the moment the check has read it (what a second user of the
    machine, or a sync tool, can do): what is sent must still be what was checked."""
    import runner.inventory.perseus_spec as spec_mod

    plan = write_plan(tmp_path / "plan.py", [F])
    marker = tmp_path / "pwned"
    checked = spec_mod.read_plan

    def check_then_swap(path, *a, **k):
        out = checked(path, *a, **k)
        Path(path).write_text(EVIL.format(marker=str(marker)))
        return out

    monkeypatch.setattr(spec_mod, "read_plan", check_then_swap)
    spec = load_inventory(_inventory(tmp_path, plan)).job.perseus
    sent = spec.plans[0][1]
    assert b"__import__" not in sent, sent[:200]
    assert ast.literal_eval(sent.decode()) == [F]  # plain data: exactly the validated value


def test_what_is_sent_is_the_canonical_form_of_the_validated_plan(tmp_path):
    """Comments, spacing, tuples or lists: re-serialised, so nothing of the file but its value travels."""
    plan = tmp_path / "plan.py"
    plan.write_text("# made by hand\n[ [ ['forward', 1410],\n  ('backward', 1410) ] ]  # one rank\n")
    sent = load_inventory(_inventory(tmp_path, plan)).job.perseus.plans[0][1]
    assert sent == b"[[('forward', 1410), ('backward', 1410)]]\n"


def test_a_huge_plan_is_refused_before_it_is_read(tmp_path):
    """A sparse file far over the bound: refused from its size, nothing of it read (before, the
    whole file was read first: 1.5 GB of memory for a 1.5 GB file)."""
    plan = tmp_path / "plan.py"
    with open(plan, "wb") as f:
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"job.perseus.plan: plan .*plan.py: .* over the 4194304 bytes"):
            load_inventory(_inventory(tmp_path, plan))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak >> 20} MiB"


@pytest.mark.parametrize("text, why", [
    ("[[('forward', 1410), ('rm -rf', 1410)]]", "unknown instruction 'rm -rf'"),
    ("[[('forward', 10**9)]]", "not a Python literal"),
    ("[[('forward', 1000000000)]]", "frequency 1000000000 not in 1..10000"),
    ("[[('forward', 0)]]", "not an (instruction, frequency) pair"),
    ("[[('forward', 1410.0)]]", "not an (instruction, frequency) pair"),
    ("[[('forward', True)]]", "not an (instruction, frequency) pair"),
    ("[" * 100 + "]" * 100, "not a Python literal"),
    ("[[('forward', 1410)]]\x00", "not a Python literal"),
    ("\xff[[('forward', 1410)]]", "not UTF-8"),
])
def test_plans_that_are_not_plain_plans_are_refused_in_one_line(tmp_path, text, why):
    plan = tmp_path / "plan.py"
    plan.write_bytes(text.encode("latin-1"))
    with pytest.raises(UserError) as exc:
        load_inventory(_inventory(tmp_path, plan))
    msg = str(exc.value)
    assert "\n" not in msg and "job.perseus.plan" in msg and why in msg, msg


def _post(url: str, body: dict) -> object:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.timeout(180)
def test_the_server_never_evals_a_plan_swapped_on_the_master(tmp_path):
    """The server checks its plan at start; Zeus's PointSolution read the file again, with eval,
    when a job registered: a plan swapped in between (the job shares the run dir) ran its code."""
    plan = write_plan(tmp_path / "plan.py", [F])
    marker = tmp_path / "pwned"
    with perseus_server(tmp_path, [plan]) as srv:
        plan.write_text(EVIL.format(marker=str(marker)))
        job = _post(f"{srv.url}/register_job", {"pp_degree": 1, "dp_degree": 1, "tp_degree": 1, "world_size": 1})
        _post(f"{srv.url}/register_rank/{job}", {"rank": 0, "dp_rank": 0, "pp_rank": 0, "tp_rank": 0,
                                                  "available_frequencies": [1410, 900]})
        with urllib.request.urlopen(f"{srv.url}/schedule/{job}?rank=0", timeout=60) as r:
            schedule = json.loads(r.read())
    assert not marker.exists(), "the server ran code from a plan file"
    assert schedule == {"rank": 0, "frequencies": [list(p) for p in F]}, schedule
    assert os.path.getsize(plan) > 0
