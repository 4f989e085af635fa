"""Tensor parallel (DTensor plans) through the real `trainer` entry point equals a single process."""

from __future__ import annotations

import pytest

from tests.support.parallel_equiv import assert_equivalent, run_layout

pytestmark = pytest.mark.multiproc


def test_tp2_tied_qwen3(tmp_path):
    # Vocab-parallel embedding and head share one sharded weight; q/k/v/o and MLP split by heads.
    m = run_layout(tmp_path, "qwen3", 2, "--parallel.tp", "2")
    assert_equivalent(m, "qwen3")
    assert "TP over 2 ranks" in (tmp_path / "logs" / "rank0.log").read_text()


def test_tp2_x_dp2_zero3(tmp_path):
    m = run_layout(tmp_path, "llama", 4, "--parallel.tp", "2", "--parallel.sharding", "zero3", dp=2)
    assert_equivalent(m, "llama")
