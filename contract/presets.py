"""Named model presets: a model family plus config fields. Nothing is downloaded. Torch-free: the
trainer builds them (trainer/models/build.py), the runner sizes a job's stages from them.

Families map to model classes in build.py. Sizes of the Merak presets follow Merak's
`load_gpt3_config`/`load_bert_config` (GPT-2 architecture with GPT-3 widths; BERT MLM), the public
t5-* and bigscience/bloom-* configs, and torchvision's wide_resnet{50,101}_{2,4,8};
`EXPECTED_PARAMS_M` is the Perseus/Merak README table (and the public counts where it says only
"3B"/"11B") they must match within 1 %.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    family: str                          # llama | qwen2 | qwen3 | gpt2 | bert | vitmae | t5 | bloom | wide_resnet
    config: dict[str, Any] = field(default_factory=dict)


def _gpt3(n_embd: int, n_layer: int, n_head: int, **extra: Any) -> Preset:
    # Merak starts from the `gpt2` config: vocab 50257, 1024 positions, 4x MLP.
    return Preset("gpt2", dict(vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer,
                               n_head=n_head, **extra))


def _bert(hidden: int, layers: int, heads: int, inter: int) -> Preset:
    return Preset("bert", dict(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=heads, intermediate_size=inter,
                               max_position_embeddings=512, type_vocab_size=2))


def _smollm(hidden: int, layers: int, heads: int, kv: int, inter: int) -> Preset:
    return Preset("llama", dict(vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                                max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                                tie_word_embeddings=True))


def _t5(d_model: int, d_ff: int, d_kv: int, heads: int, layers: int) -> Preset:
    # The public t5-* checkpoints' configs: relu FFN, 32 relative-position buckets, tied embeddings.
    return Preset("t5", dict(vocab_size=32128, d_model=d_model, d_ff=d_ff, d_kv=d_kv, num_heads=heads,
                             num_layers=layers, num_decoder_layers=layers, feed_forward_proj="relu",
                             relative_attention_num_buckets=32, tie_word_embeddings=True,
                             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _bloom(hidden: int, layers: int, heads: int) -> Preset:
    # bigscience/bloom-*: ALiBi positions, 4x GELU MLP, tied embeddings, vocabulary 250880.
    return Preset("bloom", dict(vocab_size=250880, hidden_size=hidden, n_layer=layers, n_head=heads,
                                layer_norm_epsilon=1e-5, tie_word_embeddings=True))


def _wide_resnet(depth: int, k: int) -> Preset:
    # torchvision's wide_resnet{50,101}_{k}: ResNet(Bottleneck, layers, width_per_group=64 k).
    return Preset("wide_resnet", dict(layers={50: [3, 4, 6, 3], 101: [3, 4, 23, 3]}[depth], width_factor=k,
                                      num_classes=1000, image_size=224, num_channels=3))


_TINY_LM = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)

PRESETS: dict[str, Preset] = {
    # tiny sizes for tests and quick demos
    "tiny-llama": Preset("llama", dict(_TINY_LM, tie_word_embeddings=False)),
    "tiny-qwen2": Preset("qwen2", dict(_TINY_LM, tie_word_embeddings=False)),
    "tiny-qwen3": Preset("qwen3", dict(_TINY_LM, head_dim=16, tie_word_embeddings=True)),
    "tiny-gpt2": Preset("gpt2", dict(vocab_size=512, n_positions=512, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)),
    "tiny-bert": Preset("bert", dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=512, type_vocab_size=2)),
    "tiny-vitmae": Preset("vitmae", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, image_size=32, patch_size=8, num_channels=1,
                                         mask_ratio=0.75, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                         decoder_num_attention_heads=4, decoder_intermediate_size=64)),
    # The Perseus families at test size (seconds on CPU): 2+2 T5 blocks, 4 BLOOM blocks, 4 bottlenecks
    # (64 x 64 images: layer4's maps stay 2 x 2, so BatchNorm over a microbatch of 2 is well conditioned).
    "tiny-t5": Preset("t5", dict(vocab_size=512, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                 num_decoder_layers=2, feed_forward_proj="relu", relative_attention_num_buckets=8,
                                 relative_attention_max_distance=32, tie_word_embeddings=True,
                                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    "tiny-bloom": Preset("bloom", dict(vocab_size=512, hidden_size=32, n_layer=4, n_head=4, tie_word_embeddings=True)),
    "tiny-wide-resnet": Preset("wide_resnet", dict(layers=[1, 1, 1, 1], width_factor=2, num_classes=10, image_size=64,
                                                   num_channels=3, stem_channels=8, base_planes=4)),
    # ~20M-parameter Llama for benchmarks (bench/trainer_throughput.py)
    "llama-20m": Preset("llama", dict(vocab_size=8192, hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                                      num_key_value_heads=6, intermediate_size=1024, max_position_embeddings=2048,
                                      tie_word_embeddings=False)),
    # real architectures
    "qwen3-0.6b": Preset("qwen3", dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                       intermediate_size=3072, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                       rope_theta=1000000.0, tie_word_embeddings=True)),
    "smollm-135m": _smollm(576, 30, 9, 3, 1536),
    "smollm-360m": _smollm(960, 32, 15, 5, 2560),
    "smollm-1.7b": _smollm(2048, 24, 32, 32, 8192),
    "gpt3-small": _gpt3(768, 12, 12),
    "gpt3-medium": _gpt3(1024, 24, 16),
    "gpt3-large": _gpt3(1536, 24, 16),
    "gpt3-xl": _gpt3(2048, 24, 16),
    "gpt3-2.7b": _gpt3(2560, 32, 32),
    "gpt3-6.7b": _gpt3(4096, 32, 32),
    "gpt3-13b": _gpt3(5120, 40, 40),
    # Merak's table counts these two with a separate LM head (tied, they would be ~1 % smaller).
    "gpt3-39b": _gpt3(8192, 48, 64, tie_word_embeddings=False),
    "gpt3-80b": _gpt3(9600, 72, 64, tie_word_embeddings=False),
    "gpt3-175b": _gpt3(12288, 96, 96),
    "bert-base": _bert(768, 12, 12, 3072),
    "bert-large": _bert(1024, 24, 16, 4096),
    "bert-huge": _bert(2048, 24, 16, 8192),
    # Perseus/Merak's other families (its README's model table)
    "t5-small": _t5(512, 2048, 64, 8, 6),
    "t5-base": _t5(768, 3072, 64, 12, 12),
    "t5-large": _t5(1024, 4096, 64, 16, 24),
    "t5-3b": _t5(1024, 16384, 128, 32, 24),
    "t5-11b": _t5(1024, 65536, 128, 128, 24),
    "bloom-560m": _bloom(1024, 24, 16),
    "bloom-1b1": _bloom(1536, 24, 16),
    "bloom-1b7": _bloom(2048, 24, 16),
    "bloom-3b": _bloom(2560, 30, 32),
    "bloom-7b1": _bloom(4096, 30, 32),
    "wide-resnet50_2": _wide_resnet(50, 2),
    "wide-resnet50_4": _wide_resnet(50, 4),
    "wide-resnet50_8": _wide_resnet(50, 8),
    "wide-resnet101_2": _wide_resnet(101, 2),
    "wide-resnet101_4": _wide_resnet(101, 4),
    "wide-resnet101_8": _wide_resnet(101, 8),
    # FSDP stub (seed 001): ViT-MAE on 1920x1920 single-channel images
    "vitmae-stub": Preset("vitmae", dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16,
                                         intermediate_size=5120, image_size=1920, patch_size=128, num_channels=1,
                                         mask_ratio=0.75, decoder_hidden_size=512, decoder_num_hidden_layers=16,
                                         decoder_num_attention_heads=16, decoder_intermediate_size=2048)),
}

# Merak's README model table (millions of parameters); tests check our presets against it.
EXPECTED_PARAMS_M = {
    "bert-base": 109.43, "bert-large": 334.95, "bert-huge": 1276.40,
    "gpt3-small": 124.44, "gpt3-medium": 354.82, "gpt3-large": 758.73, "gpt3-xl": 1313.63,
    "gpt3-2.7b": 2648.93, "gpt3-6.7b": 6654.21, "gpt3-13b": 12848.14, "gpt3-39b": 39491.63,
    "gpt3-80b": 80600.16, "gpt3-175b": 174591.68,
    # The table says "3B" and "11B" for these two: the public checkpoints' exact counts.
    "t5-small": 60.51, "t5-base": 222.90, "t5-large": 737.67, "t5-3b": 2851.6, "t5-11b": 11307.3,
    "wide-resnet50_2": 68.88, "wide-resnet50_4": 223.44, "wide-resnet50_8": 804.16,
    "wide-resnet101_2": 126.89, "wide-resnet101_4": 419.63, "wide-resnet101_8": 1517.37,
    # Not in Merak's table: the bigscience/bloom-* model cards' counts.
    "bloom-560m": 559.21, "bloom-1b1": 1065.31, "bloom-1b7": 1722.41, "bloom-3b": 3002.56, "bloom-7b1": 7069.02,
}

# Hub names users pass to picotron's --model_name; we map them to presets (nothing downloads).
HF_NAMES = {
    "HuggingFaceTB/SmolLM-135M": "smollm-135m",
    "HuggingFaceTB/SmolLM-360M": "smollm-360m",
    "HuggingFaceTB/SmolLM-1.7B": "smollm-1.7b",
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "Qwen/Qwen3-0.6B-Base": "qwen3-0.6b",
    "bert-base-uncased": "bert-base",
    "bert-large-uncased": "bert-large",
    "bert-huge-uncased": "bert-huge",
}

# Merak's model names are accepted too.
ALIASES = {"bert-base-uncased": "bert-base", "bert-large-uncased": "bert-large", "bert-huge-uncased": "bert-huge",
           "vit-mae-stub": "vitmae-stub"}
for _alias, _name in ALIASES.items():
    PRESETS[_alias] = PRESETS[_name]


def close_names(name: str, n: int = 4) -> list[str]:
    """Preset names that look like `name` (a typo, another spelling), best first."""
    import difflib

    return difflib.get_close_matches(name, list(PRESETS), n=n, cutoff=0.5) or \
        difflib.get_close_matches(name.lower().replace("_", "-"), list(PRESETS), n=n, cutoff=0.5)


def unknown_preset_message(name: str) -> str:
    close = close_names(name)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(sorted(PRESETS))}"
    return f"model.preset: unknown preset '{name}' ({hint})"
