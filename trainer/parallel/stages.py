"""Cut a transformers model into pipeline stage modules.

Each stage module holds the very submodules of the full model (no copies, so the same seeded
initialisation), keyed by their global layer index so that parameter names stay those of the
full model (`model.layers.7.self_attn.q_proj.weight`), which keeps checkpoints comparable.

A stage's forward takes `input_ids` (first stage) or hidden states (later stages) and returns
hidden states or, on the last stage, logits; given `targets`, the last stage returns the summed
cross entropy instead, chunked over tokens (`loss_chunks`, trainer/models/lm_loss.py). Position
ids, rotary embeddings and the attention mask are rebuilt inside every stage with the same transformers helpers the full model uses, so
the stages chained together give bit-identical numbers to the full forward.

Weights tied across stages (embedding and LM head of GPT-2, BERT, tied Qwen3) cannot be one
Parameter when the stages live on different ranks: the later stage gets its own copy and
`TiedWeights` keeps the copies' gradients summed (as Megatron does), so they stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from trainer.config import ConfigError
from trainer.models.lm_loss import lm_loss_sum
from trainer.parallel.partition import StageRange

DECODER_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED = (*DECODER_TYPES, "gpt2", "bert")


class StageError(ConfigError, ValueError):
    """A model that cannot be split as asked; the message is one line a user can act on."""


def model_type(model: nn.Module) -> str:
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt not in SUPPORTED:
        raise StageError(f"model.preset: pipeline splitting supports {', '.join(SUPPORTED)}, not {mt!r}")
    return mt


def num_layers(model: nn.Module) -> int:
    return len(_layers(model))


def _layers(model: nn.Module) -> nn.ModuleList:
    mt = model_type(model)
    if mt in DECODER_TYPES:
        return model.model.layers
    if mt == "gpt2":
        return model.transformer.h
    return model.bert.encoder.layer


def part_param_counts(model: nn.Module) -> tuple[int, int, int]:
    """(per-layer, embeddings, norm+head) parameter counts, for the `parameters` partition."""
    layer = sum(p.numel() for p in _layers(model)[0].parameters())
    embed = sum(p.numel() for p in _embed_modules(model).parameters())
    # A tied head weight counts on both sides: the last stage holds (and computes with) a copy.
    head = sum(p.numel() for p in _head_modules(model).parameters())
    return layer, embed, head


def _embed_modules(model: nn.Module) -> nn.ModuleDict:
    mt = model_type(model)
    if mt in DECODER_TYPES:
        return nn.ModuleDict({"embed_tokens": model.model.embed_tokens})
    if mt == "gpt2":
        return nn.ModuleDict({"wte": model.transformer.wte, "wpe": model.transformer.wpe})
    return nn.ModuleDict({"embeddings": model.bert.embeddings})


def _head_modules(model: nn.Module) -> nn.ModuleDict:
    mt = model_type(model)
    if mt in DECODER_TYPES:
        return nn.ModuleDict({"norm": model.model.norm, "lm_head": model.lm_head})
    if mt == "gpt2":
        return nn.ModuleDict({"ln_f": model.transformer.ln_f, "lm_head": model.lm_head})
    return nn.ModuleDict({"cls": model.cls})


class _Container(nn.Module):
    """Plain holder so that stage parameter names mirror the full model's."""


def _head_out(head: nn.Module, h: torch.Tensor, targets: torch.Tensor | None, chunks: int) -> torch.Tensor:
    """The last stage's output: logits, or with targets the summed loss (no full logits)."""
    return head(h) if targets is None else lm_loss_sum(head, h, targets, chunks)


class DecoderStage(nn.Module):
    """Llama / SmolLM / Qwen2 / Qwen3 / Mistral layers [start, end) with embeddings or head."""

    loss_chunks = 1

    def __init__(self, full: nn.Module, r: StageRange, is_first: bool, is_last: bool):
        super().__init__()
        self.config = full.config
        self.is_first, self.is_last = is_first, is_last
        self.model = _Container()
        if is_first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in range(r.start, r.end)})
        self.model.rotary_emb = full.model.rotary_emb
        if is_last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        h = self.model.embed_tokens(x) if self.is_first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask_kwargs = {"config": self.config, "inputs_embeds": h, "attention_mask": None,
                       "past_key_values": None, "position_ids": pos}
        types = getattr(self.config, "layer_types", None)
        masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if types and "sliding_attention" in types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        rope = self.model.rotary_emb(h, pos)
        for idx, layer in self.model.layers.items():
            kind = types[int(idx)] if types else "full_attention"
            h = layer(h, attention_mask=masks[kind], position_embeddings=rope, position_ids=pos,
                      past_key_values=None, use_cache=False)
            h = h[0] if isinstance(h, tuple) else h
        if self.is_last:
            return _head_out(self.lm_head, self.model.norm(h), targets, self.loss_chunks)
        return h


class GPT2Stage(nn.Module):
    loss_chunks = 1

    def __init__(self, full: nn.Module, r: StageRange, is_first: bool, is_last: bool):
        super().__init__()
        self.config = full.config
        self.is_first, self.is_last = is_first, is_last
        self.transformer = _Container()
        tr = full.transformer
        if is_first:
            self.transformer.wte, self.transformer.wpe, self.transformer.drop = tr.wte, tr.wpe, tr.drop
        self.transformer.h = nn.ModuleDict({str(i): tr.h[i] for i in range(r.start, r.end)})
        if is_last:
            self.transformer.ln_f = tr.ln_f
            self.lm_head = full.lm_head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.is_first:
            emb = self.transformer.wte(x)
            h = self.transformer.drop(emb + self.transformer.wpe(pos))
        else:
            h = x
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=pos)
        for block in self.transformer.h.values():
            h = block(h, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=pos)
            h = h[0] if isinstance(h, tuple) else h
        if self.is_last:
            return _head_out(self.lm_head, self.transformer.ln_f(h), targets, self.loss_chunks)
        return h


class BertStage(nn.Module):
    """BERT masked-LM: embeddings | encoder layers | MLM head (bidirectional, no mask)."""

    loss_chunks = 1

    def __init__(self, full: nn.Module, r: StageRange, is_first: bool, is_last: bool):
        super().__init__()
        self.config = full.config
        self.is_first, self.is_last = is_first, is_last
        self.bert = _Container()
        if is_first:
            self.bert.embeddings = full.bert.embeddings
        self.bert.encoder = _Container()
        self.bert.encoder.layer = nn.ModuleDict({str(i): full.bert.encoder.layer[i]
                                                 for i in range(r.start, r.end)})
        if is_last:
            self.cls = full.cls

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        h = self.bert.embeddings(input_ids=x) if self.is_first else x
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=None)
        for layer in self.bert.encoder.layer.values():
            h = layer(h, mask, None, encoder_attention_mask=None, past_key_values=None)
            h = h[0] if isinstance(h, tuple) else h
        if self.is_last:
            return _head_out(self.cls, h, targets, self.loss_chunks)
        return h


_STAGE_CLASSES = {**dict.fromkeys(DECODER_TYPES, DecoderStage), "gpt2": GPT2Stage, "bert": BertStage}


@dataclass
class TiedWeights:
    """Parameters that were one tensor in the full model and are copies across stages.

    `groups` lists, per tied tensor, the (stage index, parameter name) of every copy; `local`
    maps stage index to the module this rank holds.
    """

    groups: list[list[tuple[int, str]]] = field(default_factory=list)

    def stages_of(self, group: list[tuple[int, str]]) -> list[int]:
        return sorted({s for s, _ in group})


def split_model(full: nn.Module, ranges: list[StageRange], keep: list[int] | None = None
                ) -> tuple[dict[int, nn.Module], TiedWeights]:
    """Stage modules for the stage indices in `keep` (all when None), plus the tied-weight map.

    Stages built for other ranks are dropped here, so their layers are freed with the full model.
    """
    cls = _STAGE_CLASSES[model_type(full)]
    n = len(ranges)
    stages = {r.stage: cls(full, r, r.stage == 0, r.stage == n - 1) for r in ranges}
    tied = _untie_across_stages(stages)
    keep_set = set(range(n) if keep is None else keep)
    return {s: m for s, m in stages.items() if s in keep_set}, tied


def _untie_across_stages(stages: dict[int, nn.Module]) -> TiedWeights:
    uses: dict[int, list[tuple[int, str, nn.Module, str]]] = {}
    for s, mod in sorted(stages.items()):
        for mname, sub in mod.named_modules(remove_duplicate=False):
            for pname, p in sub.named_parameters(recurse=False, remove_duplicate=False):
                uses.setdefault(id(p), []).append((s, f"{mname}.{pname}" if mname else pname, sub, pname))
    tied = TiedWeights()
    for entries in uses.values():
        stage_ids = sorted({e[0] for e in entries})
        if len(stage_ids) < 2:
            continue
        group = []
        for s in stage_ids:
            mine = [e for e in entries if e[0] == s]
            if s != stage_ids[0]:
                # The later stage gets its own copy, shared by all its uses of the weight.
                copy = nn.Parameter(getattr(mine[0][2], mine[0][3]).detach().clone())
                for _, _, sub, pname in mine:
                    setattr(sub, pname, copy)
            group.append((s, mine[0][1]))
        tied.groups.append(group)
    return tied


def sync_tied_grads(mine: list[nn.Parameter], group) -> None:
    """Sum the gradients of this rank's copies of one tied weight, then over `group` (the
    pipeline ranks holding the other copies, None when all are local), so every copy sees the
    full model's gradient and the copies stay identical after the optimizer step."""
    import torch.distributed as dist

    grads = [_local(p.grad) for p in mine if p.grad is not None]
    total = torch.zeros_like(_local(mine[0])) if not grads else sum(grads[1:], grads[0].clone())
    if group is not None:
        dist.all_reduce(total, group=group)
    for p in mine:
        if p.grad is None:
            p.grad = _like(p, total.clone())
        else:
            _local(p.grad).copy_(total)


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def chain_forward(stages: list[nn.Module], input_ids: torch.Tensor) -> torch.Tensor:
    """Run stage modules one after another in this process (tests, debugging)."""
    h = input_ids
    for m in stages:
        h = m(h)
    return h
