"""Shared set-up for the runner benchmarks: a sandbox cluster of its own, CLI calls, timings."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
STATE = Path(os.environ.get("BENCH_SANDBOX", "/tmp/runner-bench-sandbox"))
BASE_ADDR = os.environ.get("BENCH_BASE_ADDR", "127.0.9.11")


def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, cwd=REPO, **kw)
    if check and proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def runner(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh(sys.executable, "-m", "runner", *args, check=check)


def sandbox(nodes: int, fresh: bool = False) -> Path:
    inv = STATE / "local.yaml"
    if fresh:
        runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
    runner("sandbox", "--dir", str(STATE / "s"), "up", "--nodes", str(nodes), "--base-addr", BASE_ADDR,
           "--inventory", str(inv))
    return inv


def teardown() -> None:
    runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)


def subset(inv: Path, n: int, job: dict, suffix: str = "") -> Path:
    """Inventory with the first n nodes and the given job section."""
    doc = yaml.safe_load(inv.read_text())
    doc["nodes"] = doc["nodes"][:n]
    doc["job"] = job
    p = STATE / f"inv-{n}{suffix}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0


def ssh_argv(doc: dict, node: dict) -> list[str]:
    """Plain OpenSSH to a sandbox node of inventory `doc`, host key checked (for the naive scripts)."""
    d = doc["defaults"]
    return ["ssh", "-p", str(d["port"]), "-i", d["identity_file"], "-o", f"UserKnownHostsFile={d['known_hosts']}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"{d['user']}@{node['host']}"]



def wipe(inv: Path) -> None:
    """Every image and layer off every node of `inv`: the next push is a first push."""
    doc = yaml.safe_load(inv.read_text())
    for n in doc["nodes"]:
        subprocess.run([*ssh_argv(doc, n), "docker rmi -f $(docker images -aq) >/dev/null 2>&1; "
                        "docker image prune -af >/dev/null; true"], check=True)


def uplink_bytes(state: Path) -> int:
    """Bytes this host has sent into the namespaced sandbox under `state` (its bridge's own counter)."""
    from runner.sandbox.net import SandboxNet

    return int(Path(f"/sys/class/net/{SandboxNet.for_state_dir(state).bridge}/statistics/tx_bytes").read_text())
