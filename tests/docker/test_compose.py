"""compose.yaml: Debian's docker-compose (1.29, i.e. v1) accepts it, the GPU service asks for every
GPU, both mount the checkout's configs/ read-only, and the CPU profile runs the smollm-3d
experiment (picotron's SmolLM 3D job, dp2 x tp2 x pp2 1F1B) at reduced width through
docker-compose itself, writing its artifacts (metrics, logs, the timeline of batch 1) to the
mounted /out.

This is also the reduced test of the smollm-3d experiment (docs/experiments.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid

import pytest
import yaml

from tests.conftest import REPO, require

pytestmark = [pytest.mark.docker]

# The layout and schedule stay those of configs/smollm-3d.yaml (8 ranks); only widths shrink.
REDUCED = ("--train.steps 3 --model.hidden_size 32 --model.num_attention_heads 4 --model.intermediate_size 64 "
           "--model.vocab_size 256 --data.seq_len 16 --profile_batch 1")
# picotron's line: Step | Loss | Global batch size | Tokens/s | Tokens/s/GPU | Tokens | MFU | Memory usage
PICOTRON_LINE = re.compile(
    r"Step: (\d+)\s+\| Loss: (\d+\.\d{4}) \| Global batch size: +(\S+) \| Tokens/s: +(\S+) \| "
    r"Tokens/s/GPU: +(\S+) \| Tokens: +(\S+) \| MFU: +(\d+\.\d{2})% \| Memory usage: +(\S+B) \| LR: (\d\.\d{2}e[-+]\d\d)")


def compose(host: str, *args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["docker-compose", "-f", str(REPO / "compose.yaml"), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env={**os.environ, "DOCKER_HOST": host, **(env or {})})


@pytest.fixture(scope="module")
def have_compose() -> None:
    require("docker-compose", shutil.which("docker-compose") is not None, "Debian's docker-compose is not installed")


def test_compose_config_gpu_service(host_docker, have_compose):
    """Both services resolve; the GPU one reserves all GPUs with host IPC and a large /dev/shm, and
    the command takes NPROC_PER_NODE, CONFIG and TRAINER_ARGS from the environment."""
    r = compose(host_docker, "--profile", "cpu", "config",
                env={"NPROC_PER_NODE": "4", "CONFIG": "configs/minimal-3d.yaml", "TRAINER_ARGS": "--train.steps 7"})
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    assert set(services) == {"trainer", "trainer-cpu"}
    gpu = services["trainer"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"capabilities": ["gpu"], "count": "all", "driver": "nvidia"}]
    assert gpu["ipc"] == "host" and gpu["network_mode"] == "host"
    assert int(gpu["shm_size"].rstrip("gb")) >= 16
    assert gpu["command"].split() == ["torchrun", "--standalone", "--nproc-per-node", "4", "-m", "trainer",
                                      "--config", "configs/minimal-3d.yaml", "--train.steps", "7"]
    assert any(v.endswith(":/out:rw") and v.startswith(str(REPO / "artifacts")) for v in gpu["volumes"])
    cpu = services["trainer-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    for svc in (gpu, cpu):  # the checkout's configs over the image's: an edit counts without a rebuild
        assert f"{REPO / 'configs'}:/workspace/configs:ro" in svc["volumes"], svc["volumes"]
    assert "--parallel.device cpu" in cpu["command"]
    # Defaults: 8 processes, the SmolLM 3D job.
    r = compose(host_docker, "config")
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    assert "--nproc-per-node 8 -m trainer --config configs/smollm-3d.yaml" in services["trainer"]["command"]


@pytest.mark.multiproc
def test_compose_cpu_profile_smollm_3d(host_docker, trainer_image, have_compose, tmp_path):
    run_id = "smollm-3d-reduced"
    project = f"t{uuid.uuid4().hex[:8]}"
    env = {"ARTIFACTS_DIR": str(tmp_path), "RUN_ID": run_id, "NPROC_PER_NODE": "8", "TRAINER_ARGS": REDUCED,
           "TRAINER_IMAGE": trainer_image}
    try:
        # The container sees the checkout's configs/, mounted read-only over the image's copy.
        m = compose(host_docker, "-p", project, "--profile", "cpu", "run", "--rm", "trainer-cpu", "cat",
                    "/proc/mounts", env=env)
        assert m.returncode == 0, m.stderr
        (mount,) = [line.split() for line in m.stdout.splitlines() if line.split()[1:2] == ["/workspace/configs"]]
        assert mount[3].split(",")[0] == "ro", mount
        r = compose(host_docker, "-p", project, "--profile", "cpu", "run", "--rm", "trainer-cpu", env=env)
    finally:
        compose(host_docker, "-p", project, "--profile", "cpu", "down", "--remove-orphans", env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    out = tmp_path / run_id
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert (cfg["parallel"]["tp"], cfg["parallel"]["pp"], cfg["parallel"]["pp_schedule"]) == (2, 2, "1f1b")
    assert cfg["parallel"]["device"] == "cpu" and cfg["model"]["preset"] == "smollm-1.7b"
    assert (cfg["model"]["num_hidden_layers"], cfg["train"]["grad_acc_steps"], cfg["train"]["batch_size"]) == (5, 2, 4)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # global batch = mbs 4 x grad_acc 2 x dp 2 = 16 samples of 16 tokens
    assert all(m["global_batch_samples"] == 16 and m["global_batch_tokens"] == 256 for m in metrics)
    # Random init over a 256-token vocabulary: the first loss is close to ln(256) = 5.55.
    assert abs(metrics[0]["loss"] - 5.545) < 0.3
    for m in metrics:
        assert m["tokens_per_s_per_device"] == pytest.approx(m["tokens_per_s"] / 8)
        assert m["tokens_per_s"] == pytest.approx(256 / m["step_time_s"])
        assert 0 < m["mfu"] < 1 and m["memory_bytes"] > 0
    assert sorted(p.name for p in (out / "logs").iterdir()) == [f"rank{r}.log" for r in range(8)]
    lines = [m for p in (out / "logs").iterdir() for m in PICOTRON_LINE.finditer(p.read_text())]
    assert [int(m[1]) for m in lines] == [1, 2, 3]
    for m, rec in zip(lines, metrics, strict=True):
        assert float(m[2]) == pytest.approx(rec["loss"], abs=5e-5)
        assert m[3] == "256" and float(m[7]) == pytest.approx(100 * rec["mfu"], abs=0.006)
    _assert_smollm_timeline(out)


def _assert_smollm_timeline(out) -> None:
    """--profile_batch 1 through compose: one merged trace of the 8 ranks (dp2 x tp2 x pp2) in /out."""
    assert sorted(p.name for p in out.glob("timeline_*")) == ["timeline_batch1_all.json", "timeline_batch1_summary.json"]
    trace = json.loads((out / "timeline_batch1_all.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names) == list(range(8))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    stage = {}
    for rank in range(8):
        evs = [e for e in xs if e["pid"] == rank]
        acts = [e["name"].split(" ")[0] for e in evs]
        # grad_acc 2 x microbatch_num 1 = 2 pipeline microbatches per step, then one ZeRO-2 reduction
        assert acts.count("forward") == acts.count("backward") == 2 and acts.count("dp_reduce") == 1, acts
        (stage[rank],) = {e["args"]["stage"] for e in evs if e["name"].startswith(("forward", "backward"))}
        assert names[rank] == f"compose/rank{rank}/stage{stage[rank]}"  # NODE_NAME from compose.yaml
        assert sorted(e["args"]["microbatch"] for e in evs if e["name"].startswith("forward")) == [0, 1]
    assert sorted(stage.values()) == [0] * 4 + [1] * 4
    s = json.loads((out / "timeline_batch1_summary.json").read_text())
    assert (s["pp"], s["microbatches"], s["schedule"]) == (2, 2, "1f1b")
    assert s["theoretical_bubble"] == pytest.approx(1 / 3, abs=1e-12)  # (p-1)/(m+p-1)
    assert 0.0 < s["measured_bubble"] < 1.0
