"""Pipeline parallel through the real `trainer` entry point equals a single process.

Each test runs 4 steps of a tiny model under torchrun on gloo and compares per-step losses
(1e-5 relative) and clipped gradient norms with the single-process run of the same seed and
global batch (tests/support/parallel_equiv.py).
"""

from __future__ import annotations

import pytest

from tests.support.parallel_equiv import MODELS, assert_equivalent, common, run_layout
from tests.support.trainer_run import read_metrics, run_trainer

pytestmark = pytest.mark.multiproc


# GPipe against one process is in CI through the Perseus families (pp=4) and the Perseus loop.
@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_pp2_single_stage_schedules(tmp_path, schedule):
    m = run_layout(tmp_path, "llama", 2, "--parallel.pp", "2", "--parallel.pp_schedule", schedule)
    assert_equivalent(m, "llama")


def test_pp2_interleaved_two_virtual_stages(tmp_path):
    m = run_layout(tmp_path, "llama", 2, "--parallel.pp", "2", "--parallel.pp_schedule", "interleaved1f1b",
                   "--parallel.virtual_stages", "2")
    assert_equivalent(m, "llama")
    # The plan printed at start: 4 stages round-robin over 2 ranks.
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "stage 2 (pp rank 0): layer 2 (1 layers" in log


# CI: zbv (first and last stage on rank 0); dualpipev and interleaved_zb in the slow tier.
@pytest.mark.parametrize("schedule", ["zbv", pytest.param("dualpipev", marks=pytest.mark.slow),
                                      pytest.param("interleaved_zb", marks=pytest.mark.slow)])
def test_pp2_zero_bubble_with_tied_embeddings(tmp_path, schedule):
    # zbv/dualpipev place the first and last stage (embedding and its tied head) both on rank 0;
    # interleaved_zb on different ranks. Weight gradients are computed in separate W steps.
    m = run_layout(tmp_path, "qwen3", 2, "--parallel.pp", "2", "--parallel.pp_schedule", schedule,
                   "--parallel.virtual_stages", "2")
    assert_equivalent(m, "qwen3")


def test_pp3_1f1b_seed_layout_reduced(tmp_path):
    # Seed 000 splits Qwen3's 28 layers 7 | 14 | 7 (custom:0,7,21,28); the same shape on 4 layers.
    m = run_layout(tmp_path, "qwen3", 3, "--parallel.pp", "3", "--parallel.pp_schedule", "1f1b",
                   "--parallel.partition", "custom:0,1,3,4")
    assert_equivalent(m, "qwen3")
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "stage 0 (pp rank 0): embeddings + layer 0 (1 layers" in log
    assert "stage 1 (pp rank 1): layers 1-2 (2 layers" in log
    assert "stage 2 (pp rank 2): layer 3 + norm + head (1 layers" in log


def test_pp2_bert_masked_lm(tmp_path):
    m = run_layout(tmp_path, "bert", 2, "--parallel.pp", "2", "--parallel.pp_schedule", "1f1b")
    assert_equivalent(m, "bert")


@pytest.mark.parametrize("args,fragment", [
    (("--parallel.pp", "2", "--train.microbatch_num", "1"), "1f1b needs at least as many microbatches as stages"),
    (("--parallel.pp", "3", "--parallel.partition", "custom:0,2,4"), "has 3 boundaries but 3 stages need 4"),
    (("--parallel.pp", "2", "--parallel.partition", "custom:0,1,3"), "must start at 0 and end at 4 (layers) or 6 (Merak's items)"),
    (("--parallel.pp", "2", "--parallel.pp_schedule", "interleaved1f1b"), "needs at least 2 stages per rank"),
    (("--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--parallel.virtual_stages", "2",
      "--train.microbatch_num", "2"), "zbv needs at least as many microbatches as stages (2 < 4"),
    (("--parallel.pp", "8", "--parallel.pp_schedule", "gpipe"), "4 layers cannot fill 8 stages"),
    (("--parallel.pp", "2", "--parallel.pp_schedule", "pipedream"), "unknown schedule 'pipedream'"),
    (("--parallel.virtual_stages", "2"), "virtual_stages 2 needs pipeline parallelism"),
    (("--parallel.tp", "3"), "num_attention_heads=4 is not divisible by tp=3"),
    (("--parallel.tp", "4"), "num_key_value_heads=2 is not divisible by tp=4"),
])
def test_constraint_violation_is_one_line(args, fragment):
    # Checked from the config alone, before any process group exists.
    from trainer.config import ConfigError, resolve
    from trainer.config.argv import parse_train_args
    from trainer.parallel.compose import check_supported

    path, overrides = parse_train_args([*MODELS["llama"], *common(8, 1, 4), *args])
    with pytest.raises(ConfigError) as e:
        check_supported(resolve(path, overrides, environ={}))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_cli_reports_a_pipeline_error_in_one_line(tmp_path):
    # Three ranks, so the world fits pp=3 and the partition itself is what is refused: each rank that
    # gets to say it says it in exactly one line, and none dumps a traceback (torchrun's own summary
    # aside). Not always all three: torchrun stops the others once the first one exits (seen in CI:
    # rank 1 exited, ranks 0 and 2 were SIGTERMed, two lines).
    proc = run_trainer(tmp_path, *MODELS["llama"], *common(8, 1, 4), "--parallel.pp", "3",
                       "--parallel.partition", "custom:0,2,4", nproc=3, check=False)
    assert proc.returncode != 0
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(err) <= 3 and set(err) == {
        "error: parallel.partition: custom:0,2,4 has 3 boundaries but 3 stages need 4: first 0, last "
        "4 (layers) or 6 (Merak's items); tiny-llama has 6 Merak items or 4 layers"}, proc.stderr[-2000:]
    assert not [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]


def test_pp2_text_data_with_eval_equals_single_process(tmp_path):
    # Tied GPT-2 on the shipped corpus (trained BPE), evaluation every 2 steps through the pipeline:
    # evaluation must not disturb the next training step.
    args = ("--config", "configs/tiny-text.yaml", "--model.num_hidden_layers", "4", "--train.steps", "4",
            "--train.microbatch_num", "2", "--train.eval_interval", "2")
    run_trainer(tmp_path / "ref", *args)
    run_trainer(tmp_path / "pp", *args, "--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", nproc=2)
    ref, pp = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "pp")
    for key in ("loss", "eval_loss"):
        a = [r[key] for r in ref if key in r]
        b = [r[key] for r in pp if key in r]
        assert len(a) == len(b) == (4 if key == "loss" else 2)
        assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (key, a, b)
