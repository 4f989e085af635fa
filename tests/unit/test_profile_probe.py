"""`trainer probe` (what `runner profile` runs on every node), here as two local processes: the
compute measurements of the job's layer kinds with the link to a neighbour, the JSON it writes, and
its one-line failures. The profile cache keys and the `runner profile` refusals that need no node."""

from __future__ import annotations

import json
import math
import socket
import statistics
import subprocess
import sys

import pytest

from runner.inventory import Job, Node
from runner.planning.profile_cache import node_key, shape_args
from tests.support.runner_helpers import REPO
from tests.support.trainer_run import free_port

TRAIN = ["--", "--config", "configs/pi-qwen3-3stage-tiny.yaml", "--batch_size", "16", "--microbatch_num", "4",
         "--model.num_hidden_layers", "5"]


def _probe(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", "probe", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                                    "NODE_NAME": "probe-test"})


def test_probe_measures_kinds_memory_and_link(tmp_path):
    port = free_port()
    out = tmp_path / "profile.json"
    server = _probe("--out", str(out), "--serve", str(port), "--min-seconds", "0.4", "--timeout", "120", *TRAIN)
    client = _probe("--peer", f"127.0.0.1:{port}", "--no-compute", "--link-bytes", str(1 << 20), "--timeout", "120")
    c_out, c_err = client.communicate(timeout=300)
    s_out, s_err = server.communicate(timeout=300)
    assert client.returncode == 0, c_err[-2000:]
    assert server.returncode == 0, s_err[-2000:]
    assert s_out.startswith("probe: probe-test: embed ")
    link = json.loads(c_out)["link"]
    assert link["bytes"] == 1 << 20 and len(link["rtts_s"]) == 20
    # The latency is half the median of the 20 round trips it reports (each a real one), the
    # bandwidth a measured rate: checked against each other, not against this machine's speed.
    assert all(x > 0 for x in link["rtts_s"]), link
    assert link["latency_s"] == pytest.approx(statistics.median(link["rtts_s"]) / 2, rel=1e-6, abs=1e-9), link
    assert 0 < link["bandwidth_Bps"] < math.inf, link
    doc = json.loads(out.read_text())
    from runner.profile.doc_check import problem

    # What the runner checks before using a node's answer accepts the real probe's (hostile ones:
    # tests/unit/test_slow_node_bounds.py).
    assert problem(doc, compute=True, link=False) is None and problem(json.loads(c_out), compute=False, link=True) is None
    m = doc["model"]
    assert (m["family"], m["num_layers"], m["hidden_size"], m["microbatch"], m["seq_len"], m["microbatches"]) == \
        ("qwen3", 5, 64, 4, 128, 4)
    assert m["pp"] == 3 and m["pp_schedule"] == "1f1b" and m["partition"] == "custom:0,2,5,7"
    for kind in ("embed", "block", "head"):
        assert doc["reps"][kind] >= 2
        assert doc["time_s"][kind] > 0
        # AdamW: parameters, their gradients and two moments, all fp32 (the step count is a scalar).
        assert doc["train_bytes"][kind] == 4 * doc["param_bytes"][kind]
    hidden, vocab = 64, m["vocab_size"]
    assert doc["param_bytes"]["embed"] == vocab * hidden * 4
    assert doc["act_bytes"]["block"] > doc["boundary_bytes"] == 4 * 128 * hidden * 4
    assert doc["model_bytes"] == m["params"] * 4
    assert 0 < doc["runtime_bytes"] < doc["memory_available"]
    assert doc["cgroup_cpus"] is None and doc["threads"] == 1
    assert "link" not in doc  # the serving side measured no link of its own


def test_probe_failures_are_one_line(tmp_path):
    bad = _probe("--no-compute", "--serve", str(free_port()), "--timeout", "1")
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 1 and "the previous neighbour never finished on port" in err
    bad = _probe("--out", str(tmp_path / "x.json"), "--", "--config", "configs/pi-qwen3-3stage-tiny.yaml",
                 "--parallel.partition", "custom:3,1")
    out, err = bad.communicate(timeout=120)
    assert bad.returncode == 2 and err.strip().count("\n") == 0 and "parallel.partition" in err
    bad = _probe("--peer", f"127.0.0.1:{free_port()}", "--no-compute", "--timeout", "1")
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 1 and err.startswith("error: link probe: no link probe answered on 127.0.0.1"), err
    assert err.strip().count("\n") == 0, err  # was a traceback ending in that line


def test_a_peer_port_that_accepts_but_never_answers_is_one_line():
    """CI: the free port the test picked was taken by another test's server before the probe
    connected, so the connection was accepted and the probe's first read timed out: a traceback."""

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # the kernel accepts; nothing ever answers
        bad = _probe("--peer", f"127.0.0.1:{silent.getsockname()[1]}", "--no-compute", "--timeout", "1")
        out, err = bad.communicate(timeout=60)
    assert bad.returncode == 1, err
    assert err.startswith("error: link probe: 127.0.0.1:") and "accepted but answered no link probe" in err, err
    assert err.strip().count("\n") == 0, err


def test_cache_key_follows_what_changes_the_numbers(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {preset: tiny-qwen3}\n")
    node = Node("n", "10.0.0.1", cpus=0.5)
    job = Job(config=str(cfg), args=["--train_steps", "5"], env={"OMP_NUM_THREADS": "1"})
    k = node_key(node, job, "sha256:a", 1, 1.0)
    same = Job(config=str(cfg), args=["--train_steps", "5", "--parallel.partition", "auto", "--resume=latest"],
               env={"OMP_NUM_THREADS": "1"})
    assert node_key(node, same, "sha256:a", 1, 1.0) == k  # partition and resume change no measurement
    assert node_key(node, job, "sha256:b", 1, 1.0) != k   # another image
    assert node_key(Node("n", "10.0.0.1", cpus=1.0), job, "sha256:a", 1, 1.0) != k
    assert node_key(node, Job(config=str(cfg), args=["--train_steps", "5"], env={"OMP_NUM_THREADS": "2"}),
                    "sha256:a", 1, 1.0) != k
    cfg.write_text("model: {preset: tiny-qwen3, num_hidden_layers: 3}\n")
    assert node_key(node, job, "sha256:a", 1, 1.0) != k   # another model shape
    assert shape_args(["--parallel.partition", "auto", "--x", "1", "--partition_method=uniform"]) == ["--x", "1"]


def test_profile_refuses_a_custom_command_before_connecting(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes:\n  - {name: a, host: 10.255.255.1, arch: amd64}\n"
                   "job: {image: t:1, command: [python, -c, 'print(1)']}\n")
    proc = subprocess.run([sys.executable, "-m", "runner", "profile", "-i", str(inv)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "job.command replaces the trainer" in proc.stderr


@pytest.mark.parametrize("flag", ["--help"])
def test_profile_is_a_runner_command(flag):
    proc = subprocess.run([sys.executable, "-m", "runner", "profile", flag], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and "--refresh" in proc.stdout and "--json" in proc.stdout
