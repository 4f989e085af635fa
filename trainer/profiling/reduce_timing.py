"""DP gradient reduction of plain DDP runs, timed around the run's DDP communication hook.

Without pipeline parallelism DDP all-reduces each gradient bucket as soon as autograd has filled
it, while the backward is still running; the reduction overlaps the backward slices, so it is
recorded on a second track of the rank (tid 1) instead of the rank's one thread of actions. The
timer wraps the run's one DDP hook (data_parallel.GradReduceHook, which reduces as DDP would, or in
rank order) and records one `dp_reduce` event per bucket: start = the bucket is
handed to the process group, end = its all-reduce completes (the future's callback; DDP waits
for it before backward returns, so the event closes inside the last backward).

On CUDA the future completes when NCCL has *enqueued* the kernel, not when it ran; there CUDA
events bracket the reduction on the streams (start on the compute stream the bucket came from,
end on the stream the future hands its callback) and `flush()`, after the step's device sync,
places them on the rank's clock from one final event.

Pipeline stages need none of this: their reduction (FSDP2 or replicate) is a synchronous
`PipelineStage.perform_reduce_grad`, timed on the main track by recorder.py. FSDP2 without
pipeline parallelism is not timed: its reduce-scatters run from FSDP's internal post-backward
hooks and torch offers no public hook *around* them (`set_custom_reduce_scatter` replaces the
collective and its buffer allocation, not a timer), so they stay inside the backward slices.
"""

from __future__ import annotations

from typing import Any

from trainer.profiling.recorder import Event, Recorder

ASYNC_TID = 1  # the trace track of communication that overlaps the rank's own actions


class DDPReduceTimer:
    """Observes the run's DDP gradient reduction (data_parallel.GradReduceHook) while a batch is
    recorded: attach() at the batch's start, detach() at its end, so unrecorded steps run the
    reduction with nothing around it."""

    def __init__(self, rec: Recorder, ddp: Any, stage: int = 0, cuda: bool = False):
        self.rec, self.stage, self.cuda = rec, stage, cuda
        self.reduce_hook = ddp.grad_reduce
        self._pending: list[tuple[Any, Any, dict]] = []  # CUDA: (start event, end event, event fields)

    def attach(self) -> None:
        self.reduce_hook.observer = self.observe

    def detach(self) -> None:
        self.reduce_hook.observer = None

    def observe(self, bucket: Any, reduce: Any) -> Any:
        rec = self.rec
        if rec.active is None:
            return reduce(bucket)
        buf = bucket.buffer()
        fields = {"stage": self.stage, "mb": None, "bytes": buf.numel() * buf.element_size(), "tid": ASYNC_TID}
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            fut = reduce(bucket)

            def stamp_cuda(f: Any) -> Any:
                end = torch.cuda.Event(enable_timing=True)
                end.record()  # on the stream the future synchronised with the all-reduce
                self._pending.append((start, end, fields))
                return f.value()

            return fut.then(stamp_cuda)
        t0 = rec.clock.now()
        fut = reduce(bucket)

        def stamp(f: Any) -> Any:
            rec.add(Event("dp_reduce", t0, rec.clock.now(), **fields))
            return f.value()

        return fut.then(stamp)

    def flush(self) -> None:
        """CUDA: turn the recorded event pairs into Events; call after the device is synchronised."""
        if not self._pending:
            return
        import torch

        final = torch.cuda.Event(enable_timing=True)
        final.record()
        final.synchronize()
        t_final = self.rec.clock.now()
        for start, end, fields in self._pending:
            t0 = t_final - int(start.elapsed_time(final) * 1e6)  # elapsed_time is in ms
            t1 = t_final - int(end.elapsed_time(final) * 1e6)
            self.rec.add(Event("dp_reduce", t0, t1, **fields))
        self._pending.clear()
