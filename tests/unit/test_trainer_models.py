"""Presets: parameter counts against the Merak table (meta device, nothing allocated), families build."""

from __future__ import annotations

import pytest
import torch

from contract.presets import EXPECTED_PARAMS_M, PRESETS
from trainer.config import ConfigError, ModelConfig
from trainer.models import build_model, model_spec, transformer_blocks
from trainer.models.build import Task


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS_M))
def test_merak_table_param_counts_within_1pct(name):
    got = model_spec(ModelConfig(preset=name)).num_params / 1e6
    want = EXPECTED_PARAMS_M[name]
    assert abs(got - want) / want < 0.01, f"{name}: {got:.2f}M vs Merak {want:.2f}M"


@pytest.mark.parametrize("name,lo,hi", [("smollm-135m", 130, 140), ("smollm-360m", 355, 370),
                                        ("smollm-1.7b", 1690, 1730), ("qwen3-0.6b", 590, 600),
                                        ("llama-20m", 18, 22), ("vitmae-stub", 600, 800)])
def test_real_architecture_sizes(name, lo, hi):
    assert lo <= model_spec(ModelConfig(preset=name)).num_params / 1e6 <= hi


def test_num_hidden_layers_override_and_stub_vitmae_shape():
    base = model_spec(ModelConfig(preset="qwen3-0.6b"))
    cut = model_spec(ModelConfig(preset="qwen3-0.6b", num_hidden_layers=4))
    assert cut.num_layers == 4 and cut.num_params < base.num_params
    c = model_spec(ModelConfig(preset="vitmae-stub")).hf_config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.image_size, c.patch_size,
            c.num_channels, c.mask_ratio, c.decoder_hidden_size, c.decoder_num_hidden_layers) == \
        (1280, 32, 16, 1920, 128, 1, 0.75, 512, 16)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gpt2", "tiny-bert", "tiny-vitmae"])
def test_tiny_families_build_identically_and_compute_a_loss(name):
    spec = model_spec(ModelConfig(preset=name))
    a, b = build_model(spec, ModelConfig(preset=name), 3), build_model(spec, ModelConfig(preset=name), 3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert len(transformer_blocks(a)) >= 2
    task = Task(spec.task)
    if spec.task == "mae":
        c = spec.hf_config
        x = torch.randn(2, c.num_channels, c.image_size, c.image_size)
        y = torch.rand(2, (c.image_size // c.patch_size) ** 2)
    else:
        x = torch.randint(0, spec.hf_config.vocab_size, (2, 16))
        y = torch.randint(0, spec.hf_config.vocab_size, (2, 16))
    loss = task.loss_sum(a, x, y) / task.weight(x, y)
    assert torch.isfinite(loss) and loss.item() > 0


def test_bad_override_is_a_config_error():
    with pytest.raises(ConfigError, match="hidden_size"):
        model_spec(ModelConfig(preset="tiny-gpt2", hidden_size=66))


def test_every_preset_has_a_family():
    assert {p.family for p in PRESETS.values()} <= {"llama", "qwen2", "qwen3", "gpt2", "bert", "vitmae", "t5", "bloom",
                                                    "wide_resnet"}
