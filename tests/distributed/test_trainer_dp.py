"""Data-parallel layouts give the single-process numbers (real torchrun + gloo, fp32).

How the comparison is set up: every run uses configs/tiny.yaml (tiny Llama, seq 32, seed 1234,
synthetic tokens, 6 steps) with a global batch of 4 samples per step:
  single process: train.batch_size 4            (dp 1)
  2 processes:    train.batch_size 2            (dp 2, 2 x 2 = 4)
  4 processes:    train.batch_size 1, 2x2 mesh  (dp 4)
Sample i of a global batch is the same in every layout (rank r takes samples [r*L, (r+1)*L)),
weights are initialised from the same seed before sharding, and the loss is the mean over the
global batch. We compare both the per-step loss and the pre-clip gradient norm: Adam is
invariant to a constant gradient scale, so a sum-instead-of-average gradient bug (the gloo
trap) barely moves the loss but doubles the gradient norm. The LR is high and clipping off so
any divergence grows over the steps instead of hiding.
"""

from __future__ import annotations

import pytest

from tests.support.trainer_run import read_metrics, run_trainer

COMMON = ("--config", "configs/tiny.yaml", "--train.steps", "6", "--optim.lr", "0.01", "--train.grad_clip", "0")
RTOL = 1e-5


def _series(out) -> tuple[list[float], list[float]]:
    m = read_metrics(out)
    assert [r["step"] for r in m] == list(range(1, len(m) + 1))
    return [r["loss"] for r in m], [r["grad_norm"] for r in m]


def _assert_close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b) == 6, (what, a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= RTOL * abs(y), f"{what} step {i + 1}: {x} vs {y} (rel {abs(x - y) / abs(y):.2e})"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run_trainer(out, *COMMON, "--train.batch_size", "4", "--train.microbatch_num", "1")
    losses, norms = _series(out)
    # sane numbers: near ln(vocab 512) = 6.24 at init, changing step to step, real gradients
    assert all(4.0 < x < 8.0 for x in losses) and len(set(losses)) == len(losses)
    assert all(n > 0.01 for n in norms)
    return losses, norms


@pytest.mark.multiproc
@pytest.mark.parametrize("sharding", ["ddp", "zero2", "zero3"])
def test_two_process_matches_single(tmp_path, reference, sharding):
    run_trainer(tmp_path, *COMMON, "--train.batch_size", "2", "--train.microbatch_num", "1",
                "--parallel.sharding", sharding, nproc=2)
    losses, norms = _series(tmp_path)
    _assert_close(losses, reference[0], f"{sharding} loss")
    _assert_close(norms, reference[1], f"{sharding} grad_norm")
    assert read_metrics(tmp_path)[0]["global_batch_samples"] == 4


@pytest.mark.multiproc
def test_hybrid_2x2_matches_single(tmp_path, reference):
    proc = run_trainer(tmp_path, *COMMON, "--train.batch_size", "1", "--train.microbatch_num", "1",
                       "--parallel.sharding", "zero3_hybrid", "--parallel.dp_shard", "2", nproc=4)
    assert "replicate 2 x shard 2" in proc.stdout
    losses, norms = _series(tmp_path)
    _assert_close(losses, reference[0], "zero3_hybrid loss")
    _assert_close(norms, reference[1], "zero3_hybrid grad_norm")


@pytest.mark.multiproc
# CI: ZeRO-3 (gradients reduce-scattered per microbatch); DDP and ZeRO-2 in the slow tier.
@pytest.mark.parametrize("sharding", [pytest.param("ddp", marks=pytest.mark.slow),
                                      pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_two_process_accumulation_matches_single(tmp_path, reference, sharding):
    # 2 ranks x 2 accumulated batches of 1 = the single process's batch of 4 (exercises no-sync paths)
    run_trainer(tmp_path, *COMMON, "--train.batch_size", "1", "--train.microbatch_num", "1",
                "--train.grad_acc_steps", "2", "--parallel.sharding", sharding, nproc=2)
    losses, norms = _series(tmp_path)
    _assert_close(losses, reference[0], f"{sharding}+accumulation loss")
    _assert_close(norms, reference[1], f"{sharding}+accumulation grad_norm")


@pytest.fixture(scope="module")
def reference8(tmp_path_factory):
    """Global batch 8: what 4 ranks x 2 accumulated batches of 1 add up to."""
    out = tmp_path_factory.mktemp("single8")
    run_trainer(out, *COMMON, "--train.batch_size", "8", "--train.microbatch_num", "1")
    return _series(out)


@pytest.mark.multiproc
@pytest.mark.slow  # hybrid is in CI without accumulation, accumulation under ZeRO-3 on 2 ranks
def test_hybrid_2x2_accumulation_matches_single(tmp_path, reference8):
    run_trainer(tmp_path, *COMMON, "--train.batch_size", "1", "--train.microbatch_num", "1",
                "--train.grad_acc_steps", "2", "--parallel.sharding", "zero3_hybrid", "--parallel.dp_shard", "2",
                nproc=4)
    losses, norms = _series(tmp_path)
    _assert_close(losses, reference8[0], "zero3_hybrid+accumulation loss")
    _assert_close(norms, reference8[1], "zero3_hybrid+accumulation grad_norm")


# Masked LM: ranks and microbatches hold DIFFERENT numbers of target tokens, so the loss must be
# the sum over the global batch divided by the global count, not an average of per-rank means.
BERT = ("--model.preset", "tiny-bert")


def test_bert_ranks_hold_unequal_target_counts():
    """The premise of the BERT tests below: otherwise they could not catch per-rank averaging."""
    from trainer.config import DataConfig
    from trainer.data.loader import DataStream

    def counts(rank: int) -> list[int]:
        stream = DataStream("masked_lm", DataConfig(seq_len=32), 1234, 2, rank, 2, vocab_size=512, mask_id=511)
        return [int((stream.next_batch()[1] != -100).sum()) for _ in range(6)]

    assert counts(0) != counts(1)


@pytest.fixture(scope="module")
def bert_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("bert-single")
    run_trainer(out, *COMMON, *BERT, "--train.batch_size", "4", "--train.microbatch_num", "1")
    return _series(out)


@pytest.mark.multiproc
@pytest.mark.parametrize("sharding,acc", [("ddp", 1), ("zero3", 2)])
def test_bert_two_process_matches_single(tmp_path, bert_reference, sharding, acc):
    run_trainer(tmp_path, *COMMON, *BERT, "--train.batch_size", str(2 // acc), "--train.microbatch_num", "1",
                "--train.grad_acc_steps", str(acc), "--parallel.sharding", sharding, nproc=2)
    losses, norms = _series(tmp_path)
    _assert_close(losses, bert_reference[0], f"bert {sharding} x{acc} loss")
    _assert_close(norms, bert_reference[1], f"bert {sharding} x{acc} grad_norm")


@pytest.mark.parametrize("args", [("--train.batch_size", "2", "--train.grad_acc_steps", "2", "--train.microbatch_num", "1"),
                                  ("--train.batch_size", "4", "--train.microbatch_num", "2")],
                         ids=["2x half batch", "2 microbatches"])
def test_accumulation_matches_full_batch(tmp_path, reference, args):
    run_trainer(tmp_path, *COMMON, *args)
    losses, norms = _series(tmp_path)
    _assert_close(losses, reference[0], "accumulated loss")
    _assert_close(norms, reference[1], "accumulated grad_norm")
