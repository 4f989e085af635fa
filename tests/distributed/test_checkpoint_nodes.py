"""Checkpoints of multi-node runs WITHOUT shared storage (Raspberry Pis: each node's OUTPUT_DIR is
its own disk), on one machine: two torchrun "nodes" (--nnodes 2 --node-rank K, one process each)
with different OUTPUT_DIRs.

- Each node's directory is finalized on its own: `step-N` renamed, its own `latest`, DCP's
  `.metadata` and rank 0's trainer_state.json present, no temporary directory left.
- A run that ends after step 3 (train.exit_interval), resumed before the nodes' files are
  synced: one line per rank naming a file it lacks and saying to run `runner up --resume`.
- After copying the union of both nodes' files into each (what `runner up --resume` does), the
  resumed run's losses equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support.trainer_run import free_port, losses, start_trainer

pytestmark = pytest.mark.multiproc

ARGS = ("--config", "configs/tiny.yaml", "--parallel.sharding", "ddp", "--train.steps", "6")
HINT = "run `runner up --resume`, which syncs checkpoints across nodes"


def run_nodes(outs: list[Path], *args: str, check: bool = True) -> list[subprocess.CompletedProcess]:
    """One torchrun per "node", each with its own OUTPUT_DIR, joined by a static rendezvous. The
    master's port is picked free, then bound by torchrun a moment later: another test's server can
    take it in between (CI's second run of 2026-11-29: the master failed and node 1 waited for its
    store for 600 s). A master that could not bind is started again on another port, and a node
    left running 120 s after another failed is stopped, so a failure is reported, not waited out."""
    for _ in range(3):
        done = _run_nodes_once(outs, args, free_port())
        if not any("EADDRINUSE" in d.stderr or "address already in use" in d.stderr for d in done):
            break
    if check:
        for k, d in enumerate(done):
            assert d.returncode == 0, f"node {k} exited {d.returncode}\n{d.stdout[-3000:]}\n{d.stderr[-5000:]}"
    return done


def _run_nodes_once(outs: list[Path], args: tuple[str, ...], port: int) -> list[subprocess.CompletedProcess]:
    procs = [start_trainer(out, *args, node=(len(outs), k, port), env={"GLOO_SOCKET_IFNAME": "lo"})
             for k, out in enumerate(outs)]
    streams = [p.communicate for p in procs]  # read in threads: a full pipe must not stall a node
    results: list = [None] * len(procs)

    def read(k: int) -> None:
        results[k] = streams[k]()

    threads = [threading.Thread(target=read, args=(k,), daemon=True) for k in range(len(procs))]
    for t in threads:
        t.start()
    end, failed_at = time.monotonic() + 600, None
    while any(t.is_alive() for t in threads) and time.monotonic() < end:
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 120:
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
    return [subprocess.CompletedProcess(p.args, p.returncode, *(results[k] or ("", "")))
            for k, p in enumerate(procs)]


def _assert_finalized(out: Path, name: str, rank: int) -> None:
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == name
    ck = ckpts / name
    for f in (".metadata", "trainer_state.json", "config.yaml", f"rank{rank}.pt", f"manifest.rank{rank}.json"):
        assert (ck / f).is_file(), ck / f
    assert list(ck.glob(f"__{rank}_*.distcp"))
    assert not list(ckpts.glob(".tmp-*")) and not list(ckpts.glob(".probe-*"))


def _sync(nodes: list[Path], name: str, skip: str | None = None, only: Path | None = None) -> None:
    """Copy into each node's checkpoint (or only that node's) the files only the others have
    (runner up --resume)."""
    dirs = [n / "checkpoints" / name for n in nodes]
    union = {f.name: f for d in dirs for f in d.iterdir()}
    for d in dirs if only is None else [only / "checkpoints" / name]:
        for fname, src in union.items():
            if not (d / fname).exists() and fname != skip:
                shutil.copy2(src, d / fname)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def test_per_node_checkpoints_resume_after_sync(tmp_path):
    # Uninterrupted, saving at steps 3 and 6 in the background (async): both nodes finalize
    # their own directories.
    straight = [tmp_path / "straight-node0", tmp_path / "straight-node1"]
    procs = run_nodes(straight, *ARGS, "--checkpoint.interval", "3", "--checkpoint.async_save", "true")
    assert "is not shared by all ranks" in (straight[0] / "logs" / "rank0.log").read_text()
    for rank, out in enumerate(straight):
        _assert_finalized(out, "step-6", rank)
        assert (out / "checkpoints" / "step-3" / ".metadata").is_file()
    # Each node holds only its own rank's shards and RNG file.
    assert not (straight[1] / "checkpoints" / "step-6" / "rank0.pt").exists()
    assert not (straight[0] / "checkpoints" / "step-6" / "rank1.pt").exists()
    expected = losses(straight[0])
    assert len(expected) == 6, procs[0].stdout[-2000:]

    # A separate run that ends after step 3 (same 6-step LR schedule), with a checkpoint; the
    # resumes below are the same command plus --resume, as the runner relaunches it.
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    args = (*ARGS, "--train.exit_interval", "3")
    run_nodes(nodes, *args)
    for rank, out in enumerate(nodes):
        _assert_finalized(out, "step-3", rank)
    assert losses(nodes[0]) == expected[:3]

    # Resumed before a whole sync: node 0 got nothing (it lacks rank 1's manifest), node 1 got all
    # but rank 0's shard. Each node names its own missing file in one line, in its own directory,
    # and says what to run; no hang, no traceback.
    _sync([nodes[1], nodes[0]], "step-3", skip="__0_0.distcp", only=nodes[1])
    procs = run_nodes(nodes, *args, "--resume", "latest", check=False)
    lacking = [nodes[0] / "checkpoints" / "step-3" / "manifest.rank1.json",
               nodes[1] / "checkpoints" / "step-3" / "__0_0.distcp"]
    for k, p in enumerate(procs):
        assert p.returncode != 0
        errs = _errors(p)
        assert len(errs) == 1 and errs[0].startswith(f"error: {lacking[k]}: missing") and HINT in errs[0], \
            p.stderr[-3000:]
        assert not [ln for ln in p.stderr.splitlines() if ln.startswith("[rank") and "Traceback" in ln]

    # The union everywhere: the resumed run continues bit for bit.
    _sync(nodes, "step-3")
    run_nodes(nodes, *args, "--resume", "latest")
    assert losses(nodes[0]) == expected
    for rank, out in enumerate(nodes):
        _assert_finalized(out, "step-6", rank)


def test_replicas_keep_a_lost_nodes_files_on_the_next_node(tmp_path):
    """checkpoint.replicas 1 on three "nodes" without shared storage, 6 steps, a checkpoint every 3:
    each node's step-3 holds its own rank's files and, byte for byte, the previous node's (round the
    ring), and not the next one's. node1's directory then deleted outright (a lost node): the union
    of node0's and node2's step-3 is the whole checkpoint, and a two-node run (dp 3 -> 2, the same
    global batch of 24: 8 -> 12 a rank) resumes from it and takes the three-node run's steps 4-6
    (1e-5: another reduction order)."""
    args = (*ARGS, "--checkpoint.interval", "3", "--checkpoint.replicas", "1")
    nodes = [tmp_path / f"node{k}" for k in range(3)]
    run_nodes(nodes, *args, "--train.batch_size", "8")
    expected = losses(nodes[0])
    assert len(expected) == 6
    ck = [n / "checkpoints" / "step-3" for n in nodes]
    for k in range(3):
        _assert_finalized(nodes[k], "step-6", k)
        prev, nxt = (k - 1) % 3, (k + 1) % 3
        theirs = sorted(p.name for p in ck[prev].iterdir() if p.name in (f"rank{prev}.pt", f"manifest.rank{prev}.json")
                        or p.name.startswith(f"__{prev}_"))
        assert len(theirs) >= 3
        for name in theirs:  # the previous node's own files, identical here
            assert (ck[k] / name).read_bytes() == (ck[prev] / name).read_bytes(), (k, name)
        assert not (ck[k] / f"rank{nxt}.pt").exists()  # one copy each
        assert not list(ck[k].glob(".replica-*"))
    assert "kept here (checkpoint.replicas 1)" in (nodes[1] / "logs" / "rank1.log").read_text()

    shutil.rmtree(nodes[1])
    survivors = [nodes[0], nodes[2]]
    _sync(survivors, "step-3")  # what `runner up --resume` does on the nodes left
    for n in survivors:  # resume from step 3, as if the run had stopped there
        (n / "checkpoints" / "latest").write_text("step-3\n")
    log = nodes[0] / "metrics.jsonl"  # rank 0's: the resumed run appends steps 4-6 again
    log.write_text("".join(ln + "\n" for ln in log.read_text().splitlines()[:3]))
    run_nodes(survivors, *ARGS, "--train.batch_size", "12", "--checkpoint.replicas", "1", "--resume", "latest")
    got = losses(survivors[0])
    assert len(got) == 6 and got[:3] == expected[:3]
    assert max(abs(a - b) for a, b in zip(got[3:], expected[3:], strict=True)) < 1e-5, (got, expected)
