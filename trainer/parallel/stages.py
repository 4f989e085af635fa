"""Cut a model into pipeline stage modules.

Each stage module holds the very submodules of the full model (no copies, so the same seeded
initialisation), keyed by their global layer index so that parameter names stay those of the
full model (`model.layers.7.self_attn.q_proj.weight`), which keeps checkpoints comparable.

A stage's forward takes `input_ids` (first stage) or what the previous stage sent and returns
what the next stage needs or, on the last stage, logits; given `targets`, the last stage returns
the summed cross entropy instead, chunked over tokens (`loss_chunks`, trainer/models/lm_loss.py).
Position ids, rotary embeddings, ALiBi and the attention masks are rebuilt inside every stage with
the same transformers helpers the full model uses, so the stages chained together give the full
forward's numbers.

What travels between stages: hidden states [B, S, hidden] (decoder-only and BERT), Wide-ResNet's
feature maps [B, C, H, W] (their shape changes along the network), and for T5 a tuple: (encoder
hidden, the encoder's relative position bias) inside the encoder, then (decoder hidden, encoder
output, the decoder's position bias) once the decoder has started; the first decoder stage reads
its inputs (the targets shifted right) from the `targets` every stage receives. The biases are
computed once, by the first block of each stack (their parameters live there), and carried, with
their gradients flowing back, exactly as the full model reuses them.

Weights tied across stages (embedding and LM head of GPT-2, BERT, tied Qwen3) cannot be one
Parameter when the stages live on different ranks: the later stage gets its own copy and
`TiedWeights` keeps the copies' gradients summed (as Megatron does), so they stay identical.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer.config import ConfigError
from trainer.config.partition import StageRange
from trainer.models.lm_loss import lm_loss_sum

DECODER_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED = (*DECODER_TYPES, "gpt2", "bert", "bloom", "t5", "wide_resnet")


class StageError(ConfigError, ValueError):
    """A model that cannot be split as asked; the message is one line a user can act on."""


def model_type(model: nn.Module) -> str:
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt not in SUPPORTED:
        raise StageError(f"model.preset: pipeline splitting supports {', '.join(SUPPORTED)}, not {mt!r}")
    return mt


def num_layers(model: nn.Module) -> int:
    """The units a pipeline distributes (trainer/models/layout.py)."""
    mt = model_type(model)
    if mt == "t5":
        return len(model.encoder.block) + len(model.decoder.block)
    if mt == "wide_resnet":
        return len(model.bottlenecks())
    if mt in DECODER_TYPES:
        return len(model.model.layers)
    if mt in ("gpt2", "bloom"):
        return len(model.transformer.h)
    return len(model.bert.encoder.layer)


@functools.lru_cache(maxsize=1)
def _cache_keyword() -> str:
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _no_cache() -> dict:
    """The 'no KV cache' keyword of transformers' mask helpers (`cache` from 5.x on, before that
    `past_key_values`)."""
    return {_cache_keyword(): None}


class _Container(nn.Module):
    """Plain holder so that stage parameter names mirror the full model's."""


def _head_out(head: nn.Module, h: torch.Tensor, targets: torch.Tensor | None, chunks: int) -> torch.Tensor:
    """The last stage's output: logits, or with targets the summed loss (no full logits). The loss
    recomputes its logits in the backward (fuse=False): a schedule that runs several microbatches'
    forwards before their backwards (GPipe) would otherwise hold a head gradient per microbatch."""
    return head(h) if targets is None else lm_loss_sum(head, h, targets, chunks, fuse=False)


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
        mask_kwargs = {"config": self.config, "inputs_embeds": h, "attention_mask": None, "position_ids": pos,
                       **_no_cache()}
        types = getattr(self.config, "layer_types", None)
        masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if types and "sliding_attention" in types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        rope = self.model.rotary_emb(h, pos)
        for idx, layer in self.model.layers.items():
            kind = types[int(idx)] if types else "full_attention"
            # No cache keyword: None is every version's default, and the keyword is deprecated (5.x).
            h = layer(h, attention_mask=masks[kind], position_embeddings=rope, position_ids=pos, use_cache=False)
            h = h[0] if isinstance(h, tuple) else h
        if self.is_last:
            return _head_out(self.lm_head, self.model.norm(h), targets, self.loss_chunks)
        return h


def _transformer_h_parts(stage: nn.Module, full: nn.Module, r: StageRange, is_first: bool, is_last: bool,
                         embeddings: tuple[str, ...]) -> None:
    """The parts of a `transformer.h` model (GPT-2, BLOOM) a stage holds, under the full model's
    names: the named embedding modules on the first stage, blocks [start, end), ln_f and the head
    on the last."""
    stage.config = full.config
    stage.is_first, stage.is_last = is_first, is_last
    stage.transformer = _Container()
    tr = full.transformer
    if is_first:
        for name in embeddings:
            setattr(stage.transformer, name, getattr(tr, name))
    stage.transformer.h = nn.ModuleDict({str(i): tr.h[i] for i in range(r.start, r.end)})
    if is_last:
        stage.transformer.ln_f = tr.ln_f
        stage.lm_head = full.lm_head


class GPT2Stage(nn.Module):
    loss_chunks = 1

    def __init__(self, full: nn.Module, r: StageRange, is_first: bool, is_last: bool):
        super().__init__()
        _transformer_h_parts(self, full, r, is_first, is_last, ("wte", "wpe", "drop"))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.is_first:
            emb = self.transformer.wte(x)
            h = self.transformer.drop(emb + self.transformer.wpe(pos))
        else:
            h = x
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, position_ids=pos,
                                  **_no_cache())
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
            h = layer(h, mask, None, encoder_attention_mask=None)
            h = h[0] if isinstance(h, tuple) else h
        if self.is_last:
            return _head_out(self.cls, h, targets, self.loss_chunks)
        return h


class BloomStage(nn.Module):
    """BLOOM: word embeddings + their LayerNorm | blocks (ALiBi, causal) | ln_f + tied head."""

    loss_chunks = 1

    def __init__(self, full: nn.Module, r: StageRange, is_first: bool, is_last: bool):
        super().__init__()
        _transformer_h_parts(self, full, r, is_first, is_last, ("word_embeddings", "word_embeddings_layernorm"))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        tr = self.transformer
        h = tr.word_embeddings_layernorm(tr.word_embeddings(x)) if self.is_first else x
        # Without padding ALiBi depends on positions only: the full model's values, [B * heads, 1, S].
        ones = torch.ones(h.shape[0], h.shape[1], device=h.device, dtype=torch.long)
        alibi = build_alibi_tensor(ones, self.config.n_head, h.dtype)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, **_no_cache())
        for block in tr.h.values():
            h = block(h, alibi=alibi, attention_mask=mask, use_cache=False)
            h = h[0] if isinstance(h, tuple) else h
        if self.is_last:
            return _head_out(self.lm_head, tr.ln_f(h), targets, self.loss_chunks)
        return h


class T5Stage(nn.Module):
    """T5 units [start, end) over encoder blocks 0..E-1 then decoder blocks E..E+D-1 (module doc).

    The first stage holds the shared embedding; whoever holds decoder block 0 also holds the
    encoder's final norm and the decoder's embedding (the shared one: a tied copy on a later
    stage); the last holds the decoder's final norm and the tied head."""

    loss_chunks = 1

    def __init__(self, full: nn.Module, r: StageRange, is_first: bool, is_last: bool):
        super().__init__()
        self.config = full.config
        self.is_first, self.is_last = is_first, is_last
        self.n_enc, self.n_dec = len(full.encoder.block), len(full.decoder.block)
        self.start, self.end = r.start, r.end
        self.enc_config, self.dec_config = full.encoder.config, full.decoder.config
        self.encoder, self.decoder = _Container(), _Container()
        e = self.n_enc
        if is_first:
            self.shared = full.shared
        self.encoder.block = nn.ModuleDict({str(i): full.encoder.block[i] for i in range(r.start, min(r.end, e))})
        self.encoder.dropout = full.encoder.dropout
        if r.start <= e < r.end:  # holds decoder block 0: the encoder ends and the decoder starts here
            self.encoder.final_layer_norm = full.encoder.final_layer_norm
            self.decoder.embed_tokens = full.decoder.embed_tokens
        self.decoder.block = nn.ModuleDict({str(i - e): full.decoder.block[i - e]
                                            for i in range(max(r.start, e), r.end)})
        self.decoder.dropout = full.decoder.dropout
        if is_last:
            self.decoder.final_layer_norm = full.decoder.final_layer_norm
            self.lm_head = full.lm_head

    def _outputs(self, h: torch.Tensor, bias: torch.Tensor | None, enc_out: torch.Tensor | None
                 ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What the next stage needs at boundary `self.end` (see the module doc)."""
        b, e = self.end, self.n_enc
        if b == 0 or b == e or b == e + self.n_dec:
            return h
        # The bias is a permuted view (heads first); point-to-point sends need contiguous tensors.
        if b < e:
            return h, bias.contiguous()
        return h, enc_out, bias.contiguous()

    def forward(self, *args: torch.Tensor, targets: torch.Tensor | None = None):
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        from trainer.models.t5 import output_scale, shift_right

        e, start, end = self.n_enc, self.start, self.end
        bias = enc_out = None
        if self.is_first:
            h = self.encoder.dropout(self.shared(args[0]))
        elif start == 0 or start == e or start == e + self.n_dec:
            h = args[0]
        elif start < e:
            h, bias = args
        else:
            h, enc_out, bias = args
        if start < e and end > start:
            mask = create_bidirectional_mask(config=self.enc_config, inputs_embeds=h, attention_mask=None)
            for block in self.encoder.block.values():
                h, bias, _ = block(h, mask, bias, None, None, None)
        if start <= e < end:
            enc_out = self.encoder.dropout(self.encoder.final_layer_norm(h))
            h = self.decoder.dropout(self.decoder.embed_tokens(shift_right(targets, self.config)))
            bias = None
        if end > max(start, e):
            mask = create_causal_mask(config=self.dec_config, inputs_embeds=h, attention_mask=None, **_no_cache())
            cross = create_bidirectional_mask(config=self.dec_config, inputs_embeds=h, attention_mask=None,
                                              encoder_hidden_states=enc_out)
            cross_bias = None
            for block in self.decoder.block.values():
                h, bias, cross_bias = block(h, mask, bias, enc_out, cross, cross_bias)
        if self.is_last:
            h = self.decoder.dropout(self.decoder.final_layer_norm(h))
            scale = output_scale(self.config)
            if scale is not None:
                h = h * scale
            return _head_out(self.lm_head, h, targets, self.loss_chunks)
        return self._outputs(h, bias, enc_out)


class WideResNetStage(nn.Module):
    """Wide-ResNet: stem | bottlenecks (global index over layer1..layer4) | pool + fc."""

    loss_chunks = 1

    def __init__(self, full: nn.Module, r: StageRange, is_first: bool, is_last: bool):
        from trainer.models.wide_resnet import STAGES

        super().__init__()
        self.config = full.config
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.conv1, self.bn1, self.relu, self.maxpool = full.conv1, full.bn1, full.relu, full.maxpool
        index = 0
        self.groups: list[str] = []
        for name in STAGES:
            held = {}
            for j, block in enumerate(getattr(full, name)):
                if r.start <= index < r.end:
                    held[str(j)] = block
                index += 1
            if held:
                setattr(self, name, nn.ModuleDict(held))
                self.groups.append(name)
        if is_last:
            self.avgpool, self.fc = full.avgpool, full.fc

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from trainer.models.wide_resnet import classify

        h = self.maxpool(self.relu(self.bn1(self.conv1(x)))) if self.is_first else x
        for name in self.groups:
            for block in getattr(self, name).values():
                h = block(h)
        if self.is_last:
            return classify(self.fc, self.avgpool, h, targets)
        return h


_STAGE_CLASSES = {**dict.fromkeys(DECODER_TYPES, DecoderStage), "gpt2": GPT2Stage, "bert": BertStage,
                  "bloom": BloomStage, "t5": T5Stage, "wide_resnet": WideResNetStage}


@dataclass
class TiedWeights:
    """Parameters that were one tensor in the full model and are copies across stages.

    `groups` lists, per tied tensor, the (stage index, parameter name) of every copy; `local`
    maps stage index to the module this rank holds.
    """

    groups: list[list[tuple[int, str]]] = field(default_factory=list)

    def stages_of(self, group: list[tuple[int, str]]) -> list[int]:
        return sorted({s for s, _ in group})


def split_model(full: nn.Module, ranges: list[StageRange], keep: list[int] | None = None,
                params: list[int] | None = None) -> tuple[dict[int, nn.Module], TiedWeights]:
    """Stage modules for the stage indices in `keep` (all when None), plus the tied-weight map.
    `params`, when given, receives every stage's parameter count (tied copies included).

    Stages built for other ranks are dropped here, so their layers are freed with the full model.
    """
    cls = _STAGE_CLASSES[model_type(full)]
    n = len(ranges)
    stages = {r.stage: cls(full, r, r.stage == 0, r.stage == n - 1) for r in ranges}
    tied = _untie_across_stages(stages)
    if params is not None:
        params[:] = [sum(p.numel() for p in stages[s].parameters()) for s in sorted(stages)]
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


def chain_forward(stages: list[nn.Module], input_ids: torch.Tensor, targets: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Run stage modules one after another in this process (tests, debugging, the dry run)."""
    h: tuple = (input_ids,)
    for m in stages:
        out = m(*h) if targets is None else m(*h, targets=targets)
        h = out if isinstance(out, tuple) else (out,)
    return h[0]
