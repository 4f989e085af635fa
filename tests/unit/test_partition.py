"""Partition methods, stage splitting and up-front pipeline/TP constraint errors (no processes)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from contract.schedules import stage_to_rank
from trainer.config.partition import (
    PartitionError,
    describe_custom,
    format_ranges,
    partition_layers,
)
from trainer.parallel.pipeline import PipelineError, check_schedule, schedule_spec
from trainer.parallel.stages import chain_forward, split_model
from trainer.parallel.tensor_parallel import TensorParallelError, check_tp


def bounds(ranges):
    return [r.start for r in ranges] + [ranges[-1].end]


def test_custom_is_the_seed_layout():
    r = partition_layers("custom:0,7,21,28", 28, 3)
    assert [(x.start, x.end) for x in r] == [(0, 7), (7, 21), (21, 28)]
    text = format_ranges(r, 3)
    assert text.splitlines() == [
        "stage 0 (pp rank 0): embeddings + layers 0-6 (7 layers)",
        "stage 1 (pp rank 1): layers 7-20 (14 layers)",
        "stage 2 (pp rank 2): layers 21-27 + norm + head (7 layers)",
    ]


def test_uniform_transformer_gives_remainder_to_early_stages():
    assert bounds(partition_layers("uniform_transformer", 10, 3)) == [0, 4, 7, 10]
    assert bounds(partition_layers("uniform_transformer", 28, 4)) == [0, 7, 14, 21, 28]


def test_uniform_counts_embeddings_and_head_as_items():
    # 28 layers + embeddings + head = 30 items -> 10 per stage.
    assert bounds(partition_layers("uniform", 28, 3)) == [0, 9, 19, 28]
    assert bounds(partition_layers("uniform", 8, 2)) == [0, 4, 8]


def test_parameters_moves_layers_away_from_heavy_embedding_stages():
    # Embeddings and head each weigh as much as 10 layers: the middle stage takes more layers.
    r = partition_layers("parameters", 28, 3, layer_params=10, embed_params=100, head_params=100)
    counts = [x.num_layers for x in r]
    assert sum(counts) == 28 and counts[1] > counts[0] and counts[1] > counts[2]
    assert bounds(r) == [0, 6, 22, 28]
    # With negligible embeddings it is uniform.
    assert bounds(partition_layers("parameters", 12, 3, layer_params=10)) == [0, 4, 8, 12]


def test_weighted_gives_faster_nodes_more_layers():
    assert bounds(partition_layers("weighted:2,1", 9, 2)) == [0, 6, 9]
    assert bounds(partition_layers("weighted:1.5,1,1", 28, 3)) == [0, 12, 20, 28]
    assert [x.num_layers for x in partition_layers("weighted:100,1,1", 6, 3)] == [4, 1, 1]


@pytest.mark.parametrize("method,fragment", [
    ("custom:0,7,28", "has 3 boundaries but 3 stages need 4"),
    ("custom:1,7,21,28", "must start at 0 and end at 28 (layers) or 30 (Merak's items)"),
    ("custom:0,7,21,27", "must start at 0 and end at 28 (layers) or 30 (Merak's items)"),
    ("custom:0,7,7,28", "strictly increasing"),
    ("custom:a,b,c,d", "comma-separated integers"),
    ("weighted:1,2", "has 2 weights but there are 3 stages"),
    ("weighted:1,0,1", "must be positive"),
    ("balanced", "unknown partition method 'balanced'"),
])
def test_partition_errors_are_one_line(method, fragment):
    with pytest.raises(PartitionError) as e:
        partition_layers(method, 28, 3)
    msg = str(e.value)
    assert fragment in msg and "\n" not in msg and msg.startswith("parallel.partition")


@pytest.mark.parametrize("method", ["custom:0,7,28", "custom:0,7,21,27", "custom:0,7,21,29", "custom:0,7,21,31"])
def test_custom_count_errors_name_both_accepted_endings(method):
    """Any other last boundary: the error names the layer count and the model's Merak item count."""
    with pytest.raises(PartitionError) as e:
        partition_layers(method, 28, 3)
    msg = str(e.value)
    assert "28 (layers) or 30 (Merak's items); the model has 30 Merak items or 28 layers" in msg


def test_custom_merak_item_counts_are_read_and_said():
    from trainer.models.layout import layout_of

    # Perseus' gpt3-xl spelling: Merak's GPT items are wte, wpe, the blocks, ln_f + head (L + 3).
    gpt = layout_of(tiny("gpt2", layers=24), "gpt3-xl").counting
    assert (gpt.items, gpt.units) == (27, 24)
    ranges = partition_layers("custom:0,8,14,21,27", 24, 4, counting=gpt)
    assert bounds(ranges) == [0, 6, 12, 19, 24] == bounds(partition_layers("custom:0,6,12,19,24", 24, 4))
    assert describe_custom("custom:0,8,14,21,27", 24, 4, gpt) == (
        "custom:0,8,14,21,27 ends at 27, gpt3-xl's Merak item count (item 0 wte, item 1 wpe, items 2-25 layers "
        "0-23, item 26 norm + head): read as item boundaries, i.e. layers custom:0,6,12,19,24")
    # BERT's (embeddings and head one item each): L+2, the default counting.
    assert bounds(partition_layers("custom:0,8,14,20,26", 24, 4)) == [0, 7, 13, 19, 24]
    assert "ends at 26, the model's Merak item count" in describe_custom("custom:0,8,14,20,26", 24, 4)
    # The layer spelling needs no note; item 1 (wpe) cannot start a stage: the nearest legal items are named.
    assert describe_custom("custom:0,6,12,19,24", 24, 4, gpt) is None
    with pytest.raises(PartitionError, match=r"item 1 \(wpe\) cannot start a stage .* the nearest legal "
                                             r"boundaries are 2$"):
        partition_layers("custom:0,1,14,21,27", 24, 4, counting=gpt)
    # Embeddings alone on the first stage (item 2 = block 0 starts stage 1) is a legal Merak split.
    assert bounds(partition_layers("custom:0,2,14,27", 24, 3, counting=gpt)) == [0, 0, 12, 24]


def test_split_for_pipeline_logs_the_merak_reading(caplog):
    from trainer.parallel.pipeline import split_for_pipeline

    model = tiny("gpt2", layers=4)
    logger = logging.getLogger("trainer.parallel.pipeline")
    logger.addHandler(caplog.handler)  # directly: the trainer's loggers may not propagate to root
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            split_for_pipeline(model, schedule_spec("gpipe"), "custom:0,2,4,7", 0, 3, 1)
    finally:
        logger.removeHandler(caplog.handler)
    assert "custom:0,2,4,7 ends at 7, gpt2's Merak item count (item 0 wte, item 1 wpe, items 2-5 layers 0-3, " \
        "item 6 norm + head): read as item boundaries, i.e. layers custom:0,0,2,4" in caplog.text
    assert "stage 0 (pp rank 0): embeddings (0 layers" in caplog.text
    assert "stage 1 (pp rank 1): layers 0-1 (2 layers" in caplog.text


def test_v_placement_zigzags():
    assert [stage_to_rank(s, 2, 4, "v") for s in range(4)] == [0, 1, 1, 0]
    assert [stage_to_rank(s, 2, 4) for s in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("args,fragment", [
    (("1f1b", 4, 1, 2, 8), "1f1b needs at least as many microbatches as stages (2 < 4)"),
    (("gpipe", 2, 2, 4, 8), "gpipe runs one stage per rank"),
    (("interleaved1f1b", 2, 1, 4, 8), "needs at least 2 stages per rank"),
    (("interleaved1f1b", 4, 2, 9, 16), "or a multiple of 2 (got 9)"),
    (("zbv", 2, 3, 8, 12), "needs exactly 2 stages per rank"),
    (("dualpipev", 2, 2, 3, 8), "at least as many microbatches as stages (3 < 4"),
    (("1f1b", 4, 1, 4, 3), "3 layers cannot fill 4 stages"),
    (("pipedream", 2, 1, 4, 8), "unknown schedule 'pipedream'"),
])
def test_schedule_constraints_are_one_line(args, fragment):
    with pytest.raises(PipelineError) as e:
        check_schedule(*args)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_schedule_aliases():
    assert schedule_spec("afab").name == "gpipe"
    assert schedule_spec("GPipe").torch_name == "GPipe"
    assert schedule_spec("interleaved_1f1b").name == "interleaved1f1b"
    assert check_schedule("interleaved1f1b", 2, 2, 4, 4).multi


def tiny(family: str, layers: int = 4):
    import transformers

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=32)
    if family == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, **common)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(num_key_value_heads=2, **common)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, **common)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=layers, n_head=4, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        cfg = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
    torch.manual_seed(0)
    if family == "bert":
        return transformers.BertForMaskedLM(cfg)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2", "bert"])
def test_stages_chained_are_bit_identical_to_the_full_model(family):
    model = tiny(family).eval()
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=x).logits
        stages, tied = split_model(model, partition_layers("custom:0,1,3,4", 4, 3))
        with warnings.catch_warnings():  # the stages call their layers as transformers asks now
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            out = chain_forward([stages[i] for i in range(3)], x)
    assert torch.equal(ref, out)
    # Embeddings only on the first stage, head only on the last, names as in the full model.
    names = [set(dict(stages[i].named_parameters())) for i in range(3)]
    assert not any("embed" in n or "wte" in n for n in names[1] | names[2] if "lm_head" not in n
                   and "decoder" not in n)
    if family in ("qwen3", "gpt2", "bert"):  # tied embedding/head: the last stage holds a copy
        assert len(tied.groups) == 1 and [s for s, _ in tied.groups[0]] == [0, 2]
    else:
        assert tied.groups == []


def test_tp_divisibility_errors():
    cfg = tiny("llama").config
    check_tp(cfg, 2)
    with pytest.raises(TensorParallelError, match="num_key_value_heads=2 is not divisible by tp=4"):
        check_tp(cfg, 4)
    with pytest.raises(TensorParallelError, match="num_attention_heads=4 is not divisible by tp=3"):
        check_tp(cfg, 3)
    cfg.vocab_size = 95
    with pytest.raises(TensorParallelError, match="vocab_size=95 is not divisible by tp=2"):
        check_tp(cfg, 2)
    with pytest.raises(TensorParallelError, match="GPT-2"):
        check_tp(tiny("gpt2").config, 2)


def test_seed_000_config_resolves_to_the_guide_layout():
    from pathlib import Path

    import transformers

    from trainer.config import resolve
    from trainer.config.partition import StageRange
    from trainer.models.build import build_hf_config
    from trainer.parallel.compose import check_supported

    path = Path(__file__).resolve().parents[2] / "configs" / "pi-qwen3-3stage.yaml"
    cfg = resolve(str(path), [], environ={})
    check_supported(cfg)
    p, t = cfg.parallel, cfg.train
    assert (p.pp, p.pp_schedule, t.batch_size, t.microbatch_num, cfg.data.seq_len, cfg.optim.lr) == \
        (3, "1f1b", 16, 4, 128, 1e-4)
    _, hf = build_hf_config(cfg.model)
    assert (hf.num_hidden_layers, hf.hidden_size, hf.vocab_size) == (28, 1024, 151936)
    ranges = partition_layers(p.partition, hf.num_hidden_layers, p.pp)
    assert ranges == [StageRange(0, 0, 7), StageRange(1, 7, 21), StageRange(2, 21, 28)]
    # Split the real architecture on the meta device: stage sizes as on the three Pis.
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(hf)
    stages, tied = split_model(model, ranges)
    sizes = [sum(q.numel() for q in stages[i].parameters()) / 1e6 for i in range(3)]
    assert [round(s) for s in sizes] == [266, 220, 266]  # the tied 155.6M embedding is copied to stage 2
    assert [s for s, _ in tied.groups[0]] == [0, 2]
    # `parameters` on the same model: the heavy embedding/head stages take fewer layers.
    from trainer.parallel.pipeline import plan_ranges

    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(hf)
    assert bounds(plan_ranges(model, "parameters", 3)) == [0, 6, 22, 28]
