"""Checkpoint files: FSDP-stub full format and naming, export, pruning, and one-line load errors.

One 2-process ZeRO-3 run with `format: full` and a stub prefix provides the checkpoint the
tests read, corrupt (in copies) and export.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.trainer_run import REPO, run_trainer, trainer_env

pytestmark = pytest.mark.multiproc

TINY = ("configs/tiny.yaml", "--train.steps", "2")


@pytest.fixture(scope="module")
def stub_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stub")
    run_trainer(out, *TINY, "--parallel.sharding", "zero3", "--checkpoint.format", "full",
                "--checkpoint.prefix", "dummy-0.1", "--checkpoint.enabled", "true", nproc=2)
    root = out / "checkpoints"
    return root / (root / "latest").read_text().strip()


def test_full_format_files_and_stub_naming(stub_ckpt):
    assert re.fullmatch(r"dummy-0\.1\.\d{4}_\d{4}_\d{4}_\d{2}", stub_ckpt.name)
    model = torch.load(stub_ckpt / "model_state_dict.pt", weights_only=True)
    optim = torch.load(stub_ckpt / "optim_state_dict.pt", weights_only=False)
    lr = torch.load(stub_ckpt / "lr_state_dict.pt", weights_only=False)
    it = torch.load(stub_ckpt / "iter_state_dict.pt", weights_only=False)
    assert set(it) == {"epoch", "seg", "start_idx", "end_idx", "loss_min"}
    assert it["start_idx"] == 2 * 8 and it["end_idx"] == 2 * 8  # 2 steps x global batch 8, all done
    assert it["loss_min"] > 0 and lr["last_epoch"] == 2
    # Unsharded: full shapes, every parameter has Adam state, names are the model's.
    assert model["model.embed_tokens.weight"].ndim == 2 and "model.layers.0.self_attn.q_proj.weight" in model
    assert set(optim["state"]) == {k for k in model if "rotary" not in k}
    assert all(int(s["step"]) == 2 for s in optim["state"].values())


def test_export_to_transformers_dir(stub_ckpt, tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "trainer", "export", str(stub_ckpt.parent), str(out)],
                          capture_output=True, text=True, env=trainer_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "config.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    full = torch.load(stub_ckpt / "model_state_dict.pt", weights_only=True)
    sd = hf.state_dict()
    assert set(full) <= set(sd)
    for k, v in full.items():
        assert torch.equal(sd[k], v), k


def _corrupt_shard(ck: Path) -> str:
    f = ck / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    return "__1_0.distcp: size 1000"


def _flip_metadata(ck: Path) -> str:
    f = ck / ".metadata"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return ".metadata: checksum mismatch"


def _drop_manifest(ck: Path) -> str:
    (ck / "manifest.rank1.json").unlink()
    return "manifest.rank1.json: missing"


def _drop_state(ck: Path) -> str:
    (ck / "trainer_state.json").unlink()
    return "trainer_state.json: missing"


@pytest.mark.parametrize("damage, extra", [
    (_corrupt_shard, ()), (_flip_metadata, ()), (_drop_manifest, ()), (_drop_state, ()),
    (None, ("--model.num_hidden_layers", "3")),
])
def test_bad_checkpoint_is_one_line_error(stub_ckpt, tmp_path, damage, extra):
    ck = tmp_path / "ck"
    shutil.copytree(stub_ckpt, ck)
    want = damage(ck) if damage else "model key 'num_hidden_layers' is 2 in the checkpoint but 3"
    proc = run_trainer(tmp_path / "out", *TINY, *extra, "--resume", str(ck), check=False)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and want in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_missing_resume_path_is_one_line_error(tmp_path):
    proc = run_trainer(tmp_path / "out", *TINY, "--resume", str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: checkpoint.resume: '{tmp_path / 'nope'}' is not a checkpoint directory"


def test_intervals_preempt_overwrite_and_keep_last(tmp_path):
    """interval 4, preempt_interval 3, keep_last 1, 7 steps: saves 3p, 4, 6p (replaces 3p), 7 (final)."""
    out = tmp_path / "out"
    run_trainer(out, *TINY, "--train.steps", "7", "--checkpoint.interval", "4", "--checkpoint.preempt_interval", "3",
                "--checkpoint.keep_last", "1")
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-6.preempt", "step-7"]
    assert (root / "latest").read_text().strip() == "step-7"
    assert json.loads((root / "step-6.preempt" / "trainer_state.json").read_text())["step"] == 6


def test_prefix_naming_preempt_and_keep_last_two(tmp_path):
    """Stub naming with keep_last 2: regular saves at 2, 4 and 5 (final) keep the newest two; the
    periodic preempt save at 3 is <prefix>.<timestamp>.preempt. The saves of this tiny model come
    well within a second of each other: each still gets its own directory (-1, -2 on a clash)."""
    out = tmp_path / "out"
    run_trainer(out, *TINY, "--train.steps", "5", "--checkpoint.prefix", "ck", "--checkpoint.interval", "2",
                "--checkpoint.preempt_interval", "3", "--checkpoint.keep_last", "2")
    root = out / "checkpoints"
    steps = {p.name: json.loads((p / "trainer_state.json").read_text())["step"] for p in root.iterdir() if p.is_dir()}
    stamp = r"ck\.\d{4}_\d{4}_\d{4}_\d{2}(-\d+)?"
    regular = sorted(n for n in steps if re.fullmatch(stamp, n))
    preempt = [n for n in steps if re.fullmatch(stamp + r"\.preempt", n)]
    assert len(steps) == 3, steps
    assert [steps[n] for n in regular] == [4, 5]  # names sort in save order; step 2 pruned
    assert [steps[n] for n in preempt] == [3]
    assert steps[(root / "latest").read_text().strip()] == 5


def _collected(stub_ckpt: Path, art: Path) -> list[Path]:
    """`runner collect`'s layout for a run of two nodes without shared storage: each node's copy."""
    copies = []
    for node in ("node-a", "node-b"):
        root = art / node / "checkpoints"
        shutil.copytree(stub_ckpt, root / stub_ckpt.name)
        (root / "latest").write_text(stub_ckpt.name + "\n")
        copies.append(root / stub_ckpt.name)
    return copies


def test_export_of_a_collected_run_carries_the_tokenizer_files(stub_ckpt, tmp_path):
    """The union of the nodes' copies once linked the tokenizer files too, and the export then
    refused its own links ('tokenizer.json: a link'): every multi-node export with a tokenizer failed."""
    from trainer.checkpoint.export import export

    a, b = _collected(stub_ckpt, tmp_path / "art")
    (b / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')  # rank 0 wrote it; the other node lacks it
    assert export([str(tmp_path / "art"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"model": {"type": "BPE"}}'
    assert not (tmp_path / "hf" / "tokenizer.json").is_symlink()


def test_export_of_a_collected_run_refuses_a_link_in_a_node_copy(stub_ckpt, tmp_path):
    from trainer.checkpoint.export import export
    from trainer.config import ConfigError

    a, _ = _collected(stub_ckpt, tmp_path / "art")
    secret = tmp_path / "id_ed25519"
    secret.write_text("PRIVATE KEY")
    (a / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ConfigError, match=r"node-a/checkpoints/.*/tokenizer.json: a link"):
        export([str(tmp_path / "art"), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
