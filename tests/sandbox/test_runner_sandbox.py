"""The runner against the sandbox cluster: real sshd + dockerd per node, real containers.

Order matters only for cost: the session fixture `pushed` (tests/conftest.py) brings the trainer
image to the empty nodes once, before any other test pushes there (that first push is itself
asserted on); every other test reuses it.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from runner.inventory import load_inventory
from tests import IMAGE
from tests.conftest import HOST_DOCKER
from tests.support.runner_helpers import (
    build_image,
    finish_run,
    node_workdir,
    parse_push,
    remotes,
    remove_host_image,
    run_containers,
    runner,
    start_attached,
    unique_tag,
    wait_for,
    write_job,
)
from tests.support.trainer_run import read_metrics, run_trainer

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]

def node_image_id(inventory: Path, node: str, tag: str) -> str | None:
    r = remotes(inventory)[node]
    with r:
        res = r.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag])
    return res.out.strip() if res.rc == 0 else None


def host_image_id(tag: str) -> str:
    import docker

    return docker.DockerClient(base_url=HOST_DOCKER, version="auto").images.get(tag).id


def build_derived(tag: str, content: bytes) -> str:
    """FROM the trainer image + one small file: a 'code-only change' image."""
    return build_image(tag, {"Dockerfile": f"FROM {IMAGE}\n".encode() + b"COPY marker.txt /opt/marker.txt\n",
                             "marker.txt": content})


def test_push_missing_layers_and_skip(sandbox, pushed, tmp_path):
    first = pushed["first"]
    want = host_image_id(IMAGE)
    assert set(first) == {"node-0", "node-1", "node-2"}
    # Three empty nodes: one relay chain, this host -> node-0 -> node-1 -> node-2, every layer.
    assert {n: r["source"] for n, r in first.items()} == {"node-0": "host", "node-1": "node-0", "node-2": "node-1"}
    for node, r in first.items():
        assert r["action"] == "relay" and r["sent"] == r["total"] > 1, r  # empty node: everything
        assert node_image_id(sandbox, node, IMAGE) == want
    # Present everywhere: skipped, nothing moved.
    again = runner("push", "-i", str(sandbox), "--job", str(pushed["job"]))
    assert again.returncode == 0, again.stderr
    for r in parse_push(again.stdout).values():
        assert r["action"] == "skipped" and r["mb"] == 0.0
    # A code-only change: only the one new layer travels.
    for i, content in enumerate((b"version 1\n" * 1000, b"version 2\n" * 1000)):
        tag = unique_tag(f"derived-{i}")
        want = build_derived(tag, content)
        try:
            job = write_job(tmp_path, f"d{i}.yaml", image=tag)
            proc = runner("push", "-i", str(sandbox), "--job", str(job))
        finally:
            remove_host_image(tag)
        assert proc.returncode == 0, proc.stderr
        res = parse_push(proc.stdout)
        assert set(res) == set(first)
        for node, r in res.items():
            assert r["action"] == "relay" and r["sent"] == 1 and r["total"] == first[node]["total"] + 1, r
            assert r["mb"] < 0.01 * r["image_mb"], r   # bytes moved << image size
            assert node_image_id(sandbox, node, tag) == want


def test_a_docker_api_connection_the_node_closed_is_replaced(sandbox, pushed):
    """The node's Docker API rides SSH channels running `docker system dial-stdio`, kept for reuse.
    One whose dial-stdio ended while idle (seen after a 5-minute push over a saturated link) must
    not fail the next call with "Socket is closed": it is replaced."""
    r = remotes(sandbox)["node-1"]
    with r:
        want = r.docker().images.get(IMAGE).id
        sock = r.run("echo $DOCKER_HOST").out.strip()
        killed = 0
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.info["cmdline"][:3] == ["docker", "system", "dial-stdio"] and p.environ().get("DOCKER_HOST") == sock:
                    p.kill()
                    killed += 1
            except (psutil.Error, TypeError):
                continue
        assert killed >= 1
        # The event: every channel kept in the pool has seen its dial-stdio end (EOF or exit status
        # has reached this side), so the next call would reuse a closed one were it not replaced.
        pools = r.docker().api._custom_adapter.pools
        kept = [c.sock for k in pools.keys() for c in pools[k].pool.queue if c is not None and c.sock is not None]
        assert kept, "no kept API connection"
        wait_for(lambda: all(ch.closed or ch.eof_received or ch.exit_status_ready() for ch in kept), 60, interval=0.02)
        assert r.docker().images.get(IMAGE).id == want


def _probe_docs(sandbox: Path, run_id: str) -> dict[str, dict]:
    docs = {}
    for node in ("node-0", "node-1", "node-2"):
        p = node_workdir(sandbox, node) / "runs" / run_id / f"probe-{node}.json"
        docs[node] = json.loads(p.read_text())
    return docs


@pytest.fixture(scope="session")
def finished_run(sandbox, pushed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    job = write_job(tmp, sleep=0.5)
    proc = runner("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(tmp / "logs"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    return {"proc": proc, "run_id": run_id, "tmp": tmp}


def test_ranks_rendezvous_at_the_masters_addr_not_its_ssh_host(sandbox, pushed, tmp_path):
    """node-0 reached over SSH at its sandbox address, its ranks at `addr: 127.0.0.1` (an address
    SSH never uses): every rank gets that MASTER_ADDR and torchrun's static rendezvous meets there."""
    import yaml

    doc = yaml.safe_load(Path(sandbox).read_text())
    assert doc["nodes"][0]["host"] != "127.0.0.1"
    doc["nodes"][0]["addr"] = "127.0.0.1"
    inv = tmp_path / "addr.yaml"
    inv.write_text(yaml.safe_dump(doc))
    proc = runner("up", "-i", str(inv), "--job", str(write_job(tmp_path)), "--logs-dir", str(tmp_path / "logs"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    assert "master listening on 127.0.0.1:" in proc.stderr + proc.stdout
    docs = _probe_docs(sandbox, run_id)
    assert {n: d["env"]["MASTER_ADDR"] for n, d in docs.items()} == dict.fromkeys(docs, "127.0.0.1")
    assert {n: (d["env"]["RANK"], d["env"]["WORLD_SIZE"]) for n, d in docs.items()} == {
        "node-0": ("0", "3"), "node-1": ("1", "3"), "node-2": ("2", "3")}


def test_up_three_nodes_env_order_prefixed_logs(sandbox, finished_run):
    proc, run_id = finished_run["proc"], finished_run["run_id"]
    inv = load_inventory(sandbox, with_job=False)
    docs = _probe_docs(sandbox, run_id)
    port = docs["node-0"]["env"]["MASTER_PORT"]
    assert port.isdigit() and 1024 <= int(port) <= 65535
    for rank, node in enumerate(("node-0", "node-1", "node-2")):
        assert docs[node]["env"] == {
            "RUN_ID": run_id, "NODE_NAME": node, "NODE_RANK": str(rank), "NNODES": "3",
            "MASTER_ADDR": inv.master.host, "MASTER_PORT": port, "OUTPUT_DIR": "/out",
            "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",  # `ip route get` on each node
            "RANK": str(rank), "WORLD_SIZE": "3", "OMP_NUM_THREADS": "1"}
        # Prefixed, in order per node.
        lines = [ln for ln in proc.stdout.splitlines()
                 if ln.startswith((f"[{node}/{rank}] probe ", f"[{node}/{rank}] done "))]
        assert lines == [f"[{node}/{rank}] probe {node} rank {rank} of 3", f"[{node}/{rank}] done {node}"]
        kept = (finished_run["tmp"] / "logs" / run_id / node / "container.log").read_text().splitlines()
        assert [ln for ln in kept if ln.startswith(("probe ", "done "))] == [f"probe {node} rank {rank} of 3",
                                                                              f"done {node}"]
        assert kept[:2] == [f"probe {node} rank {rank} of 3", f"done {node}"]
    # No agent lost the master's store at the exit barrier (torch's race, mended by
    # runner.agents.torchrun: tests/unit/test_agent_exit.py makes it happen every time).
    assert "Error waiting on exit barrier" not in proc.stdout and "Failed to recv" not in proc.stdout, proc.stdout
    assert inv.master.name == "node-0"
    # Master first (no worker's torchrun before the master listens): tests/sandbox/test_master_first.py.
    # Finished runs leave no containers behind; `runner logs` then shows the logs `up` kept.
    assert run_containers(sandbox, run_id) == {"node-0": [], "node-1": [], "node-2": []}
    # The workers ran behind runner.agents.gate, the master under the mended torchrun (the image's
    # label io.runner.gate "3"); go-files (outside the run dir) are tidied away.
    for node in ("node-0", "node-1", "node-2"):
        status = json.loads((node_workdir(sandbox, node) / "runs" / run_id / "runner-status.json").read_text())
        assert ("python -m runner.agents.gate /run/runner/gate/go-" in status["command"]) == (node != "node-0"), status
        assert ("python -m runner.agents.torchrun --nnodes 3 --node-rank 0 " in status["command"]) == (node == "node-0")
        assert not (node_workdir(sandbox, node) / "gates" / run_id).exists(), node
    logs = runner("logs", run_id, "-i", str(sandbox), "--logs-dir", str(finished_run["tmp"] / "logs"))
    assert logs.returncode == 0 and "[node-1/1] probe node-1 rank 1 of 3" in logs.stdout, logs.stderr


def test_collect_checksums_and_incremental(sandbox, finished_run, tmp_path):
    run_id = finished_run["run_id"]
    dest = tmp_path / "artifacts"
    first = runner("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet")
    assert first.returncode == 0, first.stderr
    n_files = 0
    for node in ("node-0", "node-1", "node-2"):
        src = node_workdir(sandbox, node) / "runs" / run_id
        files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
        assert Path(f"probe-{node}.json") in files and Path(f"blob-{node}.bin") in files
        for rel in files:
            got = dest / run_id / node / rel
            assert hashlib.sha256(got.read_bytes()).digest() == hashlib.sha256((src / rel).read_bytes()).digest()
            n_files += 1
        assert re.search(rf"{node}\s+{len(files)} files: {len(files)} copied", first.stdout), first.stdout
    assert n_files >= 9
    mtimes = {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file()}
    second = runner("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet")
    assert second.returncode == 0, second.stderr
    assert second.stdout.count(" 0 copied (0.00 MB") == 3, second.stdout
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file() and p.name != ".collect-manifest.json"} == \
        {p: t for p, t in mtimes.items() if p.name != ".collect-manifest.json"}


def test_killed_worker_stops_everything(sandbox, pushed, tmp_path):
    proc, run_id = start_attached(sandbox, write_job(tmp_path, sleep=120, grace=30), tmp_path / "logs")
    r = remotes(sandbox)["node-2"]
    with r:
        assert r.run(["docker", "kill", f"runner-{run_id}-node-2"]).rc == 0
    wait_for(lambda: not any(run_containers(sandbox, run_id).values()), 120)  # zero containers, any state
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "node node-2 (rank 2) failed" in err and "exited with code 137" in err, err


def test_sigint_leaves_nothing_and_down_twice(sandbox, pushed, tmp_path):
    # Ctrl-C, even to a `runner up ... &` of a script (started with SIGINT ignored), and `kill`
    # (SIGTERM) both stop the run on every node.
    for sig, code, word in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")):
        proc, run_id = start_attached(sandbox, write_job(tmp_path, f"{sig.name}.yaml", sleep=120, grace=5),
                                      tmp_path / "logs", background=sig == signal.SIGINT)
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == code, err
        assert f"runner: {word}: stopping run {run_id} (grace 5s)" in err
        assert run_containers(sandbox, run_id) == {"node-0": [], "node-1": [], "node-2": []}
    # Detached run, then down twice: both succeed, the second finds nothing.
    job = write_job(tmp_path, "d.yaml", sleep=120, grace=5)
    up = runner("up", "-i", str(sandbox), "--job", str(job), "--detach")
    assert up.returncode == 0, up.stderr
    run_id = re.search(r"run (\S+) started", up.stdout)[1]
    assert all(len(v) == 1 for v in run_containers(sandbox, run_id, running_only=True).values())
    st = runner("status", run_id, "-i", str(sandbox), "--json")
    assert st.returncode == 0, st.stderr
    assert [(n["node"], n["rank"], n["state"]) for n in json.loads(st.stdout)["nodes"]] == [
        ("node-0", 0, "running"), ("node-1", 1, "running"), ("node-2", 2, "running")]
    ls = runner("ls", "-i", str(sandbox), "--json")
    assert run_id in [r["run_id"] for r in json.loads(ls.stdout)]
    logs = wait_for(lambda: (lambda p: p if "probe node-2" in p.stdout else None)(
        runner("logs", run_id, "-i", str(sandbox), "--node", "node-2")), 30)
    assert "[node-2/2] probe node-2 rank 2 of 3" in logs.stdout
    d1 = runner("down", run_id, "-i", str(sandbox))
    assert d1.returncode == 0 and "stopped and removed on node-0, node-1, node-2" in d1.stdout, d1.stdout + d1.stderr
    d2 = runner("down", run_id, "-i", str(sandbox))
    assert d2.returncode == 0 and "already down" in d2.stdout
    assert run_containers(sandbox, run_id) == {"node-0": [], "node-1": [], "node-2": []}


def test_secret_never_leaks(sandbox, pushed, tmp_path):
    secret = "hf_" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:24]
    envf = tmp_path / ".env"
    envf.write_text(f"HF_TOKEN={secret}\n")
    job = write_job(tmp_path, hold=True, env_file=str(envf))
    dry = runner("up", "-i", str(sandbox), "--job", str(job), "--dry-run")
    assert dry.returncode == 0 and "HF_TOKEN=******" in dry.stdout
    proc, run_id = start_attached(sandbox, job, tmp_path / "logs")
    # While it runs: no process on this machine (every sandbox node lives here) has it in argv,
    # and no container's config (docker inspect) holds it.
    for p in psutil.process_iter(["cmdline"]):
        assert secret not in " ".join(p.info["cmdline"] or [])
    for name, r in remotes(sandbox).items():
        with r:
            insp = r.run(["docker", "inspect", f"runner-{run_id}-{name}"])
            assert insp.rc == 0 and secret not in insp.out
            mode = r.run(["stat", "-c", "%a", f"{node_workdir(sandbox, name)}/secrets/{run_id}.env"]).out.strip()
            assert mode == "600"
    finish_run(sandbox, run_id)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    for name in ("node-0", "node-1", "node-2"):  # removed with the containers
        assert not (node_workdir(sandbox, name) / "secrets" / f"{run_id}.env").exists()
    want = hashlib.sha256(secret.encode()).hexdigest()
    docs = _probe_docs(sandbox, run_id)
    assert all(d["hf_token_sha256"] == want for d in docs.values())  # it did reach every rank
    assert secret not in out + err + dry.stdout + dry.stderr
    for f in (tmp_path / "logs").rglob("*"):
        if f.is_file():
            assert secret not in f.read_text(errors="replace")
    dest = tmp_path / "art"
    assert runner("collect", run_id, "-i", str(sandbox), "--dest", str(dest), "--quiet").returncode == 0
    for f in dest.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes()


def test_host_keys_refused_unless_known_or_pinned(sandbox, tmp_path):
    text = Path(sandbox).read_text()
    inv = load_inventory(sandbox, with_job=False)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(re.sub(r"known_hosts: [^,}]+", f"known_hosts: {empty}", text))
    proc = runner("ls", "-i", str(unknown))
    assert proc.returncode == 2 and "unknown host key" in proc.stderr and "--accept-new-host-keys" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    # Opt-in records the keys, after which they are known.
    proc = runner("ls", "-i", str(unknown), "--accept-new-host-keys")
    assert proc.returncode == 0, proc.stderr
    assert len(empty.read_text().splitlines()) == 3
    assert runner("ls", "-i", str(unknown)).returncode == 0
    # Pinned fingerprints: a wrong one is refused, the right one accepted. The pinned inventory's
    # known_hosts is empty, so only the pins can make the nodes trusted (an ignored pin would fail).
    right = {}
    for name, r in remotes(sandbox).items():
        with r:
            right[name] = r.host_key_fp
    wrong = "SHA256:" + "A" * 43
    for fp, ok in ((wrong, False), (right["node-1"], True)):
        blank = tmp_path / f"known_hosts-{ok}"
        blank.write_text("")
        pinned_text = re.sub(r"known_hosts: [^,}]+", f"known_hosts: {blank}", text)
        for name in right:
            h = inv.node(name).host
            pin = fp if name == "node-1" else right[name]
            pinned_text = pinned_text.replace(f"host: {h},", f"host: {h}, host_key: '{pin}',")
        pinned = tmp_path / "pinned.yaml"
        pinned.write_text(pinned_text)
        proc = runner("down", "-i", str(pinned))
        if ok:
            assert proc.returncode == 0, proc.stderr
        else:
            assert proc.returncode == 3 and "node node-1: host key mismatch" in proc.stderr, proc.stderr
        assert blank.read_text() == ""  # a pin never writes known_hosts


PP3 = """model: {preset: tiny-llama, num_hidden_layers: 3}
data: {source: synthetic, seq_len: 32}
train: {steps: 3, seed: 1, batch_size: 8, microbatch_num: 4}
parallel: {pp: 3, pp_schedule: 1f1b}
"""


def test_pipeline_trainer_job_three_nodes(sandbox, pushed, tmp_path):
    """The real trainer: a 3-stage 1F1B pipeline, one stage per node, then collect's summary."""
    cfg = tmp_path / "pp3.yaml"
    cfg.write_text(PP3)
    job = tmp_path / "job.yaml"
    job.write_text(f"job:\n  image: {IMAGE}\n  config: {cfg}\n  env: {{OMP_NUM_THREADS: '1'}}\n"
                   "  master_port: auto\n  grace_period: 10\n")
    proc = runner("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(tmp_path / "logs"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    assert "[node-0/0] stage 0 (pp rank 0): embeddings + layer 0" in proc.stdout
    col = runner("collect", run_id, "-i", str(sandbox), "--dest", str(tmp_path / "art"), "--quiet")
    assert col.returncode == 0, col.stderr
    metrics = [json.loads(x) for x in (tmp_path / "art" / run_id / "node-2" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    # one stage per node equals the whole model in one process (fp32, 1e-5)
    run_trainer(tmp_path / "one", "--config", str(cfg), "--parallel.pp", "1")
    ref = [m["loss"] for m in read_metrics(tmp_path / "one")]
    assert len(losses) == len(ref) == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref, strict=True)), (losses, ref)
    assert f"final loss {losses[-1]:.4f} at step 3" in col.stdout
    for node, rank in (("node-0", 0), ("node-1", 1), ("node-2", 2)):
        assert (tmp_path / "art" / run_id / node / "logs" / f"rank{rank}.log").is_file()
    # --no-plots: the same files, and no plot of collect's own (it rendered the loss plot above).
    bare = runner("collect", run_id, "-i", str(sandbox), "--dest", str(tmp_path / "bare"), "--quiet", "--no-plots")
    assert bare.returncode == 0, bare.stderr

    def pngs(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*.png")}

    on_nodes = {f"{n}/{p}" for n in ("node-0", "node-1", "node-2")
                for p in pngs(node_workdir(sandbox, n) / "runs" / run_id)}
    assert pngs(tmp_path / "bare" / run_id) == on_nodes
    assert "node-2/metrics.png" in pngs(tmp_path / "art" / run_id) - on_nodes


def test_max_restarts_resumes_same_run(sandbox, pushed, tmp_path):
    """node-1 fails on the first attempt only; --max-restarts 1 relaunches the same run (same run
    dir, so checkpoints are found) with `--resume latest` and the job succeeds."""
    flaky = ("import os, sys; p = '/out/attempted-' + os.environ['NODE_NAME']; first = not os.path.exists(p); "
             "open(p, 'a').write('x'); print('args', sys.argv[1:], flush=True); "
             "sys.exit(3 if first and os.environ['NODE_NAME'] == 'node-1' else 0)")
    job = write_job(tmp_path, extra={"command": ["python", "-c", flaky]})
    proc = runner("up", "-i", str(sandbox), "--job", str(job), "--max-restarts", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    assert proc.stdout.count(f"run {run_id} started") == 2
    assert "restart 1/1" in proc.stderr
    assert "[node-1/1] args ['--resume', 'latest']" in proc.stdout
    for node in ("node-0", "node-1", "node-2"):
        assert (node_workdir(sandbox, node) / "runs" / run_id / f"attempted-{node}").read_text() == "xx"
    assert run_containers(sandbox, run_id) == {"node-0": [], "node-1": [], "node-2": []}


def test_check_table_and_failing_node(sandbox, pushed, tmp_path):
    ok = runner("check", "-i", str(sandbox), "--job", str(pushed["job"]), "--json")
    assert ok.returncode == 0, ok.stderr
    rows = json.loads(ok.stdout)
    assert [r["node"] for r in rows] == ["node-0", "node-1", "node-2"]
    for r in rows:
        p = r["probe"]
        assert r["ssh"] == "ok" and r["host_key"].startswith("known_hosts SHA256:")
        assert p["docker"] and p["arch"] == "amd64" and p["cpus"] >= 1 and p["mem_gb"] > 0 and p["disk_free_gb"] > 0
        assert 0 < p["mem_available"] <= (p["mem_gb"] + 0.05) * 2**30  # MemAvailable: what `up` sizes against
        # The clock was measured; this machine's own clock is within check's tolerance of itself (no
        # "clock off by" problem below): how close, under load, is the ssh round trip's, not asserted.
        assert p["ifname"] == "lo" and isinstance(p["clock_offset_s"], float)
        assert r["image_present"] is True and r["problems"] == []
    assert rows[0]["master_port"] == "auto"
    # A node nobody answers for (free loopback address): non-zero exit naming it, others still checked.
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(sandbox).read_text().replace("nodes:\n", "nodes:\n- {name: ghost, host: 127.0.2.99, port: 2299}\n", 1))
    proc = runner("check", "-i", str(bad), "--job", str(pushed["job"]))
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "check failed on ghost: cannot connect to 127.0.2.99:2299" in err[0], proc.stderr
    assert "node-0" not in err[0] and "all 4" not in proc.stdout
