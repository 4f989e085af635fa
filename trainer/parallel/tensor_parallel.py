"""Tensor parallelism with DTensor `parallelize_module`, one plan per model family.

Megatron layout: attention q/k/v column-parallel and the output projection row-parallel, MLP
up/gate column-parallel and down row-parallel, so each block needs one all-reduce per half.
Embeddings are vocab-parallel (row-wise on the vocabulary, partial sums all-reduced) and the
head is column-parallel on the vocabulary with its logits LEFT sharded (a DTensor, Shard(-1)):
the cross-entropy runs vocab-parallel (torch's loss_parallel, trainer/models/lm_loss.py), so no
TP rank ever holds the full [tokens, vocab] logits.

Sequence parallelism (parallel.sequence_parallel, decoder families, whole models), torchtitan's
plan: between the TP regions the residual stream, the norms and their activations are sharded
over the sequence (Shard(1)) instead of replicated: the embedding's partial sums are
reduce-scattered over the sequence, each norm runs on its sequence shard (SequenceParallel), each
attention/MLP input is all-gathered (PrepareModuleInput) and each output projection's partial sums
reduce-scattered back (RowwiseParallel(output_layouts=Shard(1))): the same two collectives' worth
of traffic per block as the all-reduces they replace, with 1/tp of the norm and residual
activations per rank. The residual stream stays a DTensor (global shape), so the transformers
model still computes positions, rotary embeddings and the causal mask for the whole sequence;
the final norm's output is gathered before the vocab-parallel head (lm_loss.py).
BERT (post-norm, its LayerNorms inside the output modules) and pipeline stages (which send plain
tensors between ranks) keep the replicated layout.

Works on a whole model or on a pipeline stage module (trainer.parallel.stages): submodules a
stage does not hold are simply skipped.
"""

from __future__ import annotations

from torch import nn

from trainer.config import ConfigError

DECODER_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class TensorParallelError(ConfigError, ValueError):
    """A model that cannot be split over tp ranks; the message is one line a user can act on."""


def check_tp(config, tp: int, check_vocab: bool = True) -> None:
    """Divisibility of heads, kv heads, MLP width and vocabulary by tp; one-line errors.

    `check_vocab=False` before the tokenizer has fixed the vocabulary (config-time checks)."""
    if tp == 1:
        return
    mt = getattr(config, "model_type", None)
    if mt not in (*DECODER_TYPES, "bert"):
        raise TensorParallelError(f"parallel.tp: tensor parallelism supports llama/qwen2/qwen3/bert, not {mt!r} "
                                  f"(GPT-2 packs q/k/v in one Conv1D); use parallel.tp 1")
    checks = [("num_attention_heads", config.num_attention_heads),
              ("num_key_value_heads", getattr(config, "num_key_value_heads", config.num_attention_heads)),
              ("intermediate_size", config.intermediate_size)]
    if check_vocab:
        checks.append(("vocab_size", config.vocab_size))
    for name, value in checks:
        if value % tp:
            raise TensorParallelError(f"parallel.tp: model {name}={value} is not divisible by tp={tp}; "
                                      f"choose a tp that divides it")


def sequence_parallel_applies(config, pipeline: bool) -> bool:
    """Whether parallel.sequence_parallel can shard this model's sequence (see the module doc)."""
    return getattr(config, "model_type", None) in DECODER_TYPES and not pipeline


def _plan(mt: str, tp_mesh, sequence_parallel: bool = False) -> tuple[dict, dict, list[str]]:
    """(top-level plan, per-layer plan, attention submodule name) for a family."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    vocab_embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    vocab_head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if mt in DECODER_TYPES and sequence_parallel:
        from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

        seq = Shard(1)
        top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                                     use_local_output=False),
               "model.norm": SequenceParallel(), "lm_head": vocab_head}
        layer = {"input_layernorm": SequenceParallel(),
                 "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                 desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                 use_local_output=True),
                 "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                 "self_attn.v_proj": ColwiseParallel(),
                 "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
                 "post_attention_layernorm": SequenceParallel(),
                 "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                           use_local_output=True),
                 "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                 "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False)}
        return top, layer, ["self_attn"]
    if mt in DECODER_TYPES:
        top = {"model.embed_tokens": vocab_embed, "lm_head": vocab_head}
        layer = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                 "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                 "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                 "mlp.down_proj": RowwiseParallel()}
        return top, layer, ["self_attn"]
    top = {"bert.embeddings.word_embeddings": vocab_embed, "cls.predictions.decoder": vocab_head}
    layer = {"attention.self.query": ColwiseParallel(), "attention.self.key": ColwiseParallel(),
             "attention.self.value": ColwiseParallel(), "attention.output.dense": RowwiseParallel(),
             "intermediate.dense": ColwiseParallel(), "output.dense": RowwiseParallel()}
    return top, layer, ["attention.self"]


def _layer_container(module: nn.Module, mt: str):
    if mt in DECODER_TYPES:
        return module.model.layers
    return module.bert.encoder.layer


def _present(module: nn.Module, plan: dict) -> dict:
    names = {n for n, _ in module.named_modules()}
    return {k: v for k, v in plan.items() if k in names}


def apply_tp(module: nn.Module, tp_mesh, config, sequence_parallel: bool = False) -> nn.Module:
    """Parallelize a full model or a stage module in place over the 1-D `tp_mesh` (with sequence
    parallelism where asked and `sequence_parallel_applies`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check_tp(config, tp)
    if tp == 1:
        return module
    mt = config.model_type
    top, layer_plan, attn_names = _plan(mt, tp_mesh, sequence_parallel and mt in DECODER_TYPES)
    # A weight tied inside this module (single-stage embedding/head) must stay one Parameter.
    ties = _find_ties(module)
    parallelize_module(module, tp_mesh, _present(module, top))
    layers = _layer_container(module, mt)
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        parallelize_module(block, tp_mesh, _present(block, layer_plan))
        for name in attn_names:
            _divide_head_counts(block.get_submodule(name), tp)
    _retie(module, ties)
    return module


def _divide_head_counts(attn: nn.Module, tp: int) -> None:
    # transformers reshapes with -1 heads today, but some versions and families read these
    # attributes; each rank holds 1/tp of the heads, so they must say so.
    for attr in ("num_heads", "num_attention_heads", "num_key_value_heads", "all_head_size"):
        if isinstance(getattr(attn, attr, None), int):
            setattr(attn, attr, getattr(attn, attr) // tp)


def _find_ties(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    seen: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        for pname, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            if (sub, pname) not in [(s, n) for s, n in seen.get(id(p), [])]:
                seen.setdefault(id(p), []).append((sub, pname))
    return [uses for uses in seen.values() if len(uses) > 1]


def _retie(module: nn.Module, ties: list[list[tuple[nn.Module, str]]]) -> None:
    for uses in ties:
        keep = getattr(uses[0][0], uses[0][1])
        for sub, pname in uses[1:]:
            other = getattr(sub, pname)
            if other is not keep:
                if getattr(other, "placements", None) != getattr(keep, "placements", None):
                    raise TensorParallelError("parallel.tp: tied weights ended up with different layouts; "
                                              "untie them (model.hf_overrides.tie_word_embeddings: false)")
                setattr(sub, pname, keep)
