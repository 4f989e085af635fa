"""In-process checks of the checkpoint helpers that need no process group."""

from __future__ import annotations

import json

import pytest

from trainer.checkpoint.checkpointer import _truncate_metrics
from trainer.checkpoint.on_disk import list_checkpoints, resolve_resume, verify_manifests
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


def test_per_node_verify_needs_every_rank_files_on_each_node(tmp_path):
    """Per-node storage: a rank checks all manifests' files in its node's copy (DCP may read any)."""
    from trainer.checkpoint.storage import MISSING_HINT

    d = _ckpt(tmp_path, "step-1", 1)
    for r in range(2):
        (d / f"__{r}_0.distcp").write_bytes(b"xx")
        (d / f"manifest.rank{r}.json").write_text(json.dumps({f"__{r}_0.distcp": [2, None]}))
    assert verify_manifests(d, 2, 0, 1, all_present=True, hint=MISSING_HINT) is None
    (d / "__1_0.distcp").unlink()
    # Rank 0's own share (manifest 0) is complete; rank 1's shard missing here is still an error.
    assert verify_manifests(d, 2, 0, 2) is None
    err = verify_manifests(d, 2, 0, 2, all_present=True, hint=MISSING_HINT)
    assert err == f"{d / '__1_0.distcp'}: missing (listed in manifest.rank1.json); {MISSING_HINT}"
    assert "\n" not in err and "runner up --resume" in err


def test_nodes_agree_on_latest(tmp_path):
    from trainer.checkpoint.storage import agree_on_latest

    pointer = tmp_path / "latest"
    both = [(3, "step-3"), (6, "step-6")]
    assert agree_on_latest([("step-6", both), ("step-6", both)], pointer) == ("step-6", None)
    assert agree_on_latest([(None, []), (None, [])], pointer) == (None, None)  # first launch
    # Node 1 crashed before renaming step-6 (pruning waits for every rename: step-3 is on both).
    name, warning = agree_on_latest([("step-6", both), ("step-3", [(3, "step-3")])], pointer)
    assert name == "step-3" and "rank 0: step-6, rank 1: step-3" in warning
    with pytest.raises(ConfigError, match="none is complete on every node; .*runner up --resume"):
        agree_on_latest([("step-6", [(6, "step-6")]), (None, [])], pointer)


def test_storage_layout_groups():
    from trainer.checkpoint.storage import StorageLayout

    shared = StorageLayout((0, 0, 0, 0))
    assert shared.shared and shared.is_leader(0) and not shared.is_leader(1)
    nodes = StorageLayout((0, 0, 2, 2))  # two nodes of two ranks, each on its own disk
    assert not nodes.shared and nodes.is_leader(2) and nodes.group(3) == [2, 3]
    assert nodes.describe() == "ranks 0,1; ranks 2,3"


def test_prefix_saves_in_the_same_second_get_distinct_names(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from trainer.checkpoint import checkpointer as checkpoint

    ck = checkpoint.Checkpointer.__new__(checkpoint.Checkpointer)  # only cfg and root matter here
    ck.cfg, ck.root = SimpleNamespace(prefix="ck", name="step-{step}"), tmp_path
    monkeypatch.setattr(checkpoint.time, "strftime", lambda fmt: "2025_0101_1200_07")
    assert ck._name(1, False) == "ck.2025_0101_1200_07"
    (tmp_path / "ck.2025_0101_1200_07").mkdir()
    assert ck._name(2, False) == "ck.2025_0101_1200_07-1"  # was: the same name, replacing the first
    (tmp_path / "ck.2025_0101_1200_07-1").mkdir()
    assert ck._name(3, False) == "ck.2025_0101_1200_07-2"
    assert ck._name(3, True) == "ck.2025_0101_1200_07.preempt"
    ck.cfg.prefix = ""
    assert ck._name(3, True) == "step-3.preempt"
