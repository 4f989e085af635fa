"""In-process checks of the checkpoint helpers that need no process group."""

from __future__ import annotations

import json

import pytest

from trainer.checkpoint import _truncate_metrics, list_checkpoints, resolve_resume, verify_manifests
from trainer.config import ConfigError


def _ckpt(root, name, step):
    d = root / name
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    return d


def test_resolve_latest(tmp_path):
    assert resolve_resume("latest", tmp_path) is None  # nothing yet: a first launch starts fresh
    d = _ckpt(tmp_path, "step-4", 4)
    (tmp_path / "latest").write_text("step-4\n")
    assert resolve_resume("latest", tmp_path) == d
    assert resolve_resume(str(tmp_path), tmp_path / "elsewhere") == d  # a checkpoints root = its latest
    assert resolve_resume("step-4", tmp_path) == d                     # a name under the root
    (tmp_path / "latest").write_text("step-9\n")
    with pytest.raises(ConfigError, match=r"latest: points at 'step-9', which does not exist"):
        resolve_resume("latest", tmp_path)


def test_list_skips_incomplete(tmp_path):
    _ckpt(tmp_path, "step-2", 2)
    _ckpt(tmp_path, "step-10", 10)
    _ckpt(tmp_path, ".tmp-step-12", 12)          # a save that never finished
    (tmp_path / "step-11").mkdir()               # no trainer_state.json
    assert [(s, d.name) for s, d in list_checkpoints(tmp_path)] == [(2, "step-2"), (10, "step-10")]


def test_verify_manifests_names_the_file(tmp_path):
    d = _ckpt(tmp_path, "step-1", 1)
    (d / "a.bin").write_bytes(b"12345")
    (d / "manifest.rank0.json").write_text(json.dumps({"a.bin": [5, None]}))
    assert verify_manifests(d, 1, 0, 1) is None
    assert "manifest.rank1.json: missing" in verify_manifests(d, 2, 0, 1)
    (d / "a.bin").write_bytes(b"123")
    assert verify_manifests(d, 1, 0, 1).endswith("a.bin: size 3 != 5 recorded at save time (truncated or corrupt)")


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    _truncate_metrics(m, 3)
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [1, 2, 3]
