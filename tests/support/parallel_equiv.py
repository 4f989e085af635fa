"""Shared by the PP/TP/3D equivalence tests: run the real `trainer` entry point in a parallel
layout and in a single process with the same seed, model and global batch, and compare.

Clipping is set low (0.5) so that the cross-stage / cross-mesh gradient norm is exercised on
every step, not only the loss.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.support.trainer_run import read_metrics, run_trainer, run_trainers

REL_TOL = 1e-5

MODELS = {
    # 4 layers so that 2 ranks x 2 virtual stages and the 3-stage seed layout fit.
    "llama": ("--model.preset", "tiny-llama", "--model.num_hidden_layers", "4"),
    # Qwen3 ties embeddings and head: the cross-stage tied-gradient sync is under test.
    # (layer_types given too: the preset's list is sized for its own 2 layers.)
    "qwen3": ("--model.preset", "tiny-qwen3", "--model.num_hidden_layers", "4",
              "--model.hf_overrides", '{"layer_types": [full_attention, full_attention, full_attention, '
                                      'full_attention]}'),
    # Masked LM: microbatches hold different numbers of labelled tokens.
    "bert": ("--model.preset", "tiny-bert"),
    # The Perseus families (tests/distributed/test_perseus_parallel.py): encoder-decoder, ALiBi, convolutions.
    "t5": ("--model.preset", "tiny-t5"),
    "bloom": ("--model.preset", "tiny-bloom"),
    "wide_resnet": ("--model.preset", "tiny-wide-resnet"),
}


def common(global_batch: int, dp: int, micro: int) -> tuple[str, ...]:
    return ("--train.steps", "4", "--train.seed", "0", "--data.seq_len", "16",
            "--train.batch_size", str(global_batch // dp), "--train.microbatch_num", str(micro),
            "--train.grad_clip", "0.5", "--optim.lr", "0.001")


_REFERENCES: dict[tuple[str, int, int], tuple[tuple[float, ...], tuple[float, ...]]] = {}


def references(models: list[str], global_batch: int = 8, micro: int = 1) -> None:
    """Run the single-process references of `models` not run yet in this session, all in one process
    (run_trainers). `micro`: their microbatches (BatchNorm normalises per microbatch: the layouts
    compared must split alike)."""
    todo = [m for m in models if (m, global_batch, micro) not in _REFERENCES]
    if not todo:
        return
    base = Path(tempfile.mkdtemp(prefix="ref-"))
    run_trainers([(base / m, (*MODELS[m], *common(global_batch, 1, micro))) for m in todo])
    for m in todo:
        rows = read_metrics(base / m)
        _REFERENCES[(m, global_batch, micro)] = tuple(r["loss"] for r in rows), tuple(r["grad_norm"] for r in rows)


def reference(model: str, global_batch: int = 8, micro: int = 1) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(losses, grad norms) of the single-process run; kept across tests of one session."""
    references([model], global_batch, micro)
    return _REFERENCES[(model, global_batch, micro)]


def layout_args(model: str, *args: str, global_batch: int = 8, dp: int = 1, micro: int = 4) -> tuple[str, ...]:
    """The trainer arguments of `model` in a layout: the reference's run plus `args`."""
    return (*MODELS[model], *common(global_batch, dp, micro), *args)


def run_layout(out: Path, model: str, nproc: int, *args: str, global_batch: int = 8, dp: int = 1,
               micro: int = 4) -> list[dict]:
    run_trainer(out, *layout_args(model, *args, global_batch=global_batch, dp=dp, micro=micro), nproc=nproc)
    return read_metrics(out)


def assert_equivalent(metrics: list[dict], model: str, global_batch: int = 8, micro: int = 1) -> None:
    ref_loss, ref_norm = reference(model, global_batch, micro)
    losses = [r["loss"] for r in metrics]
    assert len(losses) == len(ref_loss) == 4, (losses, ref_loss)
    for step, (a, b) in enumerate(zip(losses, ref_loss, strict=True), 1):
        assert abs(a - b) <= REL_TOL * abs(b), f"step {step}: loss {a} vs single process {b}"
    # The norm is computed across stages / shards; clipping acted (norm > 0.5) on the first step.
    assert ref_norm[0] > 0.5
    for step, (a, b) in enumerate(zip([r["grad_norm"] for r in metrics], ref_norm, strict=True), 1):
        assert abs(a - b) <= 1e-3 * abs(b), f"step {step}: grad norm {a} vs single process {b}"
