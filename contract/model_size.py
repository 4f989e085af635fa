"""A transformer's size from its config alone (no torch): the parameters of its embeddings, of each
block and of its head, and what each part saves for backward per token. With contract/memory.py's
`stage_memory` this sizes a pipeline stage; the runner uses it for `runner up --dry-run` (it never
imports torch) and `trainer --dry-run` prints the same arithmetic beside what it counts on the meta
device. tests/unit/test_sizing.py holds the two equal: parameters exactly, activations within 2 %.

The families with a plain stack of identical blocks: Llama/SmolLM, Qwen2, Qwen3, GPT-2, BERT,
BLOOM. T5 (two stacks), ViT-MAE and Wide-ResNet are sized by `trainer --dry-run` only.

Saved for backward, per token and block, in elements of the training dtype (transformers' eager
modules, as the meta device counts them; h hidden, f MLP width, a = heads x head_dim, k = kv heads x
head_dim, n heads, s sequence length):
- Llama / Qwen2: 6h (two RMSNorms: input, normalised, scaled) + 4a (q, k and v at a width after the
  GQA repeat, attention output) + 4f (gate, up, SiLU, product) + 2 (the norms' rsqrt);
- Qwen3: that plus its q/k norms, 2a + 2k + n + kv heads;
- GPT-2: 8h + 5f + 4 (its tanh GELU keeps four tensors of the MLP's width);  BERT: 8h + 2f + 4;  BLOOM: 16h + 4 + n s (its eager
  attention keeps the probabilities; the SDPA families' kernels do not: flash and CPU keep a
  log-sum-exp).
The last stage also keeps one microbatch's logits (vocab per token) for the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract.memory import DTYPE_BYTES, StageLoad, loss_scratch_bytes

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2", "bert", "bloom")
# transformers' `model_type` of a config.json -> family (the trainer's MODEL_TYPE_TO_FAMILY, less
# the families sized only by the trainer)
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2", "bert": "bert",
               "bloom": "bloom"}
# The names a family's config uses for the common fields (transformers' attribute_map).
_ALIASES = {
    "gpt2": {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
             "intermediate_size": "n_inner", "max_position_embeddings": "n_positions"},
    "bloom": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"},
}
# transformers' defaults where a config leaves a field out (a preset does; a config.json rarely)
HEAD_DIM_DEFAULT = {"qwen3": 128}  # Qwen3Config's; Llama's is hidden / heads, Qwen2 has none
_TIED_DEFAULT = {"llama": False, "qwen2": False, "qwen3": False, "gpt2": True, "bert": True, "bloom": True}


class NotSized(ValueError):
    """A model this arithmetic does not cover; the message says what does."""


@dataclass(frozen=True)
class ModelShape:
    family: str
    vocab: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    embed_params: int          # the first stage's: token (and position, type) embeddings and their norm
    block_params: int          # each block's
    norm_params: int           # the last stage's final norm (BERT: the MLM head's transform)
    head_params: int           # the LM head's matrix and bias; a tied one is a second copy on another stage
    eager_attention: bool = False  # model.attn_implementation eager: the probabilities are kept too

    @property
    def params(self) -> int:
        """The whole model in one process (a tied head shares the embedding's tensor)."""
        return self.stage_params(0, self.layers, first=True, last=True)

    def stage_params(self, start: int, end: int, *, first: bool, last: bool) -> int:
        """A stage holding blocks [start, end), the embeddings if `first`, the head if `last`. A
        tied head on another stage than the embeddings is a copy (kept equal by the pipeline)."""
        n = (end - start) * self.block_params
        if first:
            n += self.embed_params
        if last:
            n += self.norm_params + self.head_params
            if self.tied and first:
                n -= self.vocab * self.hidden  # one tensor for both
        return n

    def block_saved(self, seq: int) -> int:
        """Elements one block saves for backward per token (see the module doc)."""
        h, f, a, k = self.hidden, self.ffn, self.heads * self.head_dim, self.kv_heads * self.head_dim
        scores = self.heads * seq if self.eager_attention and self.family != "bloom" else 0
        return scores + self._block_saved(h, f, a, k, seq)

    def _block_saved(self, h: int, f: int, a: int, k: int, seq: int) -> int:
        if self.family in ("llama", "qwen2", "qwen3"):
            n = 6 * h + 4 * a + 4 * f + 2
            if self.family == "qwen3":
                n += 2 * a + 2 * k + self.heads + self.kv_heads
            return n
        if self.family == "gpt2":
            return 8 * h + 5 * f + 4
        if self.family == "bert":
            return 8 * h + 2 * f + 4
        return 16 * h + 4 + self.heads * seq  # bloom

    def first_saved(self) -> int:
        """Per token, what the embeddings save (BERT's and BLOOM's embedding LayerNorm)."""
        return self.hidden if self.family in ("bert", "bloom") else 0

    def last_saved(self) -> int:
        """Per token, what the final norm and the head save, the logits included."""
        per = {"llama": 3, "qwen2": 3, "qwen3": 3, "gpt2": 2, "bert": 4, "bloom": 1}[self.family]
        return per * self.hidden + self.vocab


def stage_loads(shape: ModelShape, bounds: list[int], *, micro: int, seq: int, dtype: str,
                chunks: int) -> list[StageLoad]:
    """What each stage of the split `bounds` (block boundaries, [0, ..., layers]) holds and keeps
    for one microbatch of `micro` x `seq` tokens, as contract/memory.py's `stage_memory` takes it."""
    tokens, size, n = micro * seq, DTYPE_BYTES[dtype], len(bounds) - 1
    loads = []
    for s in range(n):
        first, last, a, b = s == 0, s == n - 1, bounds[s], bounds[s + 1]
        saved = (b - a) * shape.block_saved(seq) + (shape.first_saved() if first else 0) + \
            (shape.last_saved() if last else 0)
        loads.append(StageLoad(
            params=shape.stage_params(a, b, first=first, last=last), activation_bytes=tokens * saved * size,
            boundary_bytes=0 if last else tokens * shape.hidden * size,
            transient_bytes=loss_scratch_bytes(tokens, shape.vocab, dtype, chunks) if last else 0,
            largest_unit_params=shape.block_params))
    return loads


def with_overrides(family: str, cfg: dict[str, Any], model: dict[str, Any], hf_overrides: dict[str, Any], *,
                   preset: bool) -> dict[str, Any]:
    """A preset's or config.json's fields with the trainer's model.* keys (`model`: num_hidden_layers,
    hidden_size, num_attention_heads, intermediate_size, vocab_size; None = unset) and
    model.hf_overrides applied as trainer/models/build.py applies them."""
    out = dict(cfg)
    if family == "llama" and "head_dim" not in cfg:  # LlamaConfig fixes it at construction
        out["head_dim"] = int(_get(cfg, family, "hidden_size")) // int(_get(cfg, family, "num_attention_heads"))
    for name, value in model.items():
        if value is not None:
            out[_ALIASES.get(family, {}).get(name, name)] = value
    out.update(hf_overrides)
    heads = _get(out, family, "num_attention_heads")
    kv = out.get("num_key_value_heads")
    if kv is not None and heads and (kv > heads or heads % kv):
        out["num_key_value_heads"] = heads
    if preset and model.get("hidden_size") is not None and "head_dim" in cfg and heads:
        out["head_dim"] = int(_get(out, family, "hidden_size")) // int(heads)
    return out


def _get(cfg: dict[str, Any], family: str, name: str, default: Any = None) -> Any:
    key = _ALIASES.get(family, {}).get(name, name)
    value = cfg.get(key, cfg.get(name))
    return default if value is None else value


def model_shape(family: str, cfg: dict[str, Any], *, eager_attention: bool = False) -> ModelShape:
    """The shape of a `family` model from its transformers config fields (a preset's dict or a
    config.json); `eager_attention` for model.attn_implementation eager. NotSized for a family
    outside FAMILIES."""
    if family not in FAMILIES:
        raise NotSized(f"{family}: sized by `trainer --dry-run` only (this arithmetic covers {', '.join(FAMILIES)})")
    h = int(_get(cfg, family, "hidden_size"))
    layers = int(_get(cfg, family, "num_hidden_layers"))
    heads = int(_get(cfg, family, "num_attention_heads"))
    vocab = int(_get(cfg, family, "vocab_size"))
    kv = int(_get(cfg, family, "num_key_value_heads", heads)) if family in ("llama", "qwen2", "qwen3") else heads
    d = int(_get(cfg, family, "head_dim", 0) or (HEAD_DIM_DEFAULT.get(family) or h // heads))
    ffn = int(_get(cfg, family, "intermediate_size", 0) or 4 * h)
    if family == "bloom":
        ffn = 4 * h
    tied = bool(_get(cfg, family, "tie_word_embeddings", _TIED_DEFAULT[family]))
    a, k = heads * d, kv * d
    if family in ("llama", "qwen2", "qwen3"):
        attn_bias = family == "qwen2" or bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
        block = h * a + 2 * h * k + a * h + 3 * h * ffn + 2 * h
        if attn_bias:
            block += a + 2 * k + (h if family != "qwen2" else 0)  # Qwen2: biases on q, k, v only
        if mlp_bias:
            block += 2 * ffn + h
        if family == "qwen3":
            block += 2 * d  # q_norm, k_norm
        embed, norm, head = vocab * h, h, vocab * h
    elif family == "gpt2":
        positions = int(_get(cfg, family, "max_position_embeddings", 1024))
        block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h)
        embed, norm, head = (vocab + positions) * h, 2 * h, vocab * h
    elif family == "bert":
        positions = int(_get(cfg, family, "max_position_embeddings", 512))
        types = int(_get(cfg, family, "type_vocab_size", 2))
        block = 4 * (h * h + h) + 4 * h + (h * ffn + ffn) + (ffn * h + h)
        embed = (vocab + positions + types) * h + 2 * h
        norm, head = h * h + h + 2 * h, vocab * h + vocab  # MLM transform; decoder and its bias
    else:  # bloom
        block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h)
        embed, norm, head = vocab * h + 2 * h, 2 * h, vocab * h
    return ModelShape(family, vocab, h, layers, ffn, heads, kv, d, tied, embed, block, norm, head, eager_attention)
