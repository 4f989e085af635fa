"""Push's compressed full path and its fallback, collect's verification, merge and plots, check's
image state: against the sandbox cluster (real sshd + dockerd per node, real files).

Images here are small FROM-scratch images of random bytes (layers no node has), exported into a
per-test cache (RUNNER_IMAGE_CACHE) so the shared export cache of the trainer image is left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from runner import push as push_mod
from runner.images import export
from runner.inventory import load_inventory
from runner.ssh import Remote
from tests.runner_helpers import (
    REPO,
    build_scratch_image,
    node_env,
    node_workdir,
    parse_push,
    remotes,
    runner,
    runner_cmd,
    write_job,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")


def node_image_id(inventory: Path, node: str, tag: str) -> str | None:
    with remotes(inventory)[node] as r:
        res = r.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag])
    return res.out.strip() if res.rc == 0 else None


def connect(inventory: Path, node: str) -> Remote:
    return Remote(load_inventory(inventory, with_job=False).node(node)).connect()


def own_children() -> list[str]:
    return [p.name() for p in psutil.Process().children(recursive=True) if p.name() in ("tar", "gzip", "ssh")]


# ---------------------------------------------------------------------------- push

def test_push_full_compressed_whole_image_verified(sandbox, pushed, tmp_path):
    """`runner push --full`: every layer travels gzip-compressed to every node, even one that has
    the image, and each node ends with the host's image id."""
    tag = f"runner-test-full:{os.getpid()}"
    # Layers of zeros compress ~1000x, random ones not at all: the byte count shows gzip ran.
    want = build_scratch_image(tag, [bytes(8 << 20), os.urandom(2 << 20), b"text\n" * 200_000])
    job = write_job(tmp_path, image=tag)
    env = {"RUNNER_IMAGE_CACHE": str(tmp_path / "cache")}
    first = runner("push", "-i", str(sandbox), "--job", str(job), env=env)  # node-2 then has it already
    assert first.returncode == 0, first.stderr
    proc = runner("push", "-i", str(sandbox), "--job", str(job), "--full", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = parse_push(proc.stdout)
    assert set(rows) == set(NODES)
    for node, r in rows.items():
        assert r["action"] == "full" and r["sent"] == r["total"] == 3, r
        assert 11.0 < r["image_mb"] < 12.0, r               # 8 + 2 + 1 MB of layers (+ tar headers)
        assert 2.0 < r["mb"] < 0.5 * r["image_mb"], r       # gzip: the random 2 MB stay, the rest shrinks
        assert node_image_id(sandbox, node, tag) == want
    assert "partial load failed" not in proc.stderr  # --full goes straight to the full stream


class KillLoadOnFirstBytes:
    """Stands in for rich's Progress: once the first MB of the partial (layers) stream is written,
    it SIGKILLs the node's `docker load` process (found by the node's DOCKER_HOST), as if the node
    had run out of memory mid-stream. The full stream that follows is left alone."""

    def __init__(self, docker_host: str):
        self.docker_host = docker_host
        self.tasks: dict[int, str] = {}
        self.killed: list[int] = []
        self.bytes_before_kill = 0

    def add_task(self, desc: str, total: float) -> int:
        self.tasks[len(self.tasks)] = desc
        return len(self.tasks) - 1

    def remove_task(self, task: int) -> None:
        pass

    def update(self, task: int, advance: int) -> None:
        if self.killed or "layers" not in self.tasks[task]:
            return
        self.bytes_before_kill += advance
        end = time.time() + 20
        while time.time() < end:
            for p in psutil.process_iter(["cmdline"]):
                try:
                    if p.info["cmdline"][:2] == ["docker", "load"] and \
                            p.environ().get("DOCKER_HOST") == self.docker_host:
                        p.kill()
                        p.wait(10)
                        self.killed.append(p.pid)
                        return
                except (psutil.Error, TypeError):
                    continue
            time.sleep(0.05)
        raise AssertionError("the node's docker load process never showed up")


@pytest.mark.timeout(300)  # before the fix this hung forever in tar.wait()
def test_push_load_dies_midstream_falls_back_to_full(sandbox, pushed, tmp_path, caplog):
    tag = f"runner-test-midstream:{os.getpid()}"
    want = build_scratch_image(tag, [os.urandom(1 << 20), os.urandom(48 << 20)])
    exp = export(tag, cache=tmp_path / "cache")
    killer = KillLoadOnFirstBytes(node_env(sandbox, "node-1", "DOCKER_HOST"))
    with connect(sandbox, "node-1") as remote:
        t0 = time.time()
        res = push_mod.push_one(remote, exp, progress=killer)
        took = time.time() - t0
    assert len(killer.killed) == 1 and killer.bytes_before_kill <= 2 << 20
    assert res.action == "full" and res.layers_sent == res.layers_total == 2
    assert node_image_id(sandbox, "node-1", tag) == want == res.image_id
    warn = [r.getMessage() for r in caplog.records if "partial load failed" in r.getMessage()]
    assert len(warn) == 1 and "node node-1: docker load failed" in warn[0] and "mid-stream" in warn[0], warn
    assert own_children() == []  # no tar/gzip/ssh left blocked on a pipe
    assert took < 120


def test_push_invalid_partial_archive_falls_back(sandbox, pushed, tmp_path, monkeypatch):
    """The layer-chain computation claims node-2 holds the image's first layer, which it does not:
    the partial archive then lacks a layer docker load needs, load fails on the node, and the push
    still succeeds through the full compressed stream."""
    tag = f"runner-test-partial:{os.getpid()}"
    want = build_scratch_image(tag, [os.urandom(1 << 20), os.urandom(1 << 20)])
    exp = export(tag, cache=tmp_path / "cache")
    monkeypatch.setattr(push_mod, "node_chains", lambda remote: {exp.chains[0]})
    errors = []
    real = push_mod.stream_to_load

    def recording(*a, **kw):
        try:
            return real(*a, **kw)
        except Exception as exc:
            errors.append(str(exc))
            raise

    monkeypatch.setattr(push_mod, "stream_to_load", recording)
    with connect(sandbox, "node-2") as remote:
        res = push_mod.push_one(remote, exp)
    assert len(errors) == 1 and errors[0].startswith("node node-2: docker load failed (exit 1)"), errors
    assert res.action == "full" and res.layers_sent == 2
    assert node_image_id(sandbox, "node-2", tag) == want
    assert own_children() == []


def test_push_stalled_node_is_stopped(sandbox, pushed, tmp_path):
    """A node whose `docker load` stops reading (SIGSTOP) must not hang the push: the stall watchdog
    kills the stream and the error names the node."""
    tag = f"runner-test-stall:{os.getpid()}"
    build_scratch_image(tag, [os.urandom(32 << 20)])
    exp = export(tag, cache=tmp_path / "cache")
    host = node_env(sandbox, "node-0", "DOCKER_HOST")
    stopped: list[psutil.Process] = []

    def stop_load():
        end = time.time() + 30
        while time.time() < end and not stopped:
            for p in psutil.process_iter(["cmdline"]):
                try:
                    if p.info["cmdline"][:2] == ["docker", "load"] and p.environ().get("DOCKER_HOST") == host:
                        p.suspend()
                        stopped.append(p)
                        return
                except (psutil.Error, TypeError):
                    continue
            time.sleep(0.02)

    t = threading.Thread(target=stop_load)
    t.start()
    with connect(sandbox, "node-0") as remote:
        t0 = time.time()
        with pytest.raises(push_mod.UserError) as exc:
            push_mod.stream_to_load(remote, exp, push_mod.partial_members(exp, [0]), stall_s=3)
        took = time.time() - t0
    t.join()
    for p in stopped:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert stopped, "docker load never seen"
    assert str(exc.value) == "node node-0: image stream stalled (nothing moved for 3s); stopped it"
    assert took < 20 and own_children() == []


def test_export_cache_with_a_missing_layer_is_redone(host_docker, tmp_path):
    tag = f"runner-test-cache:{os.getpid()}"
    want = build_scratch_image(tag, [os.urandom(1 << 16), os.urandom(1 << 16)])
    exp = export(tag, cache=tmp_path)
    gone = exp.dir / exp.layers[1]
    data = gone.read_bytes()
    gone.unlink()
    again = export(tag, cache=tmp_path)
    assert again.image_id == want and (again.dir / again.layers[1]).read_bytes() == data
