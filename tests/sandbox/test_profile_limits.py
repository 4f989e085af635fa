"""Node limits: inventory fields `cpus` and `memory` (validated at load, one line naming file:line,
field and node), shown in the dry-run plan, applied as Docker limits on the job's container (read
back from inside the container's cgroup on the session sandbox), and `runner sandbox up --cpus`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.cli.sandbox import parse_cpus
from runner.core.errors import UserError
from runner.inventory import load_inventory, memory_bytes
from runner.planning.plan import docker_limits, make_plan
from tests import IMAGE
from tests.support.runner_helpers import REPO, no_socket_env, node_workdir, runner

NODES = ("nodes:\n"
         "  - {name: pi-4, host: 10.9.0.1, arch: arm64, cpus: 0.5, memory: 4g}\n"
         "  - {name: pi-5, host: 10.9.0.2, arch: arm64, memory: 512m}\n"
         "  - {name: laptop, host: 10.9.0.3, arch: amd64}\n")


def _inv(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text(text + "job: {image: t:latest}\n")
    return p


def test_limits_parsed_and_in_the_plan(tmp_path):
    inv = load_inventory(_inv(tmp_path, NODES))
    assert [(n.cpus, n.memory) for n in inv.nodes] == [(0.5, "4g"), (None, "512m"), (None, None)]
    plan = make_plan(inv, "r1")
    assert [n.limits for n in plan.nodes] == ["cpus=0.5 memory=4g", "memory=512m", "none"]
    text = plan.render()
    assert "[pi-4/0] 10.9.0.1" in text and "gpus=none  limits cpus=0.5 memory=4g" in text
    assert plan.as_dict()["nodes"][1]["memory"] == "512m"
    assert docker_limits(0.5, "4g") == {"nano_cpus": 500_000_000, "mem_limit": "4g"}
    assert docker_limits(None, None) == {}
    assert memory_bytes("4g") == 4 << 30 and memory_bytes("512M") == 512 << 20 and memory_bytes("x") is None


def test_limits_in_defaults_apply_to_every_node(tmp_path):
    inv = load_inventory(_inv(tmp_path, "defaults: {cpus: 2, memory: 1g}\n" + NODES))
    assert [(n.cpus, n.memory) for n in inv.nodes] == [(0.5, "4g"), (2.0, "512m"), (2.0, "1g")]


@pytest.mark.parametrize("field, value, msg", [
    ("cpus", "fast", "nodes[1].cpus: must be a number of CPUs in 0.01..1024 (Docker --cpus, e.g. 0.5), got 'fast' (node pi-5)"),
    ("cpus", "0", "nodes[1].cpus: must be a number of CPUs in 0.01..1024"),
    ("cpus", "true", "nodes[1].cpus: must be a number of CPUs"),
    ("memory", "lots", "nodes[1].memory: must be a size like 512m or 4g (Docker --memory, at least 6m, at most 65536g), "
     "got 'lots' (node pi-5)"),
    ("memory", "1.5g", "nodes[1].memory: must be a size like 512m or 4g"),
    ("memory", "1m", "at least 6m"),
    ("memory", "65537g", "at most 65536g"),  # bounded where it is parsed (issue 54, item 6)
    ("memory", "[4g]", "nodes[1].memory: must be a size like 512m or 4g (Docker --memory, at least 6m, at most 65536g), "
     "got a list"),
])
def test_bad_limits_name_file_line_field_node(tmp_path, field, value, msg):
    bad = NODES.replace("  - {name: pi-5, host: 10.9.0.2, arch: arm64, memory: 512m}",
                        f"  - {{name: pi-5, host: 10.9.0.2, arch: arm64, {field}: {value}}}")
    p = _inv(tmp_path, bad)
    with pytest.raises(UserError) as e:
        load_inventory(p)
    assert str(e.value).startswith(f"{p}:3: ") and msg in str(e.value)
    # The CLI: one line, exit 2, nothing contacted (a dry-run refuses it too; every socket fatal).
    proc = subprocess.run([sys.executable, "-m", "runner", "up", "-i", str(p), "--dry-run"], capture_output=True,
                          text=True, cwd=REPO, env=no_socket_env(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and msg in proc.stderr


def test_sandbox_cpus_argument():
    assert parse_cpus("0.3,0.6,1.0", 3) == [0.3, 0.6, 1.0]
    assert parse_cpus("0.5", 3) == [0.5, 0.5, 0.5]
    assert parse_cpus(None, 3) is None
    with pytest.raises(UserError, match="2 values for 3 nodes"):
        parse_cpus("0.3,0.6", 3)
    with pytest.raises(UserError, match="give numbers of CPUs separated by commas"):
        parse_cpus("0.3;0.6", 2)
    with pytest.raises(UserError, match=r"999 is outside 0\.01\.\.\d+"):
        parse_cpus("999", 1)


def test_sandbox_up_cpus_refused_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "runner", "sandbox", "--dir", str(tmp_path / "s"), "up", "--nodes", "3",
                           "--cpus", "0.3,0.6", "--inventory", str(tmp_path / "inv.yaml")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "--cpus 0.3,0.6: 2 values for 3 nodes" in proc.stderr
    assert not (tmp_path / "s").exists() and not (tmp_path / "inv.yaml").exists()


def test_sandbox_writes_cpus_into_its_inventory(tmp_path):
    from runner.sandbox.cluster import Sandbox, write_inventory

    sb = Sandbox(tmp_path / "s", "127.0.0.11", 2222)
    inv = tmp_path / "local.yaml"
    write_inventory(inv, [sb.node(i) for i in range(3)], sb, [0.3, 0.6, 1.0])
    doc = yaml.safe_load(inv.read_text())
    assert [n["cpus"] for n in doc["nodes"]] == [0.3, 0.6, 1.0]
    write_inventory(inv, [sb.node(i) for i in range(3)], sb)
    assert all("cpus" not in n for n in yaml.safe_load(inv.read_text())["nodes"])


LIMITS_PROBE = r"""
import json, os
def first(*paths):
    for p in paths:
        try:
            return open(p).read().strip()
        except OSError:
            pass
doc = {'cpu_quota': first('/sys/fs/cgroup/cpu.max', '/sys/fs/cgroup/cpu/cpu.cfs_quota_us'),
       'cpu_period': first('/sys/fs/cgroup/cpu/cpu.cfs_period_us'),
       'memory': first('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes')}
json.dump(doc, open('/out/limits-' + os.environ['NODE_NAME'] + '.json', 'w'))
"""


def _cpus(doc: dict) -> float | None:
    q = doc["cpu_quota"]
    if " " in q:  # cgroup v2 "quota period"
        quota, period = q.split()
        return None if quota == "max" else int(quota) / int(period)
    return None if q == "-1" else int(q) / int(doc["cpu_period"])


@pytest.mark.sandbox
@pytest.mark.docker
def test_limits_reach_the_job_container(sandbox, pushed, tmp_path):
    doc = yaml.safe_load(Path(sandbox).read_text())
    doc["nodes"][0].update(cpus=0.5, memory="256m")
    doc["nodes"][2].update(cpus=1.25)
    doc["job"] = {"image": IMAGE, "command": ["python", "-c", LIMITS_PROBE], "master_port": "auto"}
    inv = tmp_path / "limits.yaml"
    inv.write_text(yaml.safe_dump(doc))
    proc = runner("up", "-i", str(inv), "--logs-dir", str(tmp_path / "logs"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    got = {n: json.loads((node_workdir(inv, n) / "runs" / run_id / f"limits-{n}.json").read_text())
           for n in ("node-0", "node-1", "node-2")}
    assert _cpus(got["node-0"]) == 0.5 and int(got["node-0"]["memory"]) == 256 << 20
    assert _cpus(got["node-1"]) is None and (got["node-1"]["memory"] == "max" or int(got["node-1"]["memory"]) > 1 << 40)
    assert _cpus(got["node-2"]) == 1.25


@pytest.mark.docker
def test_the_trainer_measures_against_its_containers_memory_limit(trainer_image, host_docker):
    """A node's `memory: 1g` is docker --memory on the job container; inside it sysconf still says the
    machine's RAM, so the trainer's check before it builds the model must read the cgroup's limit
    (trainer/models/build.py memory_limit: v1 or v2, whichever this engine gives)."""
    code = "from trainer.models.build import memory_limit, physical_memory; print(memory_limit(), physical_memory())"
    got = {}
    for mem in ("1g", None):
        res = subprocess.run(["docker", "-H", host_docker, "run", "--rm", "--network", "none",
                              *(["--memory", mem] if mem else []), trainer_image, "python", "-c", code],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        got[mem] = res.stdout.strip().splitlines()[-1]
    ram = got[None].rsplit(" ", 1)[1]
    assert got["1g"] == f"(1073741824, \"this container's memory limit\") {ram}", got
    assert got[None] == f"({ram}, \"this machine's memory\") {ram}", got
