"""The reduced Pi experiment the way a user runs it (issues 12, 24): a Qwen3 model with its own
tokenizer laid out as `hf download` leaves it (a Hub cache repo, links into blobs/) and a dataset
saved with `datasets` on this machine, synced with job.sync to three sandbox nodes that log in as a
non-root user (a Pi's `pi`), fine-tuned as the 3-stage pipeline with --model.path and
--data.source on the read-only mounts, stopped with `runner down` (preempt checkpoint), resumed
with `runner up --resume`, collected, exported with `trainer export` from the collected run (each
node holds only its own stage's shards) and loaded back with AutoModelForCausalLM + AutoTokenizer.
Asserted on numbers and files: the losses equal one process training the same local files (1e-5),
the resume continues at the checkpoint's step, the second launch moves no sync data, the exported
weights are those rank 0 gathered at the last step (`checkpoint.format full`) and its logits
theirs (1e-5), greedy generation runs, the node's files belong to the SSH user and the collected
ones to the caller."""

from __future__ import annotations

import os
import pwd
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests import IMAGE, REPO
from tests.conftest import NONROOT_USER
from tests.support.hub_fixtures import snapshot
from tests.support.runner_helpers import down_while_held, node_workdir, runner, up_detached, wait_for
from tests.support.trainer_run import HOOKS_SYNC, held, hold_env, read_metrics, run_trainer

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")
STEPS = 6
SYNC_RE = re.compile(r"^(\S+)\s+(\S+)\s+(present|updated)\s+files (\d+)/(\d+)\s+([\d.]+) MB", re.M)


def host_files(tmp: Path) -> tuple[Path, Path]:
    """The user's laptop: a 7-layer Qwen3 (the tiny experiment's shape) with its tokenizer in a Hub
    cache repo, and the bundled corpus as a `datasets` DatasetDict saved with save_to_disk."""
    from tests.support.hub_fixtures import corpus_dataset, pretrained

    return pretrained(tmp, "qwen3", layers=7), corpus_dataset(tmp / "dataset")


def exported_model_loads_in_transformers(art: Path, out: Path, snap: Path) -> None:
    """`trainer export` of the collected run (the union of the nodes' copies), loaded as a user
    does: its weights are those rank 0 gathered at the last step, its logits theirs (1e-5), its
    tokenizer gives the snapshot tokenizer's ids, and greedy generation runs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.hub_fixtures import paragraphs
    from trainer.checkpoint.export import export

    assert export([str(art), str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    root = art / "node-0" / "checkpoints"
    last = root / (root / "latest").read_text().strip()
    assert last.name == f"step-{STEPS}"
    gathered = torch.load(last / "model_state_dict.pt", weights_only=True)
    sd = hf.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in gathered.items())
    ref = AutoModelForCausalLM.from_config(hf.config).eval()
    missing, unexpected = ref.load_state_dict(gathered, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    texts = paragraphs()[:8]
    own = AutoTokenizer.from_pretrained(str(snap), local_files_only=True)
    assert tok(texts)["input_ids"] == own(texts)["input_ids"]
    ids = tok(texts[:1], return_tensors="pt")["input_ids"][:, :24]
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item() <= 1e-5
        gen = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape == (1, ids.shape[1] + 8) and torch.equal(gen[:, : ids.shape[1]], ids)


def test_pi_experiment_synced_weights_on_nonroot_nodes_down_resume_collect(nonroot_sandbox, nonroot_pushed,
                                                                          tmp_path):
    inv = Path(nonroot_sandbox)
    assert [n["name"] for n in yaml.safe_load(inv.read_text())["nodes"]] == list(NODES)
    model, corpus = host_files(tmp_path)
    args = ["--train_steps", str(STEPS), "--batch_size", "16", "--microbatch_num", "4",
            "--model.path", "/data/model", "--data.source", "/data/dataset",
            "--checkpoint.enabled", "true", "--checkpoint.format", "full"]  # + rank 0's gathered weights
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": str(REPO / "configs" / "pi-qwen3-3stage-tiny.yaml"), "args": args,
        "env": {"OMP_NUM_THREADS": "1", **hold_env("step:2")}, "grace_period": 60,
        "sync": [{"src": str(model), "dst": "/data/model"}, {"src": str(corpus), "dst": "/data/dataset"},
                 HOOKS_SYNC]}}))
    env = {"RUNNER_SYNC_CACHE": str(tmp_path / "hashes.json")}

    # Held after step 2 on every rank until `down`'s SIGTERM reached it: the preempt checkpoint is step 3.
    run_id = up_detached(inv, job)
    out = {n: node_workdir(inv, n) / "runs" / run_id for n in NODES}
    wait_for(lambda: all(held(out[n], "step-2", [i]) for i, n in enumerate(NODES)), 300)
    down = down_while_held(inv, run_id, out, "step-2")
    assert down.returncode == 0, down.stdout + down.stderr
    for n in NODES:
        assert (out[n] / "checkpoints" / "latest").read_text().strip() == "step-3.preempt", n

    # The same job again: its data is on every node already.
    again = runner("sync", "-i", str(inv), "--job", str(job), env=env)
    assert again.returncode == 0, again.stderr
    # the job's own data; the tests' hook folder (HOOKS_SYNC, what lets a rank hold) is test support
    rows = [m.groups() for m in SYNC_RE.finditer(again.stdout) if m.group(2) != HOOKS_SYNC["dst"]]
    assert sorted((r[0], r[1]) for r in rows) == sorted((n, d) for n in NODES for d in ("/data/model", "/data/dataset"))
    assert all(r[2] == "present" and r[3] == "0" and r[5] == "0.0" for r in rows), rows

    res = runner("up", "-i", str(inv), "--job", str(job), "--resume", run_id, "--logs-dir", str(tmp_path / "logs"),
                 timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"run {run_id}: resuming from step-3.preempt (step 3)" in res.stdout, res.stdout[:2000]

    col = runner("collect", run_id, "-i", str(inv), "--dest", str(tmp_path / "art"), "--quiet")
    assert col.returncode == 0, col.stderr
    art = tmp_path / "art" / run_id
    got = [(m["step"], m["loss"]) for m in read_metrics(art / "node-2") if "loss" in m]
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), got

    exported_model_loads_in_transformers(art, tmp_path / "hf", snapshot(model))

    # One process, the same files from this machine's disk: the same losses.
    one = tmp_path / "one-process"
    run_trainer(one, "--config", "configs/pi-qwen3-3stage-tiny.yaml", *args[:6], "--model.path", str(model),
                "--data.source", str(corpus), "--parallel.pp", "1")
    ref = [m["loss"] for m in read_metrics(one)]
    assert len(ref) == STEPS
    for (step, a), b in zip(got, ref, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: 3 non-root nodes {a} vs one process {b}"

    # Ownership: on the nodes the SSH user's, here the caller's.
    uid = pwd.getpwnam(NONROOT_USER).pw_uid
    for n in NODES:
        made = [p for p in out[n].rglob("*") if p.is_file()]
        assert made and {p.stat().st_uid for p in made} == {uid}, n
    collected = [p for p in art.rglob("*") if p.is_file()]
    assert collected and {p.stat().st_uid for p in collected} == {os.getuid()}
    for n in NODES:  # the run is this test's: the shared nodes' next test does not find it
        shutil.rmtree(out[n])
