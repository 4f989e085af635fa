"""`trainer --dry-run [--json] [--config X.yaml] [overrides]`: the layout a training command would
run, and each stage's memory, before anything is allocated.

The config is resolved and checked exactly as for training (the same one-line errors), the model
is built on the meta device (shapes, no storage), split into the pipeline stages the partition
names, and one microbatch is run through the stages on the meta device, counting the tensors
each stage saves for backward. No data is read (the vocabulary is the preset's), no weight is
allocated, no process group starts, no file is written. The world is pp x dp x tp (dp from
parallel.dp, default 1): the command sizes a launch, it need not run under one.

The memory arithmetic is contract/memory.py (torch-free, shared with the runner); `--json`
prints the same plan as one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from contract.memory import (
    DTYPE_BYTES,
    StageLoad,
    component_dtypes,
    gib,
    in_flight,
    loss_scratch_bytes,
    sizing_dtype,
    stage_memory,
)
from trainer.config import Config

FLAGS = ("--dry-run", "--json")


def main(argv: list[str]) -> int:
    from trainer.config import resolve
    from trainer.config.argv import parse_train_args

    as_json = "--json" in argv
    config_path, overrides = parse_train_args([a for a in argv if a not in FLAGS])
    cfg = resolve(config_path, overrides)
    plan = make_plan(cfg)
    print(json.dumps(plan, indent=1) if as_json else format_plan(plan))
    sys.stdout.flush()
    return 0


def _dtype(cfg: Config) -> tuple[str, str]:
    """(dtype, why) for sizing: `auto` is read as a CUDA GPU with bf16 (what a launch gets there)
    unless parallel.device is cpu (a Pi: fp32)."""
    if cfg.train.dtype == "auto":
        if cfg.parallel.device == "cpu":
            return sizing_dtype("auto", gpu=False), ""
        return sizing_dtype("auto", gpu=True), ("train.dtype auto sized as bf16 (a CUDA GPU with bf16); "
                                                "--parallel.device cpu or --train.dtype fp32 sizes fp32")
    return cfg.train.dtype, ""


def make_plan(cfg: Config) -> dict[str, Any]:
    from trainer.config.checks import microbatch_tokens, resolve_loss_chunks
    from trainer.config.partition import StageRange
    from trainer.models.build import FAMILIES, build_hf_config
    from trainer.models.layout import meta_model
    from trainer.models.lm_loss import install_loss_forward
    from trainer.parallel.compose import check_supported
    from trainer.parallel.mesh import ParallelDims
    from trainer.parallel.pipeline import check_schedule, describe_plan, local_stage_ids, plan_ranges
    from trainer.parallel.stages import split_model

    p, t = cfg.parallel, cfg.train
    dp = p.dp or 1
    world = p.pp * dp * p.tp
    dims = ParallelDims.from_config(p, world, world)
    name = cfg.model.path or cfg.model.preset
    family, hf = build_hf_config(cfg.model)
    task = FAMILIES[family].task
    check_supported(cfg)  # before any model is made: its sizes and layout checked in one line each
    model = meta_model(family, hf)
    total_params = sum(q.numel() for q in model.parameters())
    layout = _layout(family, hf, name, model, total_params)
    dtype, dtype_note = _dtype(cfg)
    n_micro = t.microbatch_num * t.grad_acc_steps
    micro = t.batch_size // t.microbatch_num
    chunks = resolve_loss_chunks(t.loss_chunks, task, int(getattr(hf, "vocab_size", 0) or 0), microbatch_tokens(cfg))
    if task != "mae":
        install_loss_forward(model, chunks)
    num_stages = p.pp * p.virtual_stages
    if num_stages > 1:
        sched = check_schedule(p.pp_schedule, p.pp, p.virtual_stages, n_micro, layout.num_units)
        ranges = plan_ranges(model, p.partition, num_stages, layout)
        params: list[int] = []
        stages, _ = split_model(model, ranges, params=params)
        note, lines = describe_plan(layout, ranges, p.partition, p.pp, sched.style, params)
        modules = [stages[s] for s in range(num_stages)]
        schedule = sched.name
    else:
        from trainer.config.partition import format_ranges

        ranges = [StageRange(0, 0, layout.num_units)]
        params, modules, note = [total_params], [model], None
        lines = format_ranges(ranges, 1, params=params, describe=layout.describe, first=layout.first_name,
                              last=layout.last_name, noun=layout.counting.noun)
        schedule = "none"
    loads = _measure(modules, task, hf, micro, cfg.data.seq_len, dtype, chunks, layout)
    out_stages = []
    for r, load, line in zip(ranges, loads, lines.splitlines(), strict=True):
        flight = in_flight(schedule, r.stage, num_stages, n_micro)
        mem = stage_memory(load, in_flight=flight, dtype=dtype, sharding=dims.sharding, dp=dims.dp, tp=p.tp)
        out_stages.append({"stage": r.stage, "units": [r.start, r.end], "line": line, "params": load.params,
                           "activation_bytes_per_microbatch": load.activation_bytes,
                           "boundary_bytes_per_microbatch": load.boundary_bytes, "memory": mem.to_dict()})
    if num_stages > 1:
        from trainer.config.schedules import schedule_spec

        spec = schedule_spec(schedule)
        for s in out_stages:
            s["pp_rank"] = next(r for r in range(p.pp) if s["stage"] in local_stage_ids(spec, r, p.pp, num_stages))
    ranks = _per_rank(out_stages, p.pp) if p.virtual_stages > 1 else None
    notes = [n for n in (dtype_note, _vocab_note(cfg, task)) if n]
    return {
        "model": name, "family": family, "task": task, "params": total_params, "units": layout.num_units,
        "unit": layout.counting.noun, "merak_items": layout.counting.items,
        "world": world, "mesh": {"pp": p.pp, "dp": dims.dp, "dp_replicate": dims.dp_replicate,
                                 "dp_shard": dims.dp_shard, "tp": p.tp},
        "sharding": dims.sharding, "schedule": schedule, "virtual_stages": p.virtual_stages,
        "partition": p.partition if num_stages > 1 else None, "partition_note": note,
        "microbatches": n_micro, "microbatch_size": micro, "seq_len": cfg.data.seq_len if task != "image" else None,
        "dtype": dtype, "notes": notes, "stages": out_stages, "ranks": ranks,
        "allocated": "nothing: meta device, no data read, no process group",
        "hang": hang_rule(cfg),  # the hang watch's budgets and the collectives' timeout (contract/hang.py)
    }


def _layout(family: str, hf: Any, name: str, model: Any, total_params: int) -> Any:
    """The model's pipeline layout (trainer/models/layout.py), or, for a family that has none
    (ViT-MAE: never split, check_supported refuses pp > 1 for it), the whole model as one unit.
    Before, `trainer --dry-run --model.preset tiny-vitmae` ended in that module's ValueError."""
    from trainer.config.partition import Counting
    from trainer.models.layout import Layout, Unit, model_layout
    from trainer.parallel.stages import SUPPORTED

    if getattr(hf, "model_type", None) in SUPPORTED:
        return model_layout(family, hf, name, model)  # check_supported reuses it
    unit = Unit("model", 0, total_params, (total_params,))
    return Layout(name, family, (unit,), 0, 0, {}, Counting(name, 1, "model", (0,), ("model",)), "embeddings",
                  "decoder")


def _vocab_note(cfg: Config, task: str) -> str:
    if cfg.data.source != "synthetic" and task not in ("image", "mae"):
        return "vocabulary: the preset's (the tokenizer built from data.source is not read by a dry run)"
    return ""


def _inputs(task: str, hf: Any, micro: int, seq: int) -> tuple[Any, Any]:
    import torch

    with torch.device("meta"):
        if task == "image":
            c, size = hf.num_channels, hf.image_size
            return torch.empty(micro, c, size, size), torch.zeros(micro, dtype=torch.long)
        if task == "mae":
            c, size, patch = hf.num_channels, hf.image_size, hf.patch_size
            return torch.empty(micro, c, size, size), torch.empty(micro, (size // patch) ** 2)
        return torch.zeros(micro, seq, dtype=torch.long), torch.zeros(micro, seq, dtype=torch.long)


def _measure(modules: list[Any], task: str, hf: Any, micro: int, seq: int, dtype: str, chunks: int,
             layout: Any) -> list[StageLoad]:
    """One microbatch through every stage on the meta device: per stage, the bytes its forward saves
    for backward (parameters excluded; at `dtype`), what it sends on, and the loss's scratch."""

    x, y = _inputs(task, hf, micro, seq)
    scale = DTYPE_BYTES[dtype] / 4  # measured in fp32 on the meta device
    with _no_value_checks():
        return _measure_stages(modules, task, hf, x, y, micro, seq, dtype, chunks, layout, scale)


@contextlib.contextmanager
def _no_value_checks() -> Iterator[None]:
    """transformers' mask helpers look at position VALUES to detect packed sequences, which meta
    tensors do not have; the trainer never packs several sequences into one row, so during the
    measurement that check answers 'none' (the masks' shapes are what the count needs)."""
    import transformers.masking_utils as mu

    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is not None:
        mu.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        if original is not None:
            mu.find_packed_sequence_indices = original


def _measure_stages(modules: list[Any], task: str, hf: Any, x: Any, y: Any, micro: int, seq: int, dtype: str,
                    chunks: int, layout: Any, scale: float) -> list[StageLoad]:
    units = [u.params for u in layout.units]
    # On a GPU, SDPA's flash / memory-efficient kernels keep one log-sum-exp per query row, not the
    # [batch, heads, seq, seq] probabilities the meta device's math path saves: those are left out.
    flash = getattr(hf, "_attn_implementation", None) == "sdpa" and task != "image"
    loads = []
    h: tuple = (x,)
    for i, module in enumerate(modules):
        if task == "mae":
            args, kwargs = (), {"pixel_values": h[0], "noise": y}
        elif len(modules) == 1:
            args, kwargs = (), {"pixel_values" if task == "image" else "input_ids": h[0], "targets": y}
        else:
            args, kwargs = h, {"targets": y}
        out, acts = _saved_bytes(module, args, kwargs, micro, seq if flash else None)
        last = i == len(modules) - 1
        outs = () if last else (out if isinstance(out, tuple) else (out,))
        boundary = sum(t.numel() * t.element_size() for t in outs)
        transient = 0
        vocab = int(getattr(hf, "vocab_size", 0) or 0)
        if last and task in ("causal_lm", "masked_lm", "seq2seq") and vocab:
            transient = loss_scratch_bytes(micro * seq, vocab, dtype, chunks)
        held = sum(q.numel() for q in module.parameters())
        loads.append(StageLoad(held, int(acts * scale), int(boundary * scale), int(transient), max(units, default=0)))
        h = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outs)
    return loads


def _saved_bytes(module: Any, args: tuple, kwargs: dict, micro: int, flash_seq: int | None) -> tuple[Any, int]:
    """(output, bytes of the tensors the forward saves for backward, parameters excluded). With
    `flash_seq`, [micro, heads, seq, seq] attention probabilities are left out (see the caller)."""
    import torch

    param_ids = {id(q) for q in module.parameters()}
    saved: dict[int, Any] = {}

    def pack(t: Any) -> Any:
        # Views (q/k/v each save a reshaped view of one normalised input) count their base once.
        base = t._base if t._base is not None else t
        # By what made it, not by shape alone: k^T is [micro, heads, head_dim, seq], the same shape
        # where head_dim = seq (Qwen3-0.6B at the Pi config's 128 tokens).
        scores = flash_seq is not None and base.dim() == 4 and base.shape[0] == micro and \
            base.shape[-1] == base.shape[-2] == flash_seq and "Softmax" in type(base.grad_fn).__name__
        if id(base) not in param_ids and not scores:
            saved[id(base)] = base  # keeps it alive: ids stay unique while counting
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    return out, sum(t.numel() * t.element_size() for t in saved.values())


def _per_rank(stages: list[dict], pp: int) -> list[dict]:
    """Totals per pipeline rank when a rank holds several (virtual) stages."""
    out = []
    for r in range(pp):
        mine = [s for s in stages if s.get("pp_rank") == r]
        keys = mine[0]["memory"].keys() if mine else []
        out.append({"pp_rank": r, "stages": [s["stage"] for s in mine],
                    "memory": {k: sum(s["memory"][k] for s in mine) for k in keys if k != "in_flight"}})
    return out


def hang_rule(cfg: Config) -> str:
    from contract.hang import describe

    def seconds(v: int | str) -> float | None:
        return None if v == "auto" else float(v)

    return describe(seconds(cfg.watch.hang_timeout_s), seconds(cfg.watch.startup_timeout_s),
                    seconds(cfg.parallel.timeout_s))


def format_plan(plan: dict[str, Any]) -> str:
    m = plan["mesh"]
    lines = [
        f"dry run: {plan['model']} ({plan['family']}), {plan['params'] / 1e6:.2f}M parameters, "
        f"{plan['units']} {plan['unit']} ({plan['merak_items']} Merak items)",
        f"world {plan['world']} = pp {m['pp']} x dp {m['dp']} x tp {m['tp']} "
        f"(mesh pp {m['pp']}, dp_replicate {m['dp_replicate']}, dp_shard {m['dp_shard']}, tp {m['tp']}); "
        f"sharding {plan['sharding']}",
    ]
    tokens = f" x {plan['seq_len']} tokens" if plan["seq_len"] else " images"
    sched = f"schedule {plan['schedule']}, " if plan["schedule"] != "none" else ""
    lines.append(f"{sched}{plan['microbatches']} microbatches of {plan['microbatch_size']}{tokens}; {plan['dtype']}")
    if plan["partition"]:
        lines.append(f"partition {plan['partition']}")
    if plan["partition_note"]:
        lines.append(f"  {plan['partition_note']}")
    for s in plan["stages"]:
        mem = s["memory"]
        lines.append(s["line"])
        lines.append(f"  memory per rank {format_memory(mem, s['activation_bytes_per_microbatch'], plan['dtype'])}")
    for r in plan["ranks"] or []:
        lines.append(f"pp rank {r['pp_rank']} (stages {', '.join(map(str, r['stages']))}): "
                     f"{gib(r['memory']['total'])}")
    lines += [f"note: {n}" for n in plan["notes"]]
    lines.append(f"allocated: {plan['allocated']}")
    lines.append(plan["hang"])
    return "\n".join(lines)


def format_memory(mem: dict, per_microbatch: int, dtype: str) -> str:
    """`4.58 GiB: weights 1013.6 MiB fp32, ...`: each part with the dtype it is held in."""
    d = component_dtypes(dtype)
    return (f"{gib(mem['total'])}: weights {gib(mem['weights'])} {d['weights']}, gradients {gib(mem['gradients'])} "
            f"{d['gradients']}, optimizer {gib(mem['optimizer'])} {d['optimizer']}, activations "
            f"{gib(mem['activations'])} {d['activations']} ({mem['in_flight']} microbatch(es) in flight x "
            f"{gib(per_microbatch)}), transient {gib(mem['transient'])}")
