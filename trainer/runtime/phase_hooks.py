"""Where the heartbeat's phases come from inside a step (trainer/runtime/heartbeat.py), hooked once
on what the layout built, each hook one `mark` (a few microseconds) and nothing when no heartbeat runs:

- one model (DDP, FSDP, one process): forward hooks on the root module mark each microbatch's
  forward and, when it returns, its backward; with data parallelism, a hook on the loss queues an
  autograd callback that runs once the backward's own work is done, before DDP's or FSDP's final
  callback waits for the last gradient reductions: that wait is marked `collective`, the
  exposed cost of a slower peer;
- pipeline stages: each `PipelineStage`'s forward/backward of a microbatch (stage, microbatch), and
  every point-to-point op the schedule posts (torch's `schedules._batch_p2p`): its `wait()` is
  marked recv or send with the peer; on gloo that wait is also given the process groups' current
  timeout (gloo's point-to-point ops keep the timeout their group was created with, the start-up
  one for DeviceMesh's groups, whatever `_set_pg_timeout` says later);
- torch.compile: dynamo's compile-start/end callbacks mark `compile` (its own, longer budget).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from trainer.runtime import dist_env
from trainer.runtime import heartbeat as hb


def hook_module(module: nn.Module, data_parallel: bool) -> None:
    """Forward/backward marks on the root module of a non-pipeline layout."""
    def pre(mod: nn.Module, args: Any) -> None:
        w = hb.CURRENT
        if w is not None and mod.training:
            w.mark("forward", mb=w.mb)

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        w = hb.CURRENT
        if w is None or not mod.training:
            return
        w.mark("backward", mb=w.mb)
        w.mb += 1
        if data_parallel and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(_queue_reduction_mark)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _reduction_mark() -> None:
    hb.mark("collective", detail="grad_reduce")


def _queue_reduction_mark(grad: torch.Tensor) -> None:
    # Runs first in the backward (the loss's gradient): queued now, the callback runs after the
    # backward's kernels and before the callbacks DDP/FSDP queue later in the backward.
    torch.autograd.Variable._execution_engine.queue_callback(_reduction_mark)


def hook_stage(stage: Any) -> None:
    """Forward/backward marks on one PipelineStage instance (stage index, microbatch)."""
    s = stage.stage_index
    for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                        ("backward_weight_one_chunk", "backward")):
        fn = getattr(stage, name)

        @functools.wraps(fn)
        def marked(chunk_id: int, *args: Any, _fn: Any = fn, _phase: str = phase, **kwargs: Any) -> Any:
            hb.mark(_phase, stage=s, mb=chunk_id)
            return _fn(chunk_id, *args, **kwargs)

        setattr(stage, name, marked)
    install_p2p()


class MarkedWork:
    """A p2p Work whose wait() is marked recv/send (and, on gloo, bounded by the current timeout)."""

    __slots__ = ("_work", "_phase", "_peer", "_detail", "_gloo")

    def __init__(self, work: Any, phase: str, peer: int | None, detail: str, gloo: bool):
        self._work, self._phase, self._peer, self._detail, self._gloo = work, phase, peer, detail, gloo

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        w = hb.CURRENT
        prev = None
        if w is not None:
            prev = w._state
            w.mark(self._phase, peer=self._peer, detail=self._detail)
        if self._gloo and not args and "timeout" not in kwargs and (t := dist_env.p2p_timeout()) is not None:
            kwargs["timeout"] = t
        out = self._work.wait(*args, **kwargs)  # a timeout leaves the phase as it is: where it gave up
        if w is not None and prev is not None:
            w.restore(prev)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_ORIG_BATCH_P2P = None


def install_p2p() -> None:
    """Wrap torch's schedules._batch_p2p once (the profiler's recorder wraps it too: either order)."""
    global _ORIG_BATCH_P2P
    from torch.distributed.pipelining import schedules

    if _ORIG_BATCH_P2P is not None:
        return
    _ORIG_BATCH_P2P = orig = schedules._batch_p2p

    @functools.wraps(orig)
    def batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
        works = orig(p2p_ops, desc)
        if not works or not p2p_ops:
            return works
        import torch.distributed as dist

        recv = any(op.op in (dist.irecv, dist.recv) for op in p2p_ops)
        peer = p2p_ops[0].peer
        gloo = p2p_ops[0].tensor.device.type == "cpu"
        detail = (desc or "").replace(" ", "")[:64]
        return [MarkedWork(w, "recv" if recv else "send", peer, detail, gloo) for w in works]

    schedules._batch_p2p = batch_p2p


def hook_compile() -> None:
    """`compile` while dynamo builds a graph (the first step; a recompile), then the phase before."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without compile callbacks: the step's own phase stands
        return
    saved: list[tuple] = []

    def begin(_args: Any) -> None:
        w = hb.CURRENT
        if w is not None:
            saved.append((w._state, w.first))
            w.mark("compile")
            w.first = "compile" not in w._done_kinds

    def end(_args: Any) -> None:
        w = hb.CURRENT
        if w is not None and saved:
            state, first = saved.pop()
            w._done_kinds.add("compile")
            w.restore(state)
            w.first = first

    if not getattr(hook_compile, "done", False):
        callback_handler.register_start_callback(begin)
        callback_handler.register_end_callback(end)
        hook_compile.done = True  # type: ignore[attr-defined]
