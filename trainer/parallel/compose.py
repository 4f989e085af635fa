"""THE one place where parallelisms are composed onto a model.

Order (torchtitan's): split for PP first; then on each part TP, activation checkpointing, compile
of each block, FSDP/DDP. Sharded layouts (FSDP2, TP) are composed on the meta device and each rank
then materialises only its shards from the seeded CPU model, which one rank per stage builds
(materialize.py).
PP: trainer/parallel/pipeline.py (+ stages.py, partition.py); TP: tensor_parallel.py; activation
checkpointing: activation_checkpoint.py; compile: compile.py. The LM loss runs inside the root
forward (trainer/models/lm_loss.py), chunked over tokens (train.loss_chunks).

`parallelize()` returns a `Parallelized`: the model parts this rank holds plus
`forward_backward(inputs, labels, n_micro)`, which runs one batch split into n_micro
microbatches and returns the batch's mean loss (None on ranks that do not compute the loss,
e.g. non-last pipeline stages). Gradients equal those of the mean loss over the GLOBAL batch,
however it is split over DP ranks and microbatches: each microbatch contributes
loss_sum / (global_weight / dp), and DDP/FSDP then average over the dp ranks. global_weight
(target tokens of the whole global batch) is an all-reduce of the local counts, known before
the forward (skipped where every sample carries the same count: causal LM on packed blocks, images).
Per-rank means averaged over DP would be wrong whenever ranks hold different counts (masked LM:
11/8/10 vs 9/8/11 masked tokens).

Nothing here waits for the device: the loss and the gradient norm stay tensors (the trainer reads
them at log steps), clipping scales on the device, batches are copied with non_blocking.

parallel.dp_sync diloco (diloco.py): the dp_replicate dim gets no wrapper (each replica steps alone,
no gradient all-reduce), FSDP2 covers dp_shard only, and a DiLoCo object in `extras["diloco"]`
averages the replicas' pseudo-gradients over dp_replicate, per pipeline stage. Every layout's
data-parallel collectives are counted by the SyncMeter in `extras["sync_meter"]` (sync_meter.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from trainer.config import Config, ConfigError
from trainer.config.checks import microbatch_tokens, resolve_loss_chunks
from trainer.models.build import ModelSpec, Task
from trainer.models.lm_loss import compile_loss, install_loss_forward, loss_head
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing, blocks_of
from trainer.parallel.compile import compile_blocks, resolve_compile
from trainer.parallel.data_parallel import apply_ddp, apply_fsdp, meter_fsdp
from trainer.parallel.master_weights import MasterWeights, bf16_weights_suit
from trainer.parallel.materialize import materialize, move, to_meta
from trainer.parallel.mesh import ParallelDims
from trainer.parallel.parallelized import Parallelized
from trainer.parallel.sync_meter import SyncMeter
from trainer.runtime.dist_env import resolve_param_dtype
from trainer.runtime.phase_hooks import hook_module

log = logging.getLogger("trainer")


def check_supported(cfg: Config) -> None:
    """The config against the model (config_checks.check_model) and the pipeline and tensor-parallel
    constraints, checked before any process group exists (the vocabulary, known only once the
    tokenizer is built, is checked again in apply_tp)."""
    from trainer.config.checks import check_model
    from trainer.models.build import FAMILIES, build_hf_config

    p, t = cfg.parallel, cfg.train
    if p.pp == 1 and p.virtual_stages != 1:
        raise ConfigError(f"parallel.virtual_stages {p.virtual_stages} needs pipeline parallelism (parallel.pp > 1)")
    family, hf = build_hf_config(cfg.model)
    check_model(cfg, hf, FAMILIES[family].task)
    if p.pp == 1 and p.tp == 1:
        return
    from trainer.config.partition import partition_layers
    from trainer.parallel.pipeline import check_schedule
    from trainer.parallel.stages import SUPPORTED
    from trainer.parallel.tensor_parallel import check_tp

    if p.pp > 1:
        from trainer.models.layout import model_layout

        if hf.model_type not in SUPPORTED:
            raise ConfigError(f"parallel.pp: pipeline splitting supports {', '.join(SUPPORTED)}, "
                              f"not {hf.model_type!r}")
        # The model's units and Merak items, counted on the meta device (trainer/models/layout.py).
        layout = model_layout(family, hf, cfg.model.path or cfg.model.preset)
        check_schedule(p.pp_schedule, p.pp, p.virtual_stages, t.microbatch_num * t.grad_acc_steps,
                       layout.num_units)
        partition_layers(p.partition, layout.num_units, p.pp * p.virtual_stages, layer_params=1,
                         counting=layout.counting)
    check_tp(hf, p.tp, check_vocab=False)
    from trainer.parallel.tensor_parallel import sequence_parallel_applies

    if p.tp > 1 and p.sequence_parallel and sequence_parallel_applies(hf, p.pp > 1) and cfg.data.seq_len % p.tp:
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} is not divisible by parallel.tp {p.tp} (sequence "
                          f"parallelism shards the sequence); change one, or set parallel.sequence_parallel false")


def parallelize(model: nn.Module, spec: ModelSpec, dims: ParallelDims, cfg: Config, device: torch.device,
                backend: str) -> Parallelized:
    check_supported(cfg)
    if dims.mesh is not None:
        from trainer.parallel.diloco import check_layout

        check_layout(cfg, dims)  # refusals before anything is built; one replica only warns
    t = cfg.train
    chunks = resolve_loss_chunks(t.loss_chunks, spec.task, int(getattr(spec.hf_config, "vocab_size", 0) or 0),
                                 microbatch_tokens(cfg))
    compile_mode = resolve_compile(t.compile, device.type)
    task = Task(spec.task, fused=spec.task != "mae")
    if task.fused:
        install_loss_forward(model, chunks)
    if dims.pp > 1:
        return _parallelize_pipeline(model, spec, dims, cfg, device, backend, task, chunks, compile_mode)
    # bf16 parameters (train.param_dtype) are FSDP2's mixed precision: FSDP2 on every layout then.
    mixed = resolve_param_dtype(t.param_dtype, t.dtype, device.type, spec.task) == "bf16"
    data_parallel = dims.mesh is not None and (dims.dp > 1 or mixed)
    ref = to_meta(model) if _sharded(dims) else None
    if ref is None:
        model.to(device)
    if dims.tp > 1:
        _apply_tp(model, spec, dims, cfg, pipeline=False)
    _checkpoint_and_compile(model, cfg, dims, compile_mode)
    par = Parallelized([model], task, dims, device, cfg.train.dtype)
    if data_parallel:
        par.model_parts = [_apply_dp(par, model, blocks_of(model), dims, cfg, backend)]
    elif mixed and bf16_weights_suit(model):
        # One process: bf16 compute weights over fp32 masters (master_weights.py), the numbers of
        # FSDP2 on a mesh of this rank alone without its per-parameter copies (25 of 204 ms a step
        # at smollm-1.7b on an H100; bench/results/gpu_step_profile-smollm-1.7b.txt).
        par.extras["master_weights"] = MasterWeights(model, compile_mode=compile_mode,
                                                     compile_backend=cfg.train.compile_backend)
        par.bf16_weights = True
        log.info("train.param_dtype bf16: bf16 compute weights over fp32 master weights in one process; %s",
                 "fused AdamW over fp32 gradients cast from theirs" if compile_mode == "false" else
                 "AdamW reads their bf16 gradients and writes them (one compiled pass per parameter)")
    if ref is not None:
        materialize(model, ref, device, group=dims.stage_group, source=dims.builds_weights)
    if _diloco(cfg, dims):
        _attach_diloco(par, dims, cfg, tied=[])
    hook_module(par.model_parts[0], data_parallel=dims.dp > 1)  # heartbeat phases (phase_hooks.py)
    return par


def builds_on_meta(dims: ParallelDims) -> bool:
    """This rank builds the model on the meta device and receives its weights (materialize.py)."""
    return _sharded(dims) and not dims.builds_weights


def copies_built_here(dims: ParallelDims, rank: int, local_rank: int, local_world_size: int) -> int:
    """How many ranks of this machine build the full fp32 model on its CPU at once: every one of
    them, unless the layout is sharded; then only each stage's first rank (its dp and tp
    coordinates 0: rank % (dp x tp) == 0, as init_device_mesh lays ranks out, tp fastest).
    A machine's ranks are consecutive (torchrun, Slurm's block distribution)."""
    first = rank - local_rank
    here = range(first, first + max(local_world_size, 1))
    if not _sharded(dims):
        return len(here)
    return sum(1 for r in here if r % (dims.dp * dims.tp) == 0)


def _apply_tp(module: nn.Module, spec: ModelSpec, dims: ParallelDims, cfg: Config, pipeline: bool,
              announce: bool = True) -> None:
    from trainer.parallel.tensor_parallel import apply_tp, sequence_parallel_applies

    sp = cfg.parallel.sequence_parallel and sequence_parallel_applies(spec.hf_config, pipeline)
    apply_tp(module, dims.mesh["tp"], spec.hf_config, sequence_parallel=sp)
    if not announce:
        return
    log.info("TP over %d ranks: attention/MLP column+row parallel, vocab-parallel embedding, head and loss%s",
             dims.tp, "; sequence parallel norms and residual stream" if sp else "")
    if cfg.parallel.sequence_parallel and not sp:
        log.info("parallel.sequence_parallel: not applied (%s)", "pipeline stages send replicated activations"
                 if pipeline else f"{spec.family}: decoder families only")


def _sharded(dims: ParallelDims) -> bool:
    """Layouts whose ranks hold parts of tensors: built on meta, then materialised shard by shard."""
    return dims.mesh is not None and (dims.tp > 1 or (dims.fsdp and dims.dp > 1))


def _checkpoint_and_compile(module: nn.Module, cfg: Config, dims: ParallelDims, compile_mode: str,
                            announce: bool = True) -> None:
    """Activation checkpointing, then torch.compile, of every block of a model or stage (in place),
    and of the chunked LM head + loss where this rank computes it (not the vocab-parallel one of
    TP, which does not compile: lm_loss.py says why)."""
    mode = cfg.train.activation_checkpointing
    n = apply_activation_checkpointing(module, mode)
    if n and announce:
        log.info("activation checkpointing %s on %d blocks", mode, n)
    if compile_mode == "false":
        return
    backend = cfg.train.compile_backend
    n = compile_blocks(module, mode=compile_mode, backend=backend)
    head = loss_head(module)
    loss = head is not None and dims.tp == 1 and hasattr(module, "loss_chunks")
    if loss:
        compile_loss(head, backend)
    if announce:
        log.info("torch.compile: %d blocks compiled in place%s (backend %s, fullgraph, static shapes, %s)", n,
                 " + LM head and loss" if loss else "", backend,
                 "eager where a block cannot compile" if compile_mode == "try" else "errors end the run")


def _apply_dp(par: Parallelized, model: nn.Module, blocks: list[nn.Module], dims: ParallelDims, cfg: Config,
              backend: str, pipeline: bool = False) -> nn.Module:
    """FSDP2 (zero2/zero3/hybrid) or DDP on one model or pipeline stage; returns what to run."""
    meter = par.extras.setdefault("sync_meter", SyncMeter())
    if _diloco(cfg, dims):
        return _apply_replica_dp(par, model, blocks, dims, cfg, backend, pipeline)
    if dims.fsdp:
        _apply_fsdp(par, model, blocks, dims.fsdp_mesh, cfg, backend, reshard=dims.sharding.startswith("zero3"),
                    pipeline=pipeline)
        log.info("FSDP2 %s over mesh %s: %d blocks + root", dims.sharding, dims.fsdp_mesh.mesh_dim_names, len(blocks))
        return model
    if resolve_param_dtype(cfg.train.param_dtype, cfg.train.dtype, par.device.type) == "bf16":
        # DDP with bf16 parameters: FSDP2 over (replicate dp, shard 1), i.e. replicated weights
        # whose gradients are all-reduced, with FSDP2's mixed precision.
        mesh = dims.mesh["dp_replicate", "dp_shard"]
        _apply_fsdp(par, model, blocks, mesh, cfg, backend, reshard=False, pipeline=pipeline)
        log.info("DDP as FSDP2 over (replicate %d, shard 1) for train.param_dtype bf16: %d blocks + root",
                 dims.dp_replicate, len(blocks))
        return model
    if dims.tp > 1:
        raise ConfigError("parallel.sharding: ddp with tensor parallelism is not supported; use zero2 or zero3")
    if pipeline:
        # DDP's reducer cannot take several microbatch forwards before a backward; the
        # FSDP2-based replicate (which PipelineStage drives like FSDP) can.
        from torch.distributed._composable.replicate_with_fsdp import replicate

        log.info("DDP (replicate) over %d ranks on each pipeline stage", dims.dp)
        model = replicate(model, mesh=dims.fsdp_mesh)
        meter_fsdp(model, meter, all_reduces=True)
        return model
    log.info("DDP over %d ranks", dims.dp)
    from trainer.config.batches import parse_batches

    # One Python comm hook: it meters every bucket (dp_sync_bytes), sums in rank order where needed
    # (gloo, >= 3 ranks), and lets a profile time each bucket's reduction (reduce_timing.py).
    observe = bool(parse_batches(cfg.profile.batch) or cfg.profile.num_prof_steps)
    return apply_ddp(model, dims.fsdp_mesh, device=par.device, backend=backend, observe=observe, meter=meter)


def _diloco(cfg: Config, dims: ParallelDims) -> bool:
    """DiLoCo runs (check_layout has refused what cannot run): diloco asked for, and replicas to average."""
    return cfg.parallel.dp_sync == "diloco" and dims.mesh is not None and dims.dp_replicate > 1


def _apply_replica_dp(par: Parallelized, model: nn.Module, blocks: list[nn.Module], dims: ParallelDims,
                      cfg: Config, backend: str, pipeline: bool) -> nn.Module:
    """Under DiLoCo: nothing over the replicas; FSDP2 over dp_shard (the within-node shards of
    *_hybrid, or one rank for bf16 parameters' mixed precision), else the plain module."""
    bf16 = resolve_param_dtype(cfg.train.param_dtype, cfg.train.dtype, par.device.type) == "bf16"
    if dims.dp_shard == 1 and not bf16:
        log.info("DiLoCo: no data-parallel wrapper; each of %d replicas steps alone", dims.dp_replicate)
        return model
    _apply_fsdp(par, model, blocks, dims.mesh["dp_shard"], cfg, backend, reshard=dims.sharding.startswith("zero3"),
                pipeline=pipeline)
    log.info("DiLoCo: FSDP2 over the %d shard ranks of each of %d replicas: %d blocks + root", dims.dp_shard,
             dims.dp_replicate, len(blocks))
    return model


def _attach_diloco(par: Parallelized, dims: ParallelDims, cfg: Config, tied: list[nn.Parameter]) -> None:
    """The outer loop over this stage's dp_replicate group, on the final (materialised) parameters."""
    from trainer.parallel.diloco import DiLoCo, agree, describe, split_fragments

    d = cfg.parallel.diloco
    blocks = [b for m in par.model_parts for b in blocks_of(m)]
    frags, problem = split_fragments(par.model_parts, blocks, d.fragments, tied)
    agree(problem)  # stages hold different blocks: every rank raises, none waits in a collective
    par.extras["diloco"] = DiLoCo(frags, dims.mesh["dp_replicate"].get_group(), d, par.extras["sync_meter"],
                                  dims.coord("dp_replicate"))
    # Each replica's loss is its own batch's mean (loss_denominator counts over its shard ranks only).
    par.extras["replica_mesh"] = (dims.mesh["dp_shard"], dims.dp_shard)
    log.info("%s", describe(frags, d, dims.dp_replicate))


def _apply_fsdp(par: Parallelized, model: nn.Module, blocks: list[nn.Module], mesh: Any, cfg: Config, backend: str,
                reshard: bool, pipeline: bool = False) -> None:
    # bf16 parameters imply train.dtype bf16 (config_checks): the dtype alone decides.
    bf16 = cfg.train.dtype == "bf16" and bf16_weights_suit(model)
    apply_fsdp(model, blocks, mesh, reshard_after_forward=reshard, param_dtype=torch.bfloat16 if bf16 else None,
               backend=backend, pipeline=pipeline)
    meter_fsdp(model, par.extras.setdefault("sync_meter", SyncMeter()), all_reduces=mesh.ndim > 1)
    par.bf16_weights = bf16
    par.sync_every_microbatch = reshard


def _parallelize_pipeline(model: nn.Module, spec: ModelSpec, dims: ParallelDims, cfg: Config,
                          device: torch.device, backend: str, task: Task, chunks: int,
                          compile_mode: str) -> Parallelized:
    """PP first (this rank's stages), then on each stage TP, checkpointing, compile, FSDP/DDP."""
    from trainer.parallel.materialize import cpu_reference
    from trainer.parallel.pipeline import (
        PipelineParallelized,
        PipelineRunner,
        check_schedule,
        pp_lines,
        split_for_pipeline,
        tied_groups,
    )
    p, t = cfg.parallel, cfg.train
    if task.kind not in ("causal_lm", "masked_lm", "seq2seq", "image"):
        raise ConfigError(f"parallel.pp: pipeline parallelism supports language models, not {spec.family}")
    sched = check_schedule(p.pp_schedule, p.pp, p.virtual_stages, t.microbatch_num * t.grad_acc_steps,
                           spec.num_layers)
    num_stages = p.pp * p.virtual_stages
    parts, tied, _ = split_for_pipeline(model, sched, p.partition, dims.coord("pp"), p.pp, p.virtual_stages,
                                        name=cfg.model.path or cfg.model.preset)
    del model  # other ranks' layers are freed with it
    sharded = _sharded(dims)
    # Stages of one rank share modules (rotary embeddings): take every value before any goes to meta.
    refs = {s: cpu_reference(part) for s, part in parts.items()} if sharded else {}
    par = PipelineParallelized([], task, dims, device, cfg.train.dtype)
    for i, (s, part) in enumerate(sorted(parts.items())):
        part.loss_chunks = chunks  # the last stage computes the loss in its forward, chunked
        move(part, "meta" if sharded else device)  # ties inside a stage stay one parameter
        if dims.tp > 1:
            _apply_tp(part, spec, dims, cfg, pipeline=True, announce=i == 0)
        _checkpoint_and_compile(part, cfg, dims, compile_mode, announce=i == 0)
        if dims.dp > 1 or resolve_param_dtype(t.param_dtype, t.dtype, device.type) == "bf16":
            parts[s] = _apply_dp(par, part, blocks_of(part), dims, cfg, backend, pipeline=True)
    for s in refs:
        materialize(parts[s], refs[s], device, group=dims.stage_group, source=dims.builds_weights)
    pp_group = dims.mesh["pp"].get_group()
    pgs = tied_groups(tied, sched, p.pp, num_stages, pp_lines(dims.mesh))
    par.runner = PipelineRunner(parts, sched, num_stages, pp_group, device, tied=tied, tied_pgs=pgs, tp=dims.tp)
    par.model_parts = par.runner.model_parts
    par.owns_loss = par.runner.has_last
    par.pp_group = pp_group
    if _diloco(cfg, dims):
        _attach_diloco(par, dims, cfg, tied=[p for ps, _ in par.runner.tied_local for p in ps])
    log.info("PP %s over %d ranks, %d stages (%s on this rank), %d microbatches", sched.name, p.pp, num_stages,
             ",".join(map(str, par.runner.stage_ids)), t.microbatch_num * t.grad_acc_steps)
    return par
