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
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from runner.core.errors import UserError
from runner.delivery import push as push_mod
from runner.delivery.images import export
from runner.inventory import load_inventory
from runner.transport.ssh import Remote
from tests import IMAGE
from tests.support.runner_helpers import (
    REPO,
    build_scratch_image,
    node_env,
    node_workdir,
    parse_push,
    process_name,
    remotes,
    runner,
    sshd_procs,
    wait_for,
    write_job,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")


CREATED: list[str] = []  # host images made here (ids), removed when the module is done


def scratch(tag: str, layers: list[bytes]) -> str:
    image_id = build_scratch_image(tag, layers)
    CREATED.append(image_id)
    return image_id


@pytest.fixture(scope="module", autouse=True)
def _remove_host_images():
    """The images built here must not pile up on the shared host engine (the nodes' engines go
    with the sandbox)."""
    yield
    import docker
    from tests.conftest import HOST_DOCKER

    client = docker.DockerClient(base_url=HOST_DOCKER, version="auto")
    for image_id in reversed(CREATED):
        try:
            client.images.remove(image_id, force=True)
        except docker.errors.APIError:
            pass  # already gone


def node_image_id(inventory: Path, node: str, tag: str) -> str | None:
    with remotes(inventory)[node] as r:
        res = r.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag])
    return res.out.strip() if res.rc == 0 else None


def connect(inventory: Path, node: str) -> Remote:
    return Remote(load_inventory(inventory, with_job=False).node(node)).connect()


def own_children() -> list[str]:
    names = [process_name(p) for p in psutil.Process().children(recursive=True)]
    return [n for n in names if n in ("tar", "gzip", "ssh")]


# ---------------------------------------------------------------------------- push

def test_push_full_compressed_whole_image_verified(sandbox, pushed, tmp_path):
    """`runner push --full`: every layer travels gzip-compressed to every node, even one that has
    the image, and each node ends with the host's image id."""
    tag = f"runner-test-full:{os.getpid()}"
    # Layers of zeros compress ~1000x, random ones not at all: the byte count shows gzip ran.
    want = scratch(tag, [bytes(8 << 20), os.urandom(2 << 20), b"text\n" * 200_000])
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
        p = wait_for(lambda: node_load(self.docker_host), 120, interval=0.05)
        p.kill()
        p.wait(10)
        self.killed.append(p.pid)


def node_load(docker_host: str) -> psutil.Process | None:
    """The `docker load` running for the node whose engine is at docker_host, if one is."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.info["cmdline"][:2] == ["docker", "load"] and p.environ().get("DOCKER_HOST") == docker_host:
                return p
        except (psutil.Error, TypeError):
            continue
    return None


@pytest.mark.timeout(300)  # before the fix this hung forever in tar.wait()
def test_push_load_dies_midstream_falls_back_to_full(sandbox, pushed, tmp_path, caplog):
    tag = f"runner-test-midstream:{os.getpid()}"
    want = scratch(tag, [os.urandom(1 << 20), os.urandom(48 << 20)])
    exp = export(tag, cache=tmp_path / "cache")
    killer = KillLoadOnFirstBytes(node_env(sandbox, "node-1", "DOCKER_HOST"))
    with connect(sandbox, "node-1") as remote:
        res = push_mod.push_one(remote, exp, progress=killer)  # returns at all: before the fix it hung
    assert len(killer.killed) == 1 and killer.bytes_before_kill <= 2 << 20
    assert res.action == "full" and res.layers_sent == res.layers_total == 2
    assert node_image_id(sandbox, "node-1", tag) == want == res.image_id
    warn = [r.getMessage() for r in caplog.records if "partial load failed" in r.getMessage()]
    assert len(warn) == 1 and "node node-1: docker load failed" in warn[0] and "mid-stream" in warn[0], warn
    assert own_children() == []  # no tar/gzip/ssh left blocked on a pipe


def test_push_invalid_partial_archive_falls_back(sandbox, pushed, tmp_path, monkeypatch):
    """The layer-chain computation claims node-2 holds the image's first layer, which it does not:
    the partial archive then lacks a layer docker load needs, load fails on the node, and the push
    still succeeds through the full compressed stream."""
    tag = f"runner-test-partial:{os.getpid()}"
    want = scratch(tag, [os.urandom(1 << 20), os.urandom(1 << 20)])
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


def suspend_first_load(docker_host: str, stopped: list, within: float = 120) -> threading.Thread:
    """A thread that SIGSTOPs the first `docker load` run for that node (by its DOCKER_HOST) and
    appends it to `stopped`: a node whose load stops reading."""
    def run():
        p = wait_for(lambda: node_load(docker_host), within, interval=0.02)
        p.suspend()
        stopped.append(p)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_push_stalled_node_is_stopped(sandbox, pushed, tmp_path):
    """A node whose `docker load` stops reading (SIGSTOP) must not hang the push: the stall watchdog
    kills the stream and the error names the node."""
    tag = f"runner-test-stall:{os.getpid()}"
    scratch(tag, [os.urandom(32 << 20)])
    exp = export(tag, cache=tmp_path / "cache")
    stopped: list[psutil.Process] = []
    t = suspend_first_load(node_env(sandbox, "node-0", "DOCKER_HOST"), stopped)
    with connect(sandbox, "node-0") as remote:
        with pytest.raises(push_mod.UserError) as exc:  # raises at all: the stall was noticed, not waited out
            push_mod.stream_to_load(remote, exp, [0], stall_s=3)
    t.join()
    for p in stopped:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert stopped, "docker load never seen"
    assert str(exc.value) == "node node-0: image stream stalled (nothing moved for 3s); stopped it"
    assert own_children() == []


def test_export_cache_with_a_missing_layer_is_redone(host_docker, tmp_path):
    tag = f"runner-test-cache:{os.getpid()}"
    want = scratch(tag, [os.urandom(1 << 16), os.urandom(1 << 16)])
    exp = export(tag, cache=tmp_path)
    gone = exp.dir / exp.layers[1]
    data = gone.read_bytes()
    gone.unlink()
    again = export(tag, cache=tmp_path)
    assert again.image_id == want and (again.dir / again.layers[1]).read_bytes() == data


# ---------------------------------------------------------------------------- collect

# Each rank writes what a Pi-guide style trainer leaves behind when nobody merges: its own seed
# timeline piece (1F1B over 3 stages, 4 microbatches, 2 ms per action); the last stage writes
# metrics.jsonl; node-1 also writes 700 files with 230-character names (one command line naming
# them all would exceed the kernel's 128 KiB limit per argument).
WRITER = r"""
import json, os, time
out, rank = os.environ['OUTPUT_DIR'], int(os.environ['RANK'])
t0, ms = 1_000_000_000, 2_000_000
recs = []
for kind, offset in (('F', 0), ('B', 8)):
    for mb in range(4):
        start = t0 + (rank + mb + (offset + 2 * (2 - rank) if kind == 'B' else 0)) * ms
        recs.append({'rank': rank, 'action': kind, 'stage_idx': rank, 'mb_idx': mb, 'start_ns': start,
                     'end_ns': start + ms, 'net_series': [[start + ms // 2, 1.5, 0.5]]})
json.dump(recs, open(f'{out}/timeline_batch1_rank{rank}.json', 'w'), indent=2)
if rank == 2:
    with open(f'{out}/metrics.jsonl', 'w') as f:
        for step in range(1, 6):
            f.write(json.dumps({'step': step, 'loss': 6.0 - 0.5 * step, 'tokens_per_s': 1000.0 + step}) + '\n')
if rank == 1:
    os.makedirs(f'{out}/many', exist_ok=True)
    for i in range(700):
        open(f'{out}/many/f{i:04d}' + 'x' * 225, 'w').write(f'file {i}\n' * (i % 7))
open(f'{out}/grow-{os.environ["NODE_NAME"]}.log', 'w').write('start\n')
print('wrote', rank, flush=True)
"""


def runner_no_torch(*args: str) -> subprocess.CompletedProcess:
    """The runner CLI in a process where `import torch` fails, as on a host without torch."""
    code = ("import sys; sys.modules['torch'] = None; from runner.cli.main import main; "
            f"sys.exit(main({list(args)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)


def one_error(stderr: str) -> str:
    """The CLI's one error line (its text after 'runner: error: '); nothing else but warnings.
    (paramiko's transport thread may print 'Exception in thread ' at interpreter exit, a race
    in runner/transport/ssh.py's close, reported; it is cut off here so it cannot hide a second error.)"""
    lines = [ln.split("runner: error: ", 1)[1] for ln in stderr.splitlines() if "runner: error: " in ln]
    assert len(lines) == 1, stderr
    return lines[0]


def node_files(sandbox: Path, node: str, run_id: str) -> dict[str, bytes]:
    src = node_workdir(sandbox, node) / "runs" / run_id
    return {str(p.relative_to(src)): p.read_bytes() for p in src.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def pieces_run(sandbox, pushed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pieces")
    job = write_job(tmp, extra={"command": ["python", "-c", WRITER]})
    proc = runner("up", "-i", str(sandbox), "--job", str(job))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return re.search(r"run (\S+) started", proc.stdout)[1]


def test_collect_verified_many_files_merge_and_plots(sandbox, pieces_run, tmp_path):
    run_id, dest = pieces_run, tmp_path / "art"
    t0 = time.time()
    first = runner_no_torch("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet")
    took = time.time() - t0
    assert first.returncode == 0, first.stderr
    run_dir = dest / run_id
    for node in NODES:
        want = node_files(sandbox, node, run_id)
        got = {str(p.relative_to(run_dir / node)): p.read_bytes() for p in (run_dir / node).rglob("*")
               if p.is_file() and p.name != ".collect-manifest.json" and not p.name.endswith(".png")}
        assert got == want  # every file, byte for byte
        assert re.search(rf"{node}\s+{len(want)} files: {len(want)} copied \(", first.stdout), first.stdout
    assert sum(k.startswith("many/f") for k in node_files(sandbox, "node-1", run_id)) == 700
    assert not list(dest.rglob("*.collect-part"))
    # Merged on the host: the three ranks' pieces, rank after rank, as the trainer's seed format.
    merged = json.loads((run_dir / "timeline_batch1_all.json").read_text())
    pieces = [json.loads((run_dir / n / f"timeline_batch1_rank{r}.json").read_text()) for r, n in enumerate(NODES)]
    assert merged == [rec for p in pieces for rec in sorted(p, key=lambda r: r["start_ns"])]
    assert [r["rank"] for r in merged] == [0] * 8 + [1] * 8 + [2] * 8
    # Its Chrome trace matches what the trainer's own converter makes of the merged seed file.
    from trainer.profiling.trace import load_trace

    ours = json.loads((run_dir / "timeline_batch1_all.trace.json").read_text())
    theirs = load_trace(run_dir / "timeline_batch1_all.json")
    slices = lambda t: sorted((e["pid"], e["name"], e["ts"], e["dur"], e["args"]["stage"], e["args"]["microbatch"])  # noqa: E731
                              for e in t["traceEvents"] if e["ph"] == "X")
    assert slices(ours) == slices(theirs) and len(slices(ours)) == 24
    names = {e["pid"]: e["args"]["name"] for e in ours["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "node-0/rank0/stage0", 1: "node-1/rank1/stage1", 2: "node-2/rank2/stage2"}
    assert ours["otherData"]["sources"] == [f"{n}/timeline_batch1_rank{r}.json" for r, n in enumerate(NODES)]
    # Plots: the merged Gantt and node-2's loss/tokens-per-s, real PNGs, listed in the summary.
    gantt, metrics = run_dir / "timeline_batch1_gantt.png", run_dir / "node-2" / "metrics.png"
    for png in (gantt, metrics):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"plot: {png}" in first.stdout
    assert sorted(p.name for p in run_dir.rglob("*.png")) == ["metrics.png", "timeline_batch1_gantt.png"]
    assert f"timeline: {run_dir / 'timeline_batch1_all.json'}  (merged here" in first.stdout
    assert "final loss 3.5000 at step 5, tokens/s mean 1003.0" in first.stdout
    # Second collect: nothing moves, nothing is re-rendered.
    stamps = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".collect-manifest.json"}
    second = runner_no_torch("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet")
    assert second.returncode == 0, second.stderr
    for node in NODES:
        n = len(node_files(sandbox, node, run_id))
        assert re.search(rf"{node}\s+{n} files: 0 copied \(0\.00 MB, size and sha256 verified\), {n} unchanged",
                         second.stdout), second.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    print(f"\n[collect] first {took:.1f}s for {sum(len(node_files(sandbox, n, run_id)) for n in NODES)} files")


def test_collect_file_changing_during_transfer_fails_and_keeps_good_copy(sandbox, pieces_run, tmp_path):
    run_id, dest = pieces_run, tmp_path / "art"
    assert runner("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet").returncode == 0
    good = (dest / run_id / "node-1" / "grow-node-1.log").read_bytes()
    # The 700 long names are fetched again in the same collect: one sha256sum command line naming
    # them all would fail (E2BIG), which the old code took as "nothing to compare" and let the
    # changing file through as verified.
    shutil.rmtree(dest / run_id / "node-1" / "many")
    path = node_workdir(sandbox, "node-1") / "runs" / run_id / "grow-node-1.log"
    stop = threading.Event()

    def append():  # a rank still logging: the file grows between hashing and transfer
        with open(path, "a") as f:
            while not stop.is_set():
                f.write("more\n" * 100)
                f.flush()
                time.sleep(0.001)

    t = threading.Thread(target=append)
    t.start()
    try:
        proc = runner("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet")
    finally:
        stop.set()
        t.join()
    assert proc.returncode == 3  # partial: rerun collect
    err = one_error(proc.stderr)
    assert err.startswith(f"collect {run_id}: node-1: grow-node-1.log: ") and "rerun collect" in err, err
    assert (dest / run_id / "node-1" / "grow-node-1.log").read_bytes() == good  # not replaced by a bad copy
    many = {k: v for k, v in node_files(sandbox, "node-1", run_id).items() if k.startswith("many/")}
    assert {f"many/{p.name}": p.read_bytes() for p in (dest / run_id / "node-1" / "many").iterdir()} == many
    assert not list(dest.rglob("*.collect-part"))
    # Once it stops changing, a collect picks it up verified.
    again = runner("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet")
    assert again.returncode == 0, again.stderr
    assert (dest / run_id / "node-1" / "grow-node-1.log").read_bytes() == path.read_bytes() != good


def test_remote_sha256_checks_the_exit_code(sandbox, pieces_run):
    """A name sha256sum cannot read is reported as such (not silently accepted unverified), the
    hashing command failing as a whole is one error for the node; names with spaces, backslashes
    and newlines come back right."""
    rd = node_workdir(sandbox, "node-0") / "runs" / pieces_run
    odd = ["a b.txt", "back\\slash", "new\nline"]
    for name in odd:
        (rd / name).write_bytes(name.encode())
    from runner.delivery.collect_files import remote_sha256

    try:
        with connect(sandbox, "node-0") as remote:
            sums, failed = remote_sha256(remote, str(rd), [*odd, "missing.bin"])
            with pytest.raises(push_mod.UserError) as exc:  # the tool itself failing: one error for the node
                remote_sha256(remote, "/nonexistent-run-dir", ["a"])
    finally:
        for name in odd:
            (rd / name).unlink()
    assert sums == {n: hashlib.sha256(n.encode()).hexdigest() for n in odd}
    assert list(failed) == ["missing.bin"] and "No such file" in failed["missing.bin"]
    assert re.fullmatch(r"node node-0: hashing files in /nonexistent-run-dir failed \(exit 2\): .*can't cd.*",
                        str(exc.value)), exc.value


def test_collect_file_vanished_after_listing_is_skipped_not_failed(sandbox, pieces_run, tmp_path):
    """Listed, then deleted before hashing (a rotated checkpoint): skipped and counted, no error;
    a listed file that cannot be hashed but still exists is an error naming it."""
    from runner.delivery.collect_files import NodeCollect, _collect_batch

    rd = node_workdir(sandbox, "node-2") / "runs" / pieces_run
    gone = rd / "ckpt-old.bin"
    gone.write_bytes(b"x" * 100)
    with connect(sandbox, "node-2") as remote:
        attrs = remote.stat(str(gone))
        gone.unlink()
        res, manifest = NodeCollect("node-2"), {"ckpt-old.bin": {"size": 100}}
        _collect_batch(remote, str(rd), tmp_path, [("ckpt-old.bin", attrs)], manifest, res, None, None)
        assert (res.vanished, res.copied, res.errors, manifest) == (1, 0, [], {})
        (rd / "unreadable").mkdir()  # exists, but sha256sum cannot hash a directory
        try:
            _collect_batch(remote, str(rd), tmp_path, [("unreadable", attrs)], manifest, res, None, None)
        finally:
            (rd / "unreadable").rmdir()
    assert len(res.errors) == 1 and res.errors[0].startswith("unreadable: cannot hash on the node: "), res.errors
    assert "Is a directory" in res.errors[0]


PP3 = """model: {preset: tiny-llama, num_hidden_layers: 3}
data: {source: synthetic, seq_len: 32}
train: {steps: 3, seed: 1, batch_size: 8, microbatch_num: 4}
parallel: {pp: 3, pp_schedule: 1f1b}
profile: {batch: "2"}
"""


def test_collect_real_trainer_run_plots(sandbox, pushed, tmp_path):
    """The real trainer (3-stage 1F1B, one stage per node) merges its timeline itself on rank 0:
    collect merges nothing, renders the Gantt next to it and the loss plot next to metrics.jsonl,
    on a host without torch."""
    cfg = tmp_path / "pp3.yaml"
    cfg.write_text(PP3)
    job = tmp_path / "job.yaml"
    job.write_text(f"job:\n  image: {IMAGE}\n  config: {cfg}\n  env: {{OMP_NUM_THREADS: '1'}}\n"
                   "  master_port: auto\n  grace_period: 10\n")
    proc = runner("up", "-i", str(sandbox), "--job", str(job))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    dest = tmp_path / "art"
    col = runner_no_torch("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet")
    assert col.returncode == 0, col.stderr
    run_dir = dest / run_id
    trace = json.loads((run_dir / "node-0" / "timeline_batch2_all.json").read_text())
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("forward")]) == 12
    assert not list(run_dir.glob("timeline*"))  # the trainer merged: nothing merged on the host
    pngs = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.png"))
    assert pngs == ["node-0/timeline_batch2_gantt.png", "node-2/metrics.png"]
    for p in pngs:
        assert (run_dir / p).read_bytes()[:4] == b"\x89PNG" and f"plot: {run_dir / p}" in col.stdout
    losses = [json.loads(x)["loss"] for x in (run_dir / "node-2" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and f"final loss {losses[-1]:.4f} at step 3" in col.stdout
    assert f"timeline: {run_dir / 'node-0' / 'timeline_batch2_all.json'}" in col.stdout


# ---------------------------------------------------------------------------- check

def test_check_image_present_stale_absent_and_master_port(sandbox, pushed, tmp_path):
    import socket

    tag = f"runner-test-stale:{os.getpid()}"
    a = scratch(tag, [os.urandom(1 << 16)])
    job = write_job(tmp_path, image=tag)
    env = {"RUNNER_IMAGE_CACHE": str(tmp_path / "cache")}
    assert runner("push", "-i", str(sandbox), "--job", str(job), env=env).returncode == 0

    def check(*extra: str) -> subprocess.CompletedProcess:
        return runner("check", "-i", str(sandbox), "--job", str(job), *extra)

    rows = json.loads(check("--json").stdout)
    assert [(r["image_state"], r["image_id"], r["host_image_id"]) for r in rows] == [("present", a, a)] * 3
    assert [(r["image_lacking"], r["engine_free"]) for r in rows] == [(None, None)] * 3  # nothing to push
    # The host's tag now names another image: every node's copy is stale (push would replace it).
    b = scratch(tag, [os.urandom(1 << 16)])
    with remotes(sandbox)["node-1"] as r:
        assert r.run(["docker", "rmi", tag]).rc == 0
    rows = json.loads(check("--json").stdout)
    assert [(r["node"], r["image_state"], r["image_id"], r["host_image_id"], r["image_present"]) for r in rows] == [
        ("node-0", "stale", a, b, False), ("node-1", "absent", None, b, False), ("node-2", "stale", a, b, False)]
    # What push would load there (the new 64 KiB layer, from the host engine's history), beside the
    # room in each node engine's data root.
    assert [r["image_lacking"] for r in rows] == [1 << 16] * 3
    assert all(r["engine_free"] > 1 << 30 and r["problems"] == [] for r in rows), rows
    # Master port: auto shows where up looks and what is taken there; a fixed port in use fails.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", 29500))
            s.listen()
        except OSError:
            pass  # someone else's master listens there: it is in use all the same
        rows = json.loads(check("--json").stdout)
        assert rows[0]["master_port"] == "auto"
        assert re.fullmatch(r"29500-29899: \d+ in use \(29500[,)].*, up skips them", rows[0]["master_port_detail"]), rows[0]
        assert [r["master_port"] for r in rows[1:]] == ["-", "-"]
        table = check()
        assert table.returncode == 0, table.stderr
        cells = lambda node: next(ln for ln in table.stdout.splitlines() if f"│ {node} " in ln)  # noqa: E731
        assert " stale" in cells("node-0") and " absent" in cells("node-1")  # (cells wrap: first line)
        assert table.stdout.count("lacks 64.0 KiB") == 3, table.stdout
        fixed = write_job(tmp_path, "fixed.yaml", image=tag, extra={"master_port": 29500})
        proc = runner("check", "-i", str(sandbox), "--job", str(fixed))
    assert proc.returncode == 1
    assert one_error(proc.stderr) == "check failed on node-0: master port 29500 is in use"
    # Pushed again: present everywhere.
    assert runner("push", "-i", str(sandbox), "--job", str(job), env=env).returncode == 0
    rows = json.loads(check("--json").stdout)
    assert [(r["image_state"], r["image_id"]) for r in rows] == [("present", b)] * 3


# ---------------------------------------------------------------------------- build

def host_image(tag: str):
    import docker
    from tests.conftest import HOST_DOCKER

    try:
        return docker.DockerClient(base_url=HOST_DOCKER, version="auto").images.get(tag)
    except docker.errors.ImageNotFound:
        return None


def test_push_builds_from_job_build(sandbox, pushed, tmp_path):
    """job.build: built on the host when the tag is missing there (build args passed, host
    network), taken as it is afterwards, rebuilt with --build (then only the changed layer moves);
    a failing build and a bad build section are one line each."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile.test").write_text("FROM scratch\nARG MARK=none\nLABEL mark=$MARK\nCOPY base /base\n"
                                         "COPY payload /payload\n")
    (ctx / "base").write_bytes(os.urandom(1 << 20))
    (ctx / "payload").write_text("one\n")
    tag, mark = f"runner-test-build:{os.getpid()}", os.urandom(4).hex()
    job = write_job(tmp_path, image=tag, extra={"build": {"context": str(ctx), "dockerfile": "Dockerfile.test",
                                                          "args": {"MARK": mark}}})
    env = {"RUNNER_IMAGE_CACHE": str(tmp_path / "cache")}
    assert host_image(tag) is None
    first = runner("push", "-i", str(sandbox), "--job", str(job), env=env)
    assert first.returncode == 0, first.stderr
    img = host_image(tag)
    CREATED.append(img.id)
    assert img.labels["mark"] == mark and f"building {tag} from {ctx}" in first.stderr
    for node, r in parse_push(first.stdout).items():
        assert r["action"] == "relay" and r["sent"] == r["total"] == 2
        assert node_image_id(sandbox, node, tag) == img.id
    # Present on the host: no build, and every node is skipped.
    again = runner("push", "-i", str(sandbox), "--job", str(job), env=env)
    assert again.returncode == 0 and "building" not in again.stderr, again.stderr
    assert {r["action"] for r in parse_push(again.stdout).values()} == {"skipped"}
    # --build rebuilds: a changed payload is one new layer on every node.
    (ctx / "payload").write_text("two\n")
    rebuilt = runner("push", "-i", str(sandbox), "--job", str(job), "--build", env=env)
    assert rebuilt.returncode == 0, rebuilt.stderr
    new = host_image(tag)
    CREATED.append(new.id)
    assert new.id != img.id and f"building {tag}" in rebuilt.stderr
    for node, r in parse_push(rebuilt.stdout).items():
        assert r["action"] == "relay" and r["sent"] == 1 and r["mb"] < 0.01, r
        assert node_image_id(sandbox, node, tag) == new.id
    # A failing build: one line naming the tag and the Dockerfile, nothing pushed.
    (ctx / "Dockerfile.bad").write_text("FROM scratch\nCOPY missing-file /x\n")
    bad = write_job(tmp_path, "bad.yaml", image=tag + "-bad", extra={"build": {"context": str(ctx),
                                                                               "dockerfile": "Dockerfile.bad"}})
    proc = runner("push", "-i", str(sandbox), "--job", str(bad), env=env)
    assert proc.returncode == 2
    err = one_error(proc.stderr)
    assert err.startswith(f"build of {tag}-bad ({ctx}/Dockerfile.bad) failed: ") and "missing-file" in err, err
    # A build section naming a missing directory: file, line and field.
    wrong = write_job(tmp_path, "wrong.yaml", image=tag, extra={"build": {"amd64": {"context": str(ctx / "nope")}}})
    proc = runner("push", "-i", str(sandbox), "--job", str(wrong))
    assert proc.returncode == 2
    assert re.fullmatch(rf"{wrong}:\d+: job\.build\.amd64\.context: directory not found: {ctx / 'nope'}",
                        one_error(proc.stderr)), proc.stderr
    # --build without a build section says so.
    plain = write_job(tmp_path, "plain.yaml", image=tag)
    proc = runner("push", "-i", str(sandbox), "--job", str(plain), "--build")
    assert proc.returncode == 2 and "push --build: the job has no build section" in one_error(proc.stderr)


def test_push_to_current_nodes_exports_nothing(sandbox, pushed, tmp_path):
    # `up` pushes on every launch: when every node runs the host's image, no `docker save` (a
    # full export) may happen, even with nothing in the export cache.
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = runner("push", "-i", str(sandbox), "--job", str(pushed["job"]), env={"RUNNER_IMAGE_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    res = parse_push(proc.stdout)
    assert set(res) == set(NODES) and all(r["action"] == "skipped" and r["mb"] == 0.0 for r in res.values()), res
    assert list(cache.iterdir()) == []


def test_relay_with_a_stalled_node_stops_it_and_leaves_nothing_running(sandbox, pushed, tmp_path):
    """node-1's `docker load` stops reading (SIGSTOP) mid-relay: the chain backs up behind it (each
    node forwards only as fast as the next takes). After stall_s node-1 is stopped with the reason;
    node-2 (whose stream ends early) loads nothing and counts as cut off (push relays to such
    nodes again, or streams to them directly). Nothing the relay started runs on afterwards: no
    process of this one's (tar, gzip, ssh, ...), and on every node no process of the SSH sessions
    it opened (agent, `docker load`, dial-stdio, the sessions themselves)."""
    from runner.delivery.relay import relay_chain

    def sessions(node: str) -> set[int]:  # every process below the node's sshd listener
        return {p.pid for p in sshd_procs(sandbox, node)[0].children(recursive=True)}

    tag = f"runner-test-relay-stall:{os.getpid()}"
    scratch(tag, [os.urandom(48 << 20)])
    exp = export(tag, cache=tmp_path / "cache")
    hosts = {n: node_env(sandbox, n, "DOCKER_HOST") for n in NODES}
    before = {n: sessions(n) for n in NODES}
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    stopped: list[psutil.Process] = []
    t = suspend_first_load(hosts["node-1"], stopped)
    chain = [connect(sandbox, n) for n in NODES]
    try:
        res = relay_chain(chain, exp, [[0]] * len(chain), stall_s=3)
    finally:
        t.join()
        for r in chain:
            r.close()
    assert stopped, ("docker load never seen", res.hops)
    # node-0 backs up too (whether it is stopped as stalled before node-1's end frees it is a race);
    # node-1 is the stalled one; node-2 never gets the whole archive.
    n0, n1, n2 = res.hops
    assert n0.loaded or n0.error == "relay stalled (nothing received for 3s); stopped it", n0
    assert not n1.loaded and n1.error == "relay stalled (nothing received for 3s); stopped it", n1
    assert not n2.loaded and n2.error and n2.cut_off, n2

    def left() -> dict[str, list]:
        """What still runs of the relay: here, in each node's sessions, and any node's docker load."""
        here = sorted(p.pid for p in psutil.Process().children(recursive=True) if p.pid not in mine)
        return {"here": here, **{n: sorted(sessions(n) - before[n]) for n in NODES},
                "loads": [n for n in NODES if node_load(hosts[n])]}
    try:
        wait_for(lambda: not any(left().values()), 60)  # the stopped ends reach the nodes' sshd
    except AssertionError:
        raise AssertionError(f"still running after the relay: {left()}") from None
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in stopped)
    for h in res.hops:  # the image where a load finished, nothing half-loaded elsewhere
        assert node_image_id(sandbox, h.node, tag) == (exp.image_id if h.loaded else None), h


def test_push_of_a_second_tag_of_a_cached_image_gives_the_nodes_that_tag(sandbox, pushed, tmp_path):
    """The export cache is keyed by image id, and one id can carry many tags (a rebuild with cached
    layers, `docker tag`, a new pytest session's tag). A push of tag B after tag A of the same id was
    exported must leave B on the nodes, not A again (CI failed so: the cache held the trainer image
    under an earlier session's tag)."""
    import docker
    from tests.conftest import HOST_DOCKER

    a, b = f"runner-test-tag-a:{os.getpid()}", f"runner-test-tag-b:{os.getpid()}"
    want = scratch(a, [os.urandom(64 << 10)])
    client = docker.DockerClient(base_url=HOST_DOCKER, version="auto")
    client.images.get(want).tag(b)
    env = {"RUNNER_IMAGE_CACHE": str(tmp_path / "cache")}
    for tag in (a, b):
        job = write_job(tmp_path, image=tag)
        proc = runner("push", "-i", str(sandbox), "--job", str(job), env=env)
        assert proc.returncode == 0, proc.stderr
        for node in NODES:
            assert node_image_id(sandbox, node, tag) == want, (tag, node)
    assert len(list((tmp_path / "cache").glob("*/.complete"))) == 1  # one export served both tags


def test_push_of_a_tag_the_host_lacks_is_one_line(sandbox, pushed, tmp_path):
    job = write_job(tmp_path, image="runner-test-absent:404")
    proc = runner("push", "-i", str(sandbox), "--job", str(job))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert one_error(proc.stderr) == ("image runner-test-absent:404 is not on this host's engine; "
                                      "build it first (scripts/build-image.sh), say how in job.build, or fix job.image")
    for r in remotes(sandbox).values():  # nothing was sent: no node has the tag
        with r:
            assert r.run(["docker", "images", "-q", "runner-test-absent:404"]).out.strip() == ""


def test_relay_push_names_a_node_without_room_and_relays_the_others(sandbox, tmp_path, monkeypatch):
    """The relay path of push's room check (the direct path, on a real small disk:
    tests/docker/test_push_room.py). node-1's `df` answer is the one fake here: the sandbox engines' data
    roots share this machine's disk, and a running engine's root cannot be shrunk. node-1 is named
    with its figures and gets nothing; node-0 and node-2 form the chain and load the image."""
    from runner.delivery import disk_room
    from runner.delivery.push import push_to_nodes
    from runner.transport.cluster import Cluster

    tag = f"runner-test-relay-room:{os.getpid()}"
    want = scratch(tag, [os.urandom(4 << 20)])
    real = disk_room.engine_room

    def room(remote):
        return (1 << 20, 100 << 20) if remote.node.name == "node-1" else real(remote)  # 1 MiB free of 100

    monkeypatch.setattr(disk_room, "engine_room", room)
    inv = load_inventory(sandbox, job_path=str(write_job(tmp_path, image=tag)))
    assert inv.job.push == "relay"
    with Cluster(inv) as cl, pytest.raises(UserError) as err:
        push_to_nodes(cl, {}, quiet=True)
    assert re.fullmatch(rf"push failed: node-1: {re.escape(tag)} \(1 of 1 layers\) needs 8\.0 MiB while docker load "
                        r"unpacks it \(2 x 4\.0 MiB of layers\), and its engine's data root \(docker info's "
                        r"DockerRootDir\) has 1\.0 MiB free \(5\.0 MiB of it kept free\); nothing was sent: free space "
                        r"there \(docker image prune, docker system df\), then push again", str(err.value)), err.value
    assert {n: node_image_id(sandbox, n, tag) for n in NODES} == {"node-0": want, "node-1": None, "node-2": want}
