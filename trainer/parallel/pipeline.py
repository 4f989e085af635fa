"""Pipeline parallelism on torch.distributed.pipelining.

Three steps, so that compose.py can put TP and FSDP between them:
1. `check_schedule` validates schedule, stages and microbatches up front (one-line errors);
2. `split_for_pipeline` cuts the seeded full model into this rank's stage modules;
3. `PipelineRunner` wraps the (possibly TP/FSDP-wrapped) stage modules in `PipelineStage`s and a
   schedule, and exposes `forward_backward(input_ids, labels, n_micro)` like `Parallelized`.

Loss: the last stage's forward takes the microbatch's targets (a keyword argument the schedule
splits like the inputs) and returns its token-summed cross entropy, computed chunk by chunk of
tokens (train.loss_chunks, trainer/models/lm_loss.py: no full logits), vocab-parallel under TP.
The schedule's loss_fn divides it by (labelled tokens of the whole global batch) / dp
(`Parallelized.loss_denominator`), and the schedule does not rescale gradients (scale_grads=False). Summed over microbatches, then averaged over DP by
FSDP/replicate, this is exactly the global-batch mean the single-process loop computes, also
when microbatches and DP ranks hold different numbers of labelled tokens (BERT masking).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from contract.schedules import stage_to_rank
from trainer.config.partition import (
    StageRange,
    describe_custom,
    format_ranges,
    partition_layers,
)
from trainer.config.schedules import ALIASES, SCHEDULES, PipelineError, ScheduleSpec, schedule_spec  # noqa: F401
from trainer.models.lm_loss import loss_context
from trainer.parallel.grad_norm import clip_grad_norm
from trainer.parallel.parallelized import Parallelized
from trainer.parallel.stages import TiedWeights, split_model, sync_tied_grads
from trainer.runtime import dist_env, heartbeat
from trainer.runtime.phase_hooks import hook_stage

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


def check_schedule(name: str, pp: int, virtual_stages: int, n_micro: int, layers: int) -> ScheduleSpec:
    """Every constraint of the chosen schedule, checked before any process group work."""
    spec = schedule_spec(name)
    v, stages = virtual_stages, pp * virtual_stages
    if not spec.multi and v != 1:
        raise PipelineError(f"parallel.virtual_stages: {spec.name} runs one stage per rank, got {v}; "
                            f"use interleaved1f1b/interleaved_zb/zbv/dualpipev for virtual stages")
    if spec.multi and v < 2:
        raise PipelineError(f"parallel.virtual_stages: {spec.name} needs at least 2 stages per rank, got {v}; "
                            f"set --parallel.virtual_stages 2")
    if spec.style == "v" and v != 2:
        raise PipelineError(f"parallel.virtual_stages: {spec.name} needs exactly 2 stages per rank, got {v}")
    if spec.name == "1f1b" and n_micro < pp:
        raise PipelineError(f"train.microbatch_num: 1f1b needs at least as many microbatches as stages "
                            f"({n_micro} < {pp}); raise --microbatch_num or use gpipe")
    if spec.name in ("interleaved1f1b", "interleaved_zb"):
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            raise PipelineError(f"train.microbatch_num: {spec.name} with pp={pp} needs microbatches < {pp} "
                                f"or a multiple of {rounds} (got {n_micro}); use a multiple of {pp}")
    if spec.style == "v" and n_micro < stages:
        raise PipelineError(f"train.microbatch_num: {spec.name} needs at least as many microbatches as "
                            f"stages ({n_micro} < {stages} = 2 x pp)")
    if layers < stages:
        raise PipelineError(f"parallel.pp: {layers} layers cannot fill {stages} stages (pp={pp} x "
                            f"virtual_stages={v}); lower pp or virtual_stages")
    return spec


def local_stage_ids(spec: ScheduleSpec, pp_rank: int, pp: int, num_stages: int) -> list[int]:
    return [s for s in range(num_stages) if stage_to_rank(s, pp, num_stages, spec.style) == pp_rank]


def plan_ranges(model: nn.Module, partition: str, num_stages: int, layout=None) -> list[StageRange]:
    """The stage ranges of `model` (its layout: trainer/models/layout.py) under `partition`."""
    from trainer.models.layout import layout_of

    layout = layout or layout_of(model)
    return partition_layers(partition, layout.num_units, num_stages, layer_params=layout.unit_weights(),
                            embed_params=layout.embed_params, head_params=layout.head_params,
                            counting=layout.counting)


def describe_plan(layout, ranges: list[StageRange], partition: str, pp: int, style: str,
                  params: list[int]) -> tuple[str | None, str]:
    """(the Merak-counting note or None, one line per stage: what it holds and its parameters)."""
    note = describe_custom(partition, layout.num_units, len(ranges), layout.counting)
    return note, format_ranges(ranges, pp, style=style, params=params, describe=layout.describe,
                               first=layout.first_name, last=layout.last_name, noun=layout.counting.noun)


def split_for_pipeline(model: nn.Module, spec: ScheduleSpec, partition: str, pp_rank: int, pp: int,
                       virtual_stages: int, name: str | None = None
                       ) -> tuple[dict[int, nn.Module], TiedWeights, list[StageRange]]:
    """This rank's stage modules (stage index -> module), the tied-weight map and every range.
    `name` (the preset) names the model in messages."""
    from trainer.models.layout import layout_of

    num_stages = pp * virtual_stages
    layout = layout_of(model, name)
    ranges = plan_ranges(model, partition, num_stages, layout)
    params: list[int] = []
    parts, tied = split_model(model, ranges, keep=local_stage_ids(spec, pp_rank, pp, num_stages), params=params)
    if pp_rank == 0:
        note, plan = describe_plan(layout, ranges, partition, pp, spec.style, params)
        if note:  # Merak's item counting: say how the numbers were read
            log.info("parallel.partition %s", note)
        log.info("pipeline %s, partition %s:\n%s", spec.name, partition, plan)
    return parts, tied, ranges


def tied_groups(tied: TiedWeights, spec: ScheduleSpec, pp: int, num_stages: int,
                pp_lines: list[list[int]]) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """Process groups joining, on every pipeline line, the ranks that hold copies of a tied weight.

    `pp_lines` lists the global ranks of each pipeline (one list per dp/tp coordinate, indexed
    by pp rank). Every rank must call this, in the same order, since new_group is collective.
    """
    me = dist.get_rank() if dist.is_initialized() else 0
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for g in tied.groups:
        key = tuple(tied.stages_of(g))
        pp_ranks = sorted({stage_to_rank(s, pp, num_stages, spec.style) for s in key})
        groups[key] = None
        if len(pp_ranks) < 2:
            continue
        for line in pp_lines:
            ranks = [line[r] for r in pp_ranks]
            pg = dist.new_group(ranks)
            if me in ranks:
                groups[key] = pg
    return groups


def make_loss_fn(state: dict) -> callable:
    """The schedule's loss: the last stage already returned its token-summed cross entropy."""
    def loss_fn(loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum / state["n_tokens"]

    return loss_fn


class PipelineRunner:
    """This rank's stages and the schedule; `forward_backward` returns the loss on the last stage."""

    def __init__(self, parts: dict[int, nn.Module], spec: ScheduleSpec, num_stages: int,
                 pp_group: dist.ProcessGroup, device: torch.device, tied: TiedWeights | None = None,
                 tied_pgs: dict | None = None, tp: int = 1):
        self.spec, self.num_stages, self.tp = spec, num_stages, tp
        self.stage_ids = sorted(parts)
        self.parts = parts
        self.tied, self.tied_pgs = tied or TiedWeights(), tied_pgs or {}
        # Resolve tied copies to Parameter objects now, after TP/FSDP replaced them (DDP adds
        # a "module." prefix, hence the unwrap).
        named = {s: dict(getattr(m, "module", m).named_parameters()) for s, m in parts.items()}
        self.tied_local = [([named[s][n] for s, n in g if s in parts], tuple(self.tied.stages_of(g)))
                           for g in self.tied.groups]
        self.tied_local = [(ps, key) for ps, key in self.tied_local if ps]
        self.tied_copy_ids = {id(named[s][n]) for g in self.tied.groups for s, n in g[1:] if s in parts}
        stage_cls = buffer_safe_stage()
        self.stages = [stage_cls(parts[s], s, num_stages, device, group=pp_group) for s in self.stage_ids]
        for stage in self.stages:
            hook_stage(stage)  # heartbeat phases: each microbatch's compute and p2p wait (phase_hooks.py)
        self.pp_group, self.device = pp_group, device
        self.pp_rank, self.pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        self.has_first = 0 in parts
        self.has_last = num_stages - 1 in parts
        self._state: dict = {"n_tokens": 1}
        self._schedules: dict[int, object] = {}

    @property
    def model_parts(self) -> list[nn.Module]:
        return [self.parts[s] for s in self.stage_ids]

    def _schedule(self, n_micro: int):
        if n_micro not in self._schedules:
            from torch.distributed.pipelining.schedules import get_schedule_class

            cls = get_schedule_class(self.spec.torch_name)
            stages = self.stages if self.spec.multi else self.stages[0]
            self._schedules[n_micro] = cls(stages, n_microbatches=n_micro,
                                           loss_fn=make_loss_fn(self._state), scale_grads=False)
        return self._schedules[n_micro]

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, n_micro: int,
                         denominator: float | None = None) -> torch.Tensor | None:
        """`denominator` defaults to the local batch's labelled tokens (no DP)."""
        if input_ids.shape[0] % n_micro:
            raise PipelineError(f"train.batch_size {input_ids.shape[0]} is not divisible by "
                                f"train.microbatch_num {n_micro}")
        self._state["n_tokens"] = denominator or max(int((labels != IGNORE_INDEX).sum()), 1)
        sched = self._schedule(n_micro)
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        target = labels if self.has_last else None
        with loss_context(self.tp):  # the last stage's forward and backward (vocab-parallel under TP)
            # `targets` reaches every local stage's forward; only the last stage uses it.
            sched.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False,
                       targets=labels)
        with heartbeat.during("collective"):  # waiting for the other copies' ranks: not this rank's compute
            for params, key in self.tied_local:
                sync_tied_grads(params, self.tied_pgs.get(key))
        if self.has_last:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return None

    @torch.no_grad()
    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, n_micro: int,
                  denominator: float | None = None) -> torch.Tensor | None:
        """Forward only, stage after stage with plain send/recv; loss on the rank of the last stage.

        Not a torch schedule: running a second schedule object over the training stages left
        their state changed and the next training step's gradients slightly off. What a stage
        sends is whatever its forward returned (a tensor of any shape, or T5's tuple), each tensor
        preceded by its shape (send_tensors).
        """
        n_tokens = denominator or max(int((labels != IGNORE_INDEX).sum()), 1)
        total = torch.zeros((), device=self.device)
        for x, y in zip(input_ids.tensor_split(n_micro), labels.tensor_split(n_micro), strict=True):
            h: tuple = (x,)
            for s in range(self.num_stages):
                here = self.rank_of(s)
                if here != self.pp_rank:
                    continue
                if s > 0 and self.rank_of(s - 1) != self.pp_rank:
                    h = recv_tensors(self.pp_group, self.rank_of(s - 1), self.device)
                with loss_context(self.tp):
                    out = self.parts[s](*h, targets=y)
                h = out if isinstance(out, tuple) else (out,)
                if s + 1 < self.num_stages and self.rank_of(s + 1) != self.pp_rank:
                    send_tensors(h, self.pp_group, self.rank_of(s + 1))
            if self.has_last:
                total += make_loss_fn({"n_tokens": n_tokens})(h[0], y)
        return total if self.has_last else None

    def rank_of(self, stage: int) -> int:
        return stage_to_rank(stage, self.pp_size, self.num_stages, self.spec.style)


_MAX_DIMS = 8


def send_tensors(tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup, dst: int) -> None:
    """Send a tuple of float tensors of any shapes: a header (count, then per tensor ndim + shape),
    then each tensor in fp32."""
    header = torch.zeros(1 + len(tensors) * (1 + _MAX_DIMS), dtype=torch.int64)
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        base = 1 + i * (1 + _MAX_DIMS)
        header[base] = t.dim()
        header[base + 1: base + 1 + t.dim()] = torch.tensor(t.shape)
    dev = tensors[0].device
    _p2p(dist.isend, torch.tensor([header.numel()], dtype=torch.int64, device=dev), group, dst)
    _p2p(dist.isend, header.to(dev), group, dst)
    for t in tensors:
        _p2p(dist.isend, t.float().contiguous(), group, dst)


def _p2p(op, tensor: torch.Tensor, group: dist.ProcessGroup, peer: int) -> None:
    """One blocking send/recv; on gloo its wait bounded by the collective timeout now (gloo's p2p
    keeps its group's first timeout otherwise: dist_env.set_collective_timeout)."""
    work = op(tensor, group=group, **({"group_dst": peer} if op is dist.isend else {"group_src": peer}))
    timeout = dist_env.p2p_timeout() if tensor.device.type == "cpu" else None
    work.wait(timeout) if timeout is not None else work.wait()


def recv_tensors(group: dist.ProcessGroup, src: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _p2p(dist.irecv, size, group, src)
    header = torch.zeros(int(size), dtype=torch.int64, device=device)
    _p2p(dist.irecv, header, group, src)
    header = header.cpu()
    out = []
    for i in range(int(header[0])):
        base = 1 + i * (1 + _MAX_DIMS)
        shape = header[base + 1: base + 1 + int(header[base])].tolist()
        t = torch.empty(shape, device=device)
        _p2p(dist.irecv, t, group, src)
        out.append(t)
    return tuple(out)


def _snapshot(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in module.buffers()]


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    with torch.no_grad():
        for b, value in saved or []:
            b.copy_(value)


_BUFFER_SAFE: list[type] = []


def buffer_safe_stage() -> type:
    """torch's PipelineStage whose metadata inference (the first step runs every stage once, on the
    first microbatch or, past stage 0, on uninitialised tensors of the right shape) leaves the
    stage's buffers as they were: BatchNorm's running statistics would take that extra, or garbage,
    batch (NaN evaluation losses on Wide-ResNet past its first stage). The buffers are restored once
    the inference's autograd graph is gone (restoring them earlier trips its version checks)."""
    if _BUFFER_SAFE:
        return _BUFFER_SAFE[0]
    from torch.distributed.pipelining import PipelineStage

    hooks: dict = {}
    if hasattr(PipelineStage, "_forward_metadata_inference"):  # torch >= 2.12: forward and backward
        def forward_inference(self, *args, **kwargs):
            if getattr(self, "_kept_buffers", None) is None:
                self._kept_buffers = _snapshot(self.submod)
            return PipelineStage._forward_metadata_inference(self, *args, **kwargs)

        def cleanup(self) -> None:
            PipelineStage._post_metadata_inference_cleanup(self)
            _restore(getattr(self, "_kept_buffers", None))
            self._kept_buffers = None

        hooks = {"_forward_metadata_inference": forward_inference, "_post_metadata_inference_cleanup": cleanup}
    elif hasattr(PipelineStage, "_shape_inference"):  # older torch: one forward under no_grad
        def shape_inference(self, *args, **kwargs):
            kept = _snapshot(self.submod)
            try:
                return PipelineStage._shape_inference(self, *args, **kwargs)
            finally:
                _restore(kept)

        hooks = {"_shape_inference": shape_inference}
    _BUFFER_SAFE.append(type("BufferSafeStage", (PipelineStage,), hooks))
    return _BUFFER_SAFE[0]


def pp_lines(mesh) -> list[list[int]]:
    """Global ranks of every pipeline (one list per non-pp mesh coordinate, indexed by pp rank)."""
    t = mesh.mesh
    return t.movedim(0, -1).reshape(-1, t.shape[0]).tolist()


def untied_params(runner: PipelineRunner) -> list[nn.Parameter]:
    """This rank's parameters minus tied copies held by later stages (they count once)."""
    return [p for m in runner.model_parts for p in m.parameters() if id(p) not in runner.tied_copy_ids]


@dataclass
class PipelineParallelized(Parallelized):
    """`Parallelized` for pipeline runs: the schedule drives forward and backward of this rank's
    stages; the loss exists only on the rank holding the last stage (`owns_loss`)."""

    runner: PipelineRunner | None = None
    pp_group: dist.ProcessGroup | None = None
    n_micro: int = 1

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, n_micro: int) -> torch.Tensor | None:
        self.n_micro = n_micro
        total = self.loss_denominator(inputs, labels)
        with self._autocast():  # bf16 without FSDP (FSDP casts through its mixed-precision policy)
            return self.runner.forward_backward(inputs.to(self.device, non_blocking=True),
                                                labels.to(self.device, non_blocking=True), n_micro, total)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        total = self.loss_denominator(inputs, labels)
        with self._autocast():  # the whole batch at once, as the single-process evaluation does
            return self.runner.eval_loss(inputs.to(self.device, non_blocking=True),
                                         labels.to(self.device, non_blocking=True), 1, total)

    def clip_grad_norm(self, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        return clip_grad_norm(untied_params(self.runner), max_norm, self.pp_group, all_params=self.parameters(),
                              optimizer=optimizer)
