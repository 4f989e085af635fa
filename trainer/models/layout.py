"""What a pipeline distributes, per model family: the units (transformer layers, T5's encoder then
decoder blocks, Wide-ResNet's bottlenecks), what the first and last stage hold besides them, and
Merak's item counting, which Perseus' `custom:` partitions are written in.

Merak (Perseus' training framework) traces the model with torch.fx and cuts the graph into items
(`Merak/autoshard/graph_shard.py`): every nn.Embedding is an item of its own (T5's relative
attention bias excepted), and the other nodes are packed greedily, an item closing once it holds
more than (parameters - embeddings) // shard_count; a residual connection pulls everything since
its input back into one item, so cuts only fall between residual sublayers. shard_count is set
per example script: BERT and BLOOM L+2 and GPT L+3 (exactly one item per block, plus the
embeddings and the head), T5 100, Wide-ResNet depth x 10. The resulting counts:

- GPT: wte | wpe | L blocks | ln_f + head = L + 3 (gpt3-xl: 27);
- BERT, BLOOM (and the Llama-like families): embeddings | L blocks | head = L + 2;
- T5 large/3b/11b: shared embedding | 24 encoder blocks | 24 decoder blocks as two items each
  (self + cross attention | FFN) | final norm + head = 74; t5-small 32 and t5-base 62 (every
  residual sublayer is an item there);
- Wide-ResNet-101: stem + first bottleneck | 32 bottlenecks | pool + fc = 34 (-50: 17).

Those counts are computed here from the model's own parameter counts (greedy packing for T5 and
Wide-ResNet), so `custom:0,16,33,53,74` means for t5-3b what it meant in Merak: a boundary at an
item that starts a unit starts a stage there; one inside a unit (between a decoder block's
attention and its FFN) is refused, naming the nearest legal boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from trainer.config.partition import Counting

DECODER_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class Unit:
    group: str                  # layers | encoder | decoder | bottlenecks
    index: int                  # within its group
    params: int
    atoms: tuple[int, ...]      # parameters of its residual sublayers, in order (what Merak packs)


@dataclass(frozen=True)
class Layout:
    name: str                   # the preset (or model type), for messages
    family: str
    units: tuple[Unit, ...]
    embed_params: int           # on the first stage besides units: embeddings (T5: shared), stem
    head_params: int            # on the last stage besides units: final norm + head (a tied head counted)
    extra_params: dict[int, int]  # unit index -> parameters whoever holds it also holds (T5's decoder
                                  # embedding copy and the encoder's final norm go with decoder block 0)
    counting: Counting
    first_name: str             # what stage 0 holds besides units ("embeddings", "stem")
    last_name: str              # what the last stage holds besides units ("norm + head", "pool + fc")

    @property
    def num_units(self) -> int:
        return len(self.units)

    def unit_weights(self) -> list[int]:
        """Per-unit weight for the `parameters` partition (extras included)."""
        return [u.params + self.extra_params.get(i, 0) for i, u in enumerate(self.units)]

    def describe(self, start: int, end: int) -> str:
        """`encoder 15-23 + decoder 0-3`, `layers 7-12`, `bottlenecks 0-6` for units [start, end)."""
        parts: list[str] = []
        groups: dict[str, list[int]] = {}
        for u in self.units[start:end]:
            groups.setdefault(u.group, []).append(u.index)
        for group, idx in groups.items():
            word = group if group in ("encoder", "decoder") else (group if len(idx) > 1 else group.rstrip("s"))
            parts.append(f"{word} {idx[0]}-{idx[-1]}" if len(idx) > 1 else f"{word} {idx[0]}")
        return " + ".join(parts)


def _count(module: nn.Module | None, skip_embeddings: bool = False) -> int:
    if module is None:
        return 0
    if skip_embeddings:
        return sum(p.numel() for m in module.modules() if not isinstance(m, nn.Embedding)
                   for p in m.parameters(recurse=False))
    return sum(p.numel() for p in module.parameters())


def _counts(*modules: nn.Module | None) -> int:
    return sum(_count(m) for m in modules)


@dataclass(frozen=True)
class _Parts:
    units: list[Unit]
    embeddings: list[tuple[str, int]]     # Merak items of their own, in order
    first_atom_extra: int                 # packed with unit 0's first atom (stem, embedding layer norm)
    head_atoms: int                       # final norm + head, as Merak counts them (tied head included)
    embed_params: int
    head_params: int
    extra_params: dict[int, int]
    shard_count: int | None               # None: one item per unit (Merak's L+2 / L+3 scripts)
    excluded: int                         # nn.Embedding parameters Merak leaves out of the packing total
    first_name: str
    last_name: str
    noun: str


def _transformer_parts(model: nn.Module, mt: str) -> _Parts:
    if mt in DECODER_TYPES:
        layers, embeds = model.model.layers, [("embeddings", _count(model.model.embed_tokens))]
        head = _counts(model.model.norm, model.lm_head)
    elif mt == "gpt2":
        tr = model.transformer
        layers, embeds = tr.h, [("wte", _count(tr.wte)), ("wpe", _count(tr.wpe))]
        head = _counts(tr.ln_f, model.lm_head)
    elif mt == "bloom":
        tr = model.transformer
        layers = tr.h
        embeds = [("word embeddings", _counts(tr.word_embeddings, tr.word_embeddings_layernorm))]
        head = _counts(tr.ln_f, model.lm_head)
    else:  # bert
        layers, embeds = model.bert.encoder.layer, [("embeddings", _count(model.bert.embeddings))]
        head = _count(model.cls)
    units = [Unit("layers", i, _count(b), (_count(b),)) for i, b in enumerate(layers)]
    return _Parts(units, embeds, 0, head, sum(p for _, p in embeds), head, {}, None, 0, "embeddings",
                  "norm + head" if mt != "bert" else "head", "layers")


def _t5_parts(model: nn.Module) -> _Parts:
    units = []
    for group, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        for i, block in enumerate(stack.block):
            atoms = tuple(_count(sub, skip_embeddings=True) for sub in block.layer)
            units.append(Unit(group, i, _count(block), atoms))
    shared = _count(model.shared)
    rel = sum(_count(m) for m in model.modules() if isinstance(m, nn.Embedding) and m is not model.shared)
    first_dec = len(model.encoder.block)
    extra = {first_dec: shared + _count(model.encoder.final_layer_norm)}  # decoder embedding copy, encoder norm
    head = _counts(model.decoder.final_layer_norm, model.lm_head)
    return _Parts(units, [("shared embedding", shared)], 0, head, shared, head, extra, 100, shared + rel,
                  "embedding", "norm + head", "blocks")


def _wide_resnet_parts(model: nn.Module) -> _Parts:
    units = []
    for name in ("layer1", "layer2", "layer3", "layer4"):
        for b in getattr(model, name):
            units.append(Unit("bottlenecks", len(units), _count(b), (_count(b),)))
    stem = _counts(model.conv1, model.bn1)
    head = _count(model.fc)
    return _Parts(units, [], stem, head, stem, head, {}, model.config.depth * 10, 0, "stem", "pool + fc",
                  "bottlenecks")


def model_type_of(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def layout_of(model: nn.Module, name: str | None = None) -> Layout:
    """The pipeline layout of a full model (real or on the meta device)."""
    mt = model_type_of(model)
    if mt == "t5":
        parts = _t5_parts(model)
    elif mt == "wide_resnet":
        parts = _wide_resnet_parts(model)
    elif mt in (*DECODER_TYPES, "gpt2", "bloom", "bert"):
        parts = _transformer_parts(model, mt)
    else:
        raise ValueError(f"no pipeline layout for model type {mt!r}")
    total = sum(p.numel() for p in model.parameters())
    counting = merak_counting(parts, total, name or str(mt))
    return Layout(name or str(mt), str(mt), tuple(parts.units), parts.embed_params, parts.head_params,
                  parts.extra_params, counting, parts.first_name, parts.last_name)


def merak_counting(parts: _Parts, total_params: int, name: str) -> Counting:
    """Merak's items of a model: for each, the unit boundary it starts at (None where a stage
    cannot start: inside a unit, or between two embeddings) and what it holds."""
    starts: list[int | None] = [0 if i == 0 else None for i in range(len(parts.embeddings))]
    labels = [label for label, _ in parts.embeddings]
    n = len(parts.units)
    spans: list[list[tuple[int, int]]] = []  # per packed item: its (unit, atom) pairs
    head_joins = False                        # the last item was still open when the head came
    if parts.shard_count is None:
        spans = [[(i, 0)] for i in range(n)]
    else:
        threshold = (total_params - parts.excluded) // parts.shard_count
        held, current = 0, None
        for i, u in enumerate(parts.units):
            for a, p in enumerate(u.atoms):
                if current is None:
                    current = []
                    spans.append(current)
                current.append((i, a))
                held += p + (parts.first_atom_extra if (i, a) == (0, 0) else 0)
                if held > threshold:
                    held, current = 0, None
        head_joins = current is not None
    for span in spans:
        starts.append(span[0][0] if span[0][1] == 0 else None)
        label = _span_label(parts.units, span)
        labels.append(f"{parts.first_name} + {label}" if span[0] == (0, 0) and parts.first_atom_extra else label)
    if head_joins:
        labels[-1] += f" + {parts.last_name}"
    else:
        starts.append(n)
        labels.append(parts.last_name)
    return Counting(name, n, parts.noun, tuple(starts), tuple(labels))


def _unit_label(u: Unit) -> str:
    return f"bottleneck {u.index}" if u.group == "bottlenecks" else \
        f"layer {u.index}" if u.group == "layers" else f"{u.group} {u.index}"


_T5_NAMES = {("encoder", 2): ("attention", "FFN"), ("decoder", 3): ("self attention", "cross attention", "FFN")}


def _span_label(units: tuple[Unit, ...] | list[Unit], span: list[tuple[int, int]]) -> str:
    """`decoder 4`, `decoder 4 self attention + cross attention`, `encoder 0-2` for one item."""
    whole = span[0][1] == 0 and span[-1][1] == len(units[span[-1][0]].atoms) - 1
    if whole:
        first, last = units[span[0][0]], units[span[-1][0]]
        if first is last:
            return _unit_label(first)
        return f"{_unit_label(first)} - {_unit_label(last)}"
    words = []
    for i, a in span:
        u = units[i]
        names = _T5_NAMES.get((u.group, len(u.atoms)))
        words.append(f"{_unit_label(u)} {names[a] if names else f'part {a}'}")
    return " + ".join(words)


_LAYOUTS: dict[tuple[str, str, str], Layout] = {}


def meta_model(family: str, hf_config: Any) -> nn.Module:
    """The full model on the meta device: shapes and names, no memory."""
    import torch

    from trainer.models.build import FAMILIES, _transformers_attr

    with torch.device("meta"):
        return _transformers_attr(FAMILIES[family].model_cls)(hf_config)


def model_layout(family: str, hf_config: Any, name: str, model: nn.Module | None = None) -> Layout:
    """The layout of a config's model, computed once per process on the meta device (nothing
    allocated); `model`: that meta model when the caller has built it already."""
    key = (family, hf_config.to_json_string(use_diff=False), name)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = layout_of(model if model is not None else meta_model(family, hf_config), name)
    return _LAYOUTS[key]
