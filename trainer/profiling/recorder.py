"""Records what each rank does during a profiled batch: one `Event` per pipeline action.

Where the hooks sit (torch.distributed.pipelining, no torch file copied):
- compute: this rank's `PipelineStage` instances get wrapped `forward_one_chunk`,
  `backward_one_chunk` (full backward, or backward-input when the schedule splits it),
  `backward_weight_one_chunk` and `perform_reduce_grad` (the FSDP2/replicate gradient
  reduction of a DP x PP run); the chunk id the schedule passes is the microbatch index.
- communication: the stage's `get_{fwd,bwd}_{send,recv}_ops` are wrapped to tag the P2POps
  they build with (direction, stage, microbatch); `schedules._batch_p2p`, through which every
  schedule posts its p2p ops, is wrapped to hand back works whose `wait()` is timed. A send or
  receive slice is the time the rank was blocked waiting for that op (the time it was posted
  is kept in `posted_ns`), so waits for data are attributed to the receive that caused them.
- trainer level: `data.next_batch` (batch_input), `clip_grad_norm` (grad_norm) and
  `optimizer.step` (optimizer) are wrapped on their instances.
- without pipeline parallelism: forward hooks on the model time each microbatch's forward;
  its backward is the gap to the next forward (or the end of `forward_backward`).
  DDP's bucket all-reduces overlap that backward: reduce_timing.py times them on a second track.

All wrappers cost one attribute test when no batch is being recorded.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from trainer.profiling.clocks import RankClock

COMPUTE = ("forward", "backward", "backward_input", "backward_weight")


@dataclass
class Event:
    action: str               # forward | backward | backward_input | backward_weight | send_F | recv_F |
    #                           send_B | recv_B | dp_reduce | grad_norm | optimizer | batch_input
    start_ns: int             # local clock (RankClock.now); mapped to rank 0's clock on export
    end_ns: int
    stage: int | None = None
    mb: int | None = None
    peer: int | None = None   # global rank on the other end of a send/recv
    bytes: int = 0
    posted_ns: int | None = None
    batch: int = 0
    tid: int = 0              # trace track: 0 = the rank's thread of actions; 1 = comm overlapping it

    def to_dict(self) -> dict:
        return asdict(self)


class NetSampler:
    """psutil.net_io_counters every `interval` seconds in a thread: (ts_ns, bytes_sent, bytes_recv)."""

    def __init__(self, clock: RankClock, interval: float = 0.01):
        self.clock, self.interval = clock, interval
        self.samples: list[tuple[int, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        import psutil

        c = psutil.net_io_counters()
        self.samples.append((self.clock.now(), c.bytes_sent, c.bytes_recv))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> None:
        self.samples = []
        self._stop.clear()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="net-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> list[tuple[int, int, int]]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()
        return self.samples


class TimedWork:
    """A p2p Work whose wait() is recorded as one Event per op it completes."""

    def __init__(self, work: Any, metas: list[dict], posted: int, rec: Recorder):
        self._work, self._metas, self._posted, self._rec = work, metas, posted, rec

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = self._rec.clock.now()
        out = self._work.wait(*args, **kwargs)
        if self._rec.sync is not None:  # NCCL's wait() only orders streams; the transfer ends on the GPU
            self._rec.sync()
        t1 = self._rec.clock.now()
        if self._rec.active is not None:
            for m in self._metas:
                self._rec.add(Event(start_ns=t0, end_ns=t1, posted_ns=self._posted, **m))
        self._metas = []  # a second wait() is not a second transfer
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_CURRENT: Recorder | None = None  # the recorder the patched _batch_p2p reports to
_ORIG_BATCH_P2P = None


def _install_p2p_patch() -> None:
    global _ORIG_BATCH_P2P
    from torch.distributed.pipelining import schedules

    if _ORIG_BATCH_P2P is not None:
        return
    _ORIG_BATCH_P2P = schedules._batch_p2p

    @functools.wraps(_ORIG_BATCH_P2P)
    def batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
        works = _ORIG_BATCH_P2P(p2p_ops, desc)
        rec = _CURRENT
        if rec is None or rec.active is None or not works:
            return works
        posted = rec.clock.now()
        metas = [rec.op_meta(op) for op in p2p_ops]
        if len(works) == len(metas):
            return [TimedWork(w, [m], posted, rec) for w, m in zip(works, metas, strict=True)]
        # Coalesced (NCCL): one work completes all ops; one slice named after all of them.
        joined = dict(metas[0], action="+".join(m["action"] for m in metas),
                      bytes=sum(m["bytes"] for m in metas))
        return [TimedWork(works[0], [joined], posted, rec), *works[1:]]

    schedules._batch_p2p = batch_p2p


class Recorder:
    """Per-rank event store; `begin(batch)` / `end()` bracket a recorded batch."""

    def __init__(self, clock: RankClock, rank: int, sync: Any = None):
        self.clock, self.rank = clock, rank
        # On GPUs, a device sync around each recorded action (as Merak does) so that a slice is the
        # kernels' time, not their launch; it serialises the recorded batch a little.
        self.sync = sync
        self.active: int | None = None      # batch index being recorded
        self.events: list[Event] = []
        self.net = NetSampler(clock)
        self.net_series: dict[int, list[tuple[int, int, int]]] = {}
        self._op_tags: dict[int, dict] = {}
        self._mb_fwd = 0
        self._last_fwd_end: int | None = None
        # Called as (action, stage, microbatch) when a compute instruction of a recorded batch is
        # about to run: where a Perseus plan sets its frequency (perseus_rounds.py).
        self.on_instruction: Any = None

    # ------------------------------------------------------------ bracketing

    def begin(self, batch: int) -> None:
        global _CURRENT
        _CURRENT = self
        self.active = batch
        self._op_tags.clear()
        self.net.start()

    def end(self) -> None:
        batch, self.active = self.active, None
        if batch is not None:
            self.net_series[batch] = self.net.stop()

    def add(self, ev: Event) -> None:
        if self.active is not None:
            ev.batch = self.active
            self.events.append(ev)

    def batch_events(self, batch: int) -> list[Event]:
        return [e for e in self.events if e.batch == batch]

    def timed(self, fn: Any, action: str, stage: int | None = None, mb: int | None = None) -> Any:
        """Run fn() and record it as one Event when a batch is being recorded."""
        if self.active is None:
            return fn()
        if self.sync is not None:
            self.sync()
        if self.on_instruction is not None and action in COMPUTE:
            self.on_instruction(action, stage, mb)
        t0 = self.clock.now()
        out = fn()
        if self.sync is not None:
            self.sync()
        self.add(Event(action, t0, self.clock.now(), stage=stage, mb=mb))
        return out

    def _synced_now(self) -> int:
        if self.sync is not None:
            self.sync()
        return self.clock.now()

    def _wrap(self, fn: Any, action: str, stage: int | None) -> Any:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return self.timed(lambda: fn(*args, **kwargs), action, stage)
        return wrapped

    # ------------------------------------------------------------ p2p tagging

    def op_meta(self, op: Any) -> dict:
        tag = self._op_tags.pop(id(op), None)
        send = op.op in (dist.isend, dist.send)
        nbytes = op.tensor.numel() * op.tensor.element_size()
        if tag is None:  # ops built outside the tagged getters (shape inference at the first step)
            tag = {"action": "send" if send else "recv", "stage": None, "mb": None}
        return dict(tag, peer=op.peer, bytes=nbytes)

    def _tag_ops(self, getter: Any, action: str, stage: int) -> Any:
        @functools.wraps(getter)
        def wrapped(chunk_id: int, *args: Any, **kwargs: Any) -> list:
            ops = getter(chunk_id, *args, **kwargs)
            if self.active is not None:
                for op in ops:
                    self._op_tags[id(op)] = {"action": action, "stage": stage, "mb": chunk_id}
            return ops
        return wrapped

    # ------------------------------------------------------------ installation

    def install_stage(self, stage: Any) -> None:
        """Wrap one PipelineStage instance's compute and p2p-building methods."""
        s = stage.stage_index
        fwd, bwd, bwd_w, reduce = (stage.forward_one_chunk, stage.backward_one_chunk,
                                   stage.backward_weight_one_chunk, stage.perform_reduce_grad)

        def forward_one_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self.timed(lambda: fwd(chunk_id, *args, **kwargs), "forward", s, chunk_id)

        def backward_one_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            full = args[1] if len(args) > 1 else kwargs.get("full_backward", True)
            return self.timed(lambda: bwd(chunk_id, *args, **kwargs),
                              "backward" if full else "backward_input", s, chunk_id)

        def backward_weight_one_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self.timed(lambda: bwd_w(chunk_id, *args, **kwargs), "backward_weight", s, chunk_id)

        def perform_reduce_grad(*args: Any, **kwargs: Any) -> Any:
            return self.timed(lambda: reduce(*args, **kwargs), "dp_reduce", s)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
        stage.perform_reduce_grad = perform_reduce_grad
        for name, action in (("get_fwd_send_ops", "send_F"), ("get_fwd_recv_ops", "recv_F"),
                             ("get_bwd_send_ops", "send_B"), ("get_bwd_recv_ops", "recv_B")):
            setattr(stage, name, self._tag_ops(getattr(stage, name), action, s))
        _install_p2p_patch()

    def install_single(self, par: Any) -> None:
        """No pipeline: forward per microbatch from module hooks, backward = the gap after it."""
        model = par.model_parts[0]
        fb = par.forward_backward

        def pre_hook(module: Any, args: Any) -> None:
            if self.active is None:
                return
            now = self._synced_now()
            if self._last_fwd_end is not None:
                self.add(Event("backward", self._last_fwd_end, now, stage=0, mb=self._mb_fwd - 1))
            if self.on_instruction is not None:
                self.on_instruction("forward", 0, self._mb_fwd)
                now = self.clock.now()
            self._fwd_start = now

        def post_hook(module: Any, args: Any, output: Any) -> None:
            if self.active is None or not model.training:
                return
            self._last_fwd_end = self._synced_now()
            self.add(Event("forward", self._fwd_start, self._last_fwd_end, stage=0, mb=self._mb_fwd))
            if self.on_instruction is not None:
                self.on_instruction("backward", 0, self._mb_fwd)
                self._last_fwd_end = self.clock.now()
            self._mb_fwd += 1

        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            self._mb_fwd, self._last_fwd_end = 0, None
            out = fb(*args, **kwargs)
            if self.active is not None and self._last_fwd_end is not None:
                self.add(Event("backward", self._last_fwd_end, self._synced_now(), stage=0, mb=self._mb_fwd - 1))
            self._last_fwd_end = None
            return out

        model.register_forward_pre_hook(pre_hook)
        model.register_forward_hook(post_hook)
        par.forward_backward = forward_backward

    def install_trainer(self, trainer: Any) -> None:
        data, par, opt = trainer.data, trainer.par, trainer.optimizer
        stage = min(par.runner.stage_ids) if getattr(par, "runner", None) is not None else 0
        data.next_batch = self._wrap(data.next_batch, "batch_input", stage)
        par.clip_grad_norm = self._wrap(par.clip_grad_norm, "grad_norm", stage)
        # functools.wraps keeps the LR scheduler's marker on optimizer.step (no "overridden" warning).
        opt.step = self._wrap(opt.step, "optimizer", stage)
        runner = getattr(par, "runner", None)
        if runner is not None:
            for st in runner.stages:
                self.install_stage(st)
        else:
            self.install_single(par)
