"""The Perseus + Merak families (T5, BLOOM, Wide-ResNet): Merak's item counting against the counts
its scripts set, the guide's partitions read as Merak meant them, stage splits equal to the full
model, their data, and the bad-input messages. No processes; models on the meta device or tiny."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, DataConfig, ModelConfig
from trainer.config.partition import PartitionError, describe_custom, format_ranges, partition_layers
from trainer.models.build import build_hf_config, build_model, model_spec
from trainer.models.layout import layout_of, model_layout
from trainer.models.lm_loss import install_loss_forward
from trainer.parallel.stages import chain_forward, split_model


def layout(name: str):
    family, hf = build_hf_config(ModelConfig(preset=name))
    return model_layout(family, hf, name)


def bounds(ranges):
    return [r.start for r in ranges] + [ranges[-1].end]


# Merak's counts: its run_*.py scripts set shard_count (BERT/BLOOM L+2, GPT L+3, T5 100, Wide-ResNet
# depth x 10) and graph_shard.py packs; `uniform_transformer` asserts the BERT/BLOOM/GPT counts.
@pytest.mark.parametrize("name,items,units", [
    ("t5-small", 32, 12), ("t5-base", 62, 24), ("t5-large", 74, 48), ("t5-3b", 74, 48), ("t5-11b", 74, 48),
    ("bloom-560m", 26, 24), ("bloom-3b", 32, 30), ("bloom-7b1", 32, 30),
    ("wide-resnet50_2", 17, 16), ("wide-resnet50_8", 17, 16), ("wide-resnet101_2", 34, 33),
    ("wide-resnet101_8", 34, 33), ("gpt3-xl", 27, 24), ("gpt3-2.7b", 35, 32), ("bert-huge-uncased", 26, 24),
])
def test_merak_item_counts(name, items, units):
    c = layout(name).counting
    assert (c.items, c.units) == (items, units)


def test_t5_3b_items_are_embedding_encoder_blocks_decoder_halves_head():
    c = layout("t5-3b").counting
    assert c.item_labels[:2] == ("shared embedding", "encoder 0")
    assert c.item_labels[24:27] == ("encoder 23", "decoder 0 self attention + decoder 0 cross attention",
                                    "decoder 0 FFN")
    assert c.item_labels[-1] == "norm + head"
    # a decoder block starts a stage only at its first item
    assert c.item_starts[25:29] == (24, None, 25, None)
    small = layout("t5-small").counting  # every residual sublayer is an item at this size
    assert small.item_labels[13:16] == ("decoder 0 self attention", "decoder 0 cross attention", "decoder 0 FFN")


# The guide's ten commands: the stage layout each partition string means.
PAPER = [
    ("bert-huge-uncased", "custom:0,8,14,20,26", 4, [0, 7, 13, 19, 24]),
    ("bloom-3b", "custom:0,10,18,26,32", 4, [0, 9, 17, 25, 30]),
    ("gpt3-xl", "custom:0,8,14,21,27", 4, [0, 6, 12, 19, 24]),
    ("t5-3b", "custom:0,16,33,53,74", 4, [0, 15, 28, 38, 48]),
    ("wide-resnet101_8", "custom:0,7,16,25,34", 4, [0, 7, 16, 25, 33]),
    ("bert-huge-uncased", "uniform_transformer", 8, [0, 3, 6, 9, 12, 15, 18, 21, 24]),
    ("bloom-3b", "custom:0,6,10,14,18,22,26,30,32", 8, [0, 5, 9, 13, 17, 21, 25, 29, 30]),
    ("gpt3-2.7b", "uniform_transformer", 8, [0, 4, 8, 12, 16, 20, 24, 28, 32]),
    ("t5-3b", "custom:0,9,16,24,33,43,53,63,74", 8, [0, 8, 15, 23, 28, 33, 38, 43, 48]),
    ("wide-resnet101_8", "custom:0,4,9,13,17,21,25,30,34", 8, [0, 4, 9, 13, 17, 21, 25, 30, 33]),
]


@pytest.mark.parametrize("name,part,pp,expected", PAPER)
def test_paper_partitions_mean_what_they_meant_in_merak(name, part, pp, expected):
    lay = layout(name)
    ranges = partition_layers(part, lay.num_units, pp, layer_params=lay.unit_weights(), counting=lay.counting)
    assert bounds(ranges) == expected


def test_t5_3b_four_stage_plan_names_what_each_stage_holds():
    lay = layout("t5-3b")
    ranges = partition_layers("custom:0,16,33,53,74", 48, 4, counting=lay.counting)
    text = format_ranges(ranges, 4, describe=lay.describe, first=lay.first_name, last=lay.last_name, noun="blocks")
    assert text.splitlines() == [
        "stage 0 (pp rank 0): embedding + encoder 0-14 (15 blocks)",
        "stage 1 (pp rank 1): encoder 15-23 + decoder 0-3 (13 blocks)",
        "stage 2 (pp rank 2): decoder 4-13 (10 blocks)",
        "stage 3 (pp rank 3): decoder 14-23 + norm + head (10 blocks)",
    ]
    assert describe_custom("custom:0,16,33,53,74", 48, 4, lay.counting) == (
        "custom:0,16,33,53,74 ends at 74, t5-3b's Merak item count (item 0 shared embedding, items 1-24 encoder "
        "0-23, items 25-72 decoder 0-23 (2 items each), item 73 norm + head): read as item boundaries, i.e. "
        "blocks custom:0,15,28,38,48")


def test_partition_errors_name_both_counts_and_the_nearest_legal_boundaries():
    lay = layout("t5-3b")
    with pytest.raises(PartitionError) as e:
        partition_layers("custom:0,16,33,53,70", 48, 4, counting=lay.counting)
    assert str(e.value) == ("parallel.partition: custom:0,16,33,53,70 must start at 0 and end at 48 (blocks) or 74 "
                            "(Merak's items); t5-3b has 74 Merak items or 48 blocks")
    with pytest.raises(PartitionError) as e:  # between decoder 4's attention and its FFN
        partition_layers("custom:0,16,34,53,74", 48, 4, counting=lay.counting)
    assert str(e.value) == ("parallel.partition: custom:0,16,34,53,74: item 34 (decoder 4 FFN) cannot start a stage "
                            "(it continues item 33, decoder 4 self attention + decoder 4 cross attention); the "
                            "nearest legal boundaries are 33 or 35")
    # the same split in blocks is accepted as such
    assert bounds(partition_layers("custom:0,15,28,38,48", 48, 4, counting=lay.counting)) == [0, 15, 28, 38, 48]


def test_unknown_model_lists_close_names():
    from trainer.config import resolve

    for wrong, close in [("wide-resnet101-8", "wide-resnet101_8"), ("t5-3B", "t5-3b"), ("bloom3b", "bloom-3b")]:
        with pytest.raises(ConfigError) as e:
            resolve(None, [("model.preset", wrong), ("train.steps", 1)], environ={})
        msg = str(e.value)
        assert msg.startswith(f"model.preset: unknown preset '{wrong}' (did you mean ") and close in msg, msg
        assert "\n" not in msg


def test_family_overrides_map_to_the_family_fields():
    _, t5 = build_hf_config(ModelConfig(preset="t5-small", num_hidden_layers=2, intermediate_size=128))
    assert (t5.num_layers, t5.num_decoder_layers, t5.d_ff) == (2, 2, 128)
    with pytest.raises(ConfigError, match="model.intermediate_size: bloom has no such setting"):
        build_hf_config(ModelConfig(preset="tiny-bloom", intermediate_size=64))
    with pytest.raises(ConfigError, match="model.hidden_size: wide_resnet has no such setting"):
        build_hf_config(ModelConfig(preset="tiny-wide-resnet", hidden_size=64))
    _, wrn = build_hf_config(ModelConfig(preset="tiny-wide-resnet", hf_overrides={"num_classes": 7}))
    assert wrn.num_classes == 7


def test_wide_resnet_flops_are_torchvisions():
    from trainer.models.wide_resnet import WideResNetConfig, train_flops_per_image

    # torchvision's model table: wide_resnet50_2 11.40 GFLOPS (multiply-adds), wide_resnet101_2 22.75
    assert round(train_flops_per_image(WideResNetConfig(layers=[3, 4, 6, 3])) / 6e9, 2) == 11.40
    assert round(train_flops_per_image(WideResNetConfig(layers=[3, 4, 23, 3])) / 6e9, 2) == 22.75


# ------------------------------------------------------------------ stages = the full model


def _tiny(name: str):
    mcfg = ModelConfig(preset=name)
    spec = model_spec(mcfg)
    model = build_model(spec, mcfg, 0).eval()
    install_loss_forward(model, 1)
    g = torch.Generator().manual_seed(1)
    if spec.task == "image":
        size = spec.hf_config.image_size
        return model, torch.randn(2, 3, size, size, generator=g), torch.tensor([1, 7])
    return model, torch.randint(0, 512, (2, 12), generator=g), torch.randint(0, 512, (2, 12), generator=g)


@pytest.mark.parametrize("name,part", [
    # T5: every payload (encoder hidden + bias, encoder output at the stack boundary, decoder hidden +
    # encoder output + bias), an embedding-only first stage and a head-only last stage
    ("tiny-t5", "custom:0,1,2,3,4"), ("tiny-t5", "custom:0,1,3,12"), ("tiny-t5", "custom:0,1,11,12"),
    ("tiny-bloom", "custom:0,1,3,4"), ("tiny-wide-resnet", "custom:0,1,3,4"), ("tiny-wide-resnet", "custom:0,4,5"),
])
def test_stages_chained_equal_the_full_model_bitwise(name, part):
    model, x, y = _tiny(name)
    with torch.no_grad():
        ref = model(pixel_values=x, targets=y) if name == "tiny-wide-resnet" else model(input_ids=x, targets=y)
        lay = layout_of(model, name)
        n = len(part.split(",")) - 1
        stages, tied = split_model(model, partition_layers(part, lay.num_units, n, counting=lay.counting))
        out = chain_forward([stages[i] for i in range(n)], x, targets=y)
    assert torch.equal(ref, out)
    names = set().union(*(dict(stages[i].named_parameters()) for i in range(n)))
    assert names <= set(dict(model.named_parameters(remove_duplicate=False)))  # the full model's names
    if name == "tiny-t5":  # the shared embedding: copies on the first decoder stage and the last
        holders = sorted({s for s, _ in tied.groups[0]})
        assert holders[0] == 0 and holders[-1] == n - 1 and len(tied.groups) == 1


# ------------------------------------------------------------------ data


def test_seq2seq_and_image_data():
    from trainer.data.loader import build_data
    from trainer.models.t5 import shift_right

    hf = build_hf_config(ModelConfig(preset="tiny-t5"))[1]
    data = build_data(DataConfig(seq_len=8), "seq2seq", hf, 0, 2, 0, 1)
    x, y = data.next_batch()
    assert x.shape == y.shape == (2, 8)
    # one arithmetic sequence per sample: the labels continue the input
    assert torch.equal((y[:, 0] - x[:, -1]) % 512, (x[:, 1] - x[:, 0]) % 512)
    dec = shift_right(y, hf)
    assert torch.equal(dec[:, 1:], y[:, :-1]) and (dec[:, 0] == 0).all()
    assert shift_right(torch.tensor([[5, -100, 7]]), hf).tolist() == [[0, 5, 0]]  # -100 read as padding

    wrn = build_hf_config(ModelConfig(preset="wide-resnet101_8"))[1]
    images = build_data(DataConfig(), "image", wrn, 0, 3, 0, 1)
    x, y = images.next_batch()
    assert x.shape == (3, 3, 224, 224) and y.dtype == torch.long and ((0 <= y) & (y < 1000)).all()
    again = build_data(DataConfig(), "image", wrn, 0, 3, 0, 1).next_batch()
    assert torch.equal(again[0], x) and torch.equal(again[1], y)


def test_t5_text_blocks_are_input_then_target():
    """Text for T5: packed blocks of 2 x seq_len tokens, the first half the encoder's input, the
    second the target (the same packing as the causal LMs, one block per sample)."""
    from tests.support.trainer_run import REPO
    from trainer.data.loader import build_data, load_texts, load_tokenizer, pack

    dcfg = DataConfig(source=str(REPO / "trainer" / "corpus" / "corpus.txt"), seq_len=16, tokenizer_vocab_size=300)
    texts = load_texts(dcfg)
    tok = load_tokenizer(dcfg, texts)
    hf = build_hf_config(ModelConfig(preset="tiny-t5"), tok.vocab_size)[1]
    data = build_data(dcfg, "seq2seq", hf, 0, 4, 0, 1, tok, texts)
    blocks = {tuple(b.tolist()) for b in pack(tok.encode_batch(texts), tok.eos_id, 32)}
    x, y = data.next_batch()
    assert x.shape == y.shape == (4, 16)
    assert all(tuple(torch.cat([a, b]).tolist()) in blocks for a, b in zip(x, y, strict=True))


def test_image_folder(tmp_path):
    from PIL import Image

    from trainer.data.loader import build_data

    for c, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / c).mkdir()
        for i in range(3):
            Image.new("RGB", (40 + 8 * i, 30), color).save(tmp_path / c / f"{i}.png")
    (tmp_path / "notes.txt").write_text("not an image class")
    hf = build_hf_config(ModelConfig(preset="tiny-wide-resnet"))[1]
    data = build_data(DataConfig(source=str(tmp_path), eval_fraction=1 / 3), "image", hf, 0, 2, 0, 1)
    assert data.images.classes == ["cat", "dog"] and len(data.images.train_files) == 4
    assert data.steps_per_epoch == 2
    seen = []
    for _ in range(2):
        x, y = data.next_batch()
        assert x.shape == (2, 3, 64, 64)
        for img, label in zip(x, y, strict=True):
            red = img[0].mean() > img[2].mean()  # normalised: the class's colour dominates its channel
            assert red == (int(label) == 0)
            seen.append(int(label))
    assert sorted(seen) == sorted(lbl for _, lbl in data.images.train_files)  # one epoch: each image once
    with pytest.raises(ConfigError, match="has 2 classes but the model has 1"):
        build_data(DataConfig(source=str(tmp_path)), "image",
                   build_hf_config(ModelConfig(preset="tiny-wide-resnet", hf_overrides={"num_classes": 1}))[1],
                   0, 2, 0, 1)
