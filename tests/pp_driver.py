"""Minimal PP/TP/DP training driver for equivalence tests of trainer.parallel (run under torchrun).

Builds a tiny seeded transformers model, composes PP (split) -> TP -> FSDP exactly in that
order, trains a few Adam steps on seeded random tokens and writes the per-step global loss to
--out as JSON. With every degree 1 it is the single-process reference (plain full model).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def tiny_model(family: str, layers: int, tie: bool):
    import transformers

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=64)
    if family == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=tie, **common)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie, **common)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=layers, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        raise SystemExit(f"unknown family {family}")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="llama")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--sharding", default="zero3")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--vstages", type=int, default=1)
    ap.add_argument("--partition", default="uniform_transformer")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--clip", type=float, default=0.5, help="max grad norm (small: clipping always acts)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from trainer.parallel.grad_norm import clip_grad_norm
    from trainer.parallel.pipeline import (
        PipelineRunner,
        check_schedule,
        pp_lines,
        split_for_pipeline,
        tied_groups,
        untied_params,
    )
    from trainer.parallel.tensor_parallel import apply_tp

    world = int(os.environ.get("WORLD_SIZE", "1"))
    assert world == a.pp * a.tp * a.dp, (world, a.pp, a.tp, a.dp)
    model = tiny_model(a.family, a.layers, a.tie)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (a.pp, a.dp, a.tp), mesh_dim_names=("pp", "dp_shard", "tp"))
    dp_rank = mesh["dp_shard"].get_local_rank() if mesh is not None else 0
    pp_rank = mesh["pp"].get_local_rank() if mesh is not None else 0
    tp_rank = mesh["tp"].get_local_rank() if mesh is not None else 0

    runner = None
    if a.pp > 1:
        spec = check_schedule(a.schedule, a.pp, a.vstages, a.micro, a.layers)
        parts, tied, ranges = split_for_pipeline(model, spec, a.partition, pp_rank, a.pp, a.vstages)
        del model
    else:
        parts, tied = {0: model}, None
    for part in parts.values():  # PP first, then TP, then FSDP: the order compose.py uses
        if a.tp > 1:
            apply_tp(part, mesh["tp"], part.config)
        if a.dp > 1:
            from torch.distributed.fsdp import fully_shard

            reshard = a.sharding == "zero3"
            layers = part.model.layers if hasattr(part, "model") else part.transformer.h
            for block in (layers.values() if hasattr(layers, "values") else layers):
                fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=reshard)
            fully_shard(part, mesh=mesh["dp_shard"], reshard_after_forward=reshard)
    if a.pp > 1:
        pgs = tied_groups(tied, spec, a.pp, a.pp * a.vstages, pp_lines(mesh))
        runner = PipelineRunner(parts, spec, a.pp * a.vstages, mesh["pp"].get_group(), torch.device("cpu"),
                                tied=tied, tied_pgs=pgs)
    params = [p for part in parts.values() for p in part.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)

    local_b = a.batch // a.dp
    out_losses, norms = [], []
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, 128, (a.batch, a.seq + 1), generator=g)
        tokens = tokens[dp_rank * local_b:(dp_rank + 1) * local_b]
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        opt.zero_grad()
        if runner is not None:
            loss = runner.forward_backward(x, y, a.micro)
        else:
            # Gradient accumulation over the same microbatches the pipeline uses.
            loss = torch.zeros(())
            for xm, ym in zip(x.chunk(a.micro), y.chunk(a.micro), strict=True):
                logits = parts[0](xm) if hasattr(parts[0], "is_first") else parts[0](input_ids=xm).logits
                mb = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ym.reshape(-1),
                                     reduction="sum") / y.numel()
                mb.backward()
                loss += mb.detach()
        if world == 1:  # the reference clips with torch's own function
            norm = float(torch.nn.utils.clip_grad_norm_(params, a.clip))
        elif runner is not None:
            norm = clip_grad_norm(untied_params(runner), a.clip, mesh["pp"].get_group(), all_params=params)
        else:
            norm = clip_grad_norm(params, a.clip)
        norms.append(norm)
        opt.step()
        if loss is not None and mesh is not None and a.dp > 1:
            dist.all_reduce(loss, group=mesh["dp_shard"].get_group())
            loss /= a.dp
        if loss is not None:
            out_losses.append(float(loss))
    last_pp = a.pp - 1 if a.schedule.lower() not in ("zbv", "dualpipev") or a.pp == 1 else 0
    if pp_rank == last_pp and dp_rank == 0 and tp_rank == 0:
        with open(a.out, "w") as f:
            local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
            json.dump({"losses": out_losses, "grad_norms": norms, "local_params": sum(t.numel() for t in local),
                       "dtensor_params": sum(hasattr(p, "to_local") for p in params)}, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
