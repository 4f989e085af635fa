"""DP gradient reduction of plain DDP runs, timed by a DDP communication hook.

Without pipeline parallelism DDP all-reduces each gradient bucket as soon as autograd has filled
it, while the backward is still running; the reduction overlaps the backward slices, so it is
recorded on a second track of the rank (tid 1) instead of the rank's one thread of actions. The
hook does what DDP does without one — multiply each bucket by 1/world size, all-reduce with SUM
(bit for bit: torch's `allreduce_hook` divides instead, which differs in the last bit for
world sizes that are not powers of two) — and records one `dp_reduce` event per bucket: start = the bucket is
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

import torch.distributed as dist

from trainer.profiling.recorder import Event, Recorder

ASYNC_TID = 1  # the trace track of communication that overlaps the rank's own actions


def allreduce_mean(group: Any, bucket: Any) -> Any:
    """DDP's built-in bucket reduction: bucket * (1/world), then SUM all-reduce; a future of the bucket."""
    buf = bucket.buffer()
    buf.mul_(1.0 / group.size())
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


class DDPReduceTimer:
    def __init__(self, rec: Recorder, ddp: Any, stage: int = 0, cuda: bool = False):
        self.rec, self.stage, self.cuda = rec, stage, cuda
        self.group = ddp.process_group
        self._pending: list[tuple[Any, Any, dict]] = []  # CUDA: (start event, end event, event fields)
        ddp.register_comm_hook(None, self.hook)

    # Unannotated on purpose: DDP inspects the signature and rejects any annotation of `bucket` or
    # of the result other than the real GradBucket / Future[Tensor] objects (strings included).
    def hook(self, _state, bucket):
        rec = self.rec
        if rec.active is None:
            return allreduce_mean(self.group, bucket)
        buf = bucket.buffer()
        fields = {"stage": self.stage, "mb": None, "bytes": buf.numel() * buf.element_size(), "tid": ASYNC_TID}
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            fut = allreduce_mean(self.group, bucket)

            def stamp_cuda(f: Any) -> Any:
                end = torch.cuda.Event(enable_timing=True)
                end.record()  # on the stream the future synchronised with the all-reduce
                self._pending.append((start, end, fields))
                return f.value()

            return fut.then(stamp_cuda)
        t0 = rec.clock.now()
        fut = allreduce_mean(self.group, bucket)

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
