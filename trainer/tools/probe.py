"""`trainer probe`: what one node can do for the job's pipeline, measured in the job's own image.

    python -m trainer probe [--out FILE] [--serve PORT] [--peer HOST:PORT] [--no-compute]
                            [--min-seconds S] [--link-bytes N] [--timeout S] -- <the job's trainer args>

`runner profile` (and `runner up` with `parallel.partition: auto`) starts it on every node at once,
with the job's config, args, env and Docker limits, and reads the JSON it writes. Two phases:

1. Link (torch-free, first, so that no node's compute disturbs a neighbour's measurement): serve
   the previous pipeline neighbour on --serve, measure the link to the next one at --peer
   (trainer/tools/probe_link.py).
2. Compute: the job's model at depth 1, cut by the trainer's own stage code into the three kinds of
   pipeline work (embeddings, one transformer layer, final norm + head + loss), each run forward and
   backward at the job's microbatch shape (batch_size / microbatch_num x seq_len, the job's dtype,
   activation checkpointing and compile) for --min-seconds, in windows long enough for a Docker CPU
   quota (100 ms periods) to show, the kinds taking turns; the fastest window counts (see
   measure_compute). Per kind it also records the bytes saved for backward, the parameters +
   gradients + optimizer state after one optimizer step, and that step's time; for the node, the
   memory the job may use and the resident size of the runtime before any model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from trainer.runtime import container_limits
from trainer.tools.probe_link import LinkServer, measure

VERSION = 2
KINDS = ("embed", "block", "head")
WINDOWS = 4


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    train: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="trainer probe", allow_abbrev=False,
                                description="Measure this node for the pipeline planner (parallel.partition auto).")
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    p.add_argument("--serve", type=int, metavar="PORT", help="serve the previous neighbour's link probe on PORT")
    p.add_argument("--peer", metavar="HOST:PORT", help="measure the link to the next neighbour")
    p.add_argument("--no-compute", action="store_true", help="only the link phase")
    p.add_argument("--min-seconds", type=float, default=2.0,
                   help=f"timed seconds per kind, in {WINDOWS} windows (default 2.0)")
    p.add_argument("--link-bytes", type=int, default=8 << 20, help="bytes per bandwidth round (default 8 MiB)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a neighbour")
    return p.parse_args(argv), train


def main(argv: list[str]) -> int:
    args, train = _args(argv)
    t0 = time.time()
    doc: dict[str, Any] = {"version": VERSION, "node": os.environ.get("NODE_NAME"), "hostname": os.uname().nodename}
    server = LinkServer(args.serve, args.timeout) if args.serve else None
    if args.peer:
        host, _, port = args.peer.rpartition(":")
        try:
            doc["link"] = {"peer": args.peer, **measure(host, int(port), args.link_bytes, args.timeout)}
        except ConnectionError as e:
            print(f"error: link probe: {e}", file=sys.stderr)
            return 1
    if server is not None:
        if not server.wait(args.timeout) or server.error:
            print(f"error: link probe: the previous neighbour never finished on port {args.serve}"
                  f"{': ' + server.error if server.error else ''}", file=sys.stderr)
            return 1
    if not args.no_compute:
        doc.update(measure_compute(train, args.min_seconds))
    doc["seconds"] = round(time.time() - t0, 3)
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"probe: {doc.get('node') or 'this node'}: " + ", ".join(
            f"{k} {doc['time_s'][k] * 1e3:.2f} ms" for k in KINDS if "time_s" in doc) + f" ({doc['seconds']:.1f} s)")
    else:
        print(text)
    return 0


# ------------------------------------------------------------------ memory


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def memory_available() -> tuple[int, str]:
    """Bytes this process could grow to: the container's memory limit (cgroup v2 or v1) where one
    is set, else what the kernel says is available, plus what the process already holds."""
    own = rss_bytes()
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.split()[1:2] and line.split()[1].isdigit()}
    avail = meminfo.get("MemAvailable", meminfo.get("MemFree", 0)) + own
    found = container_limits.memory_limit()
    if found is not None and found[0] < avail:  # cgroup v1 "unlimited" is a huge number
        return found[0], f"cgroup limit ({found[1]})"
    return avail, "MemAvailable"


# ------------------------------------------------------------------ compute


def _window(fn, seconds: float, sync) -> tuple[float, int]:
    """Mean seconds of fn() over a window of at least `seconds` (and one call)."""
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds or reps >= 10_000:
            return elapsed / reps, reps


class _SavedBytes:
    """Bytes autograd saves for backward in a forward, not counting parameters or the input
    (the planner adds the received boundary itself)."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.seen = exclude, {}

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.seen[st.data_ptr()] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def measure_compute(train_argv: list[str], min_seconds: float) -> dict:
    import torch

    from trainer.config import resolve
    from trainer.config.argv import parse_train_args
    from trainer.data.loader import load_texts, load_tokenizer
    from trainer.runtime.dist_env import pick_device, training_dtype

    config_path, overrides = parse_train_args(train_argv)
    cfg = resolve(config_path, overrides)
    t, p = cfg.train, cfg.parallel
    device = pick_device(p.device)
    dtype = training_dtype(t.dtype, device.type)[0]
    mem, mem_src = _device_memory(device)
    vocab = None
    if cfg.model.vocab_size is None and cfg.data.source != "synthetic":
        vocab = load_tokenizer(cfg.data, load_texts(cfg.data), cfg.model).vocab_size  # as the trainer sizes it
    runtime = rss_bytes() if device.type == "cpu" else 0  # libraries and data, before any model
    full, spec, mods, compile_mode = _one_layer_each(cfg, vocab, device)
    mb, seq = t.batch_size // t.microbatch_num, cfg.data.seq_len
    hidden = int(spec.hidden_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(spec.hf_config.vocab_size), (mb, seq), generator=gen).to(device)
    targets = torch.randint(0, int(spec.hf_config.vocab_size), (mb, seq), generator=gen).to(device)
    h_in = torch.randn(mb, seq, hidden, generator=gen).to(device).requires_grad_(True)
    grad_out = torch.randn(mb, seq, hidden, generator=gen).to(device)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16"
                else torch.autocast(device.type, enabled=False))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward(kind: str):
        with autocast:
            if kind == "embed":
                return mods[kind](ids)
            if kind == "block":
                return mods[kind](h_in)
            return mods[kind](h_in, targets=targets)

    def fwd_bwd(kind: str) -> None:
        out = forward(kind)
        if kind == "head":
            out.backward()
        else:
            out.backward(grad_out)

    res: dict[str, dict] = {k: {} for k in ("time_s", "reps", "act_bytes", "param_bytes", "train_bytes", "optim_s")}
    for kind in KINDS:  # the first call warms up, and shows what autograd keeps for backward
        params = [q for q in mods[kind].parameters() if q.requires_grad]
        saved = _SavedBytes({q.untyped_storage().data_ptr() for q in params} | {h_in.untyped_storage().data_ptr()})
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
            fwd_bwd(kind)
        sync()
        res["act_bytes"][kind] = saved.total
    # Timed in windows of >= 5 CPU-quota periods, the kinds taking turns, and the fastest window
    # kept: a neighbour's burst of work (on a shared machine) only ever slows a window down, and
    # a quota applies to every window alike. A kind slower than a window gets two windows.
    window = min_seconds / WINDOWS
    res["time_s"], res["reps"] = _time_kinds(fwd_bwd, window, sync)
    _optimizer_costs(mods, cfg, window, sync, res)
    torch_threads = torch.get_num_threads()
    return {
        **res,
        "model": {"family": spec.family, "num_layers": full.num_layers, "hidden_size": hidden,
                  "vocab_size": int(spec.hf_config.vocab_size), "seq_len": seq, "microbatch": mb,
                  "microbatches": t.microbatch_num * t.grad_acc_steps, "dtype": dtype, "params": full.num_params,
                  "pp": p.pp, "pp_schedule": p.pp_schedule, "virtual_stages": p.virtual_stages, "tp": p.tp,
                  "partition": p.partition, "activation_checkpointing": t.activation_checkpointing,
                  "compile": compile_mode != "false"},
        "boundary_bytes": mb * seq * hidden * 4,  # fp32 on the wire, as the schedules send
        "model_bytes": full.num_params * 4,  # the full fp32 model every rank builds before cutting
        "runtime_bytes": runtime,
        "memory_available": mem, "memory_source": mem_src,
        "device": str(device), "threads": torch_threads, "cpus_visible": os.cpu_count(), "cgroup_cpus": container_limits.cpus(),
    }


def _device_memory(device) -> tuple[int, str]:
    """(bytes a stage may use, where that figure comes from)."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "CUDA free memory"
    return memory_available()


def _one_layer_each(cfg, vocab: int | None, device) -> tuple:
    """(the full model's spec, the one-layer spec, {kind: module} on device, compile mode): one
    layer of each kind is all the planner needs; compiled and checkpointed as the run would."""
    from trainer.config.checks import resolve_loss_chunks
    from trainer.config.partition import StageRange
    from trainer.models.build import build_model, model_spec
    from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
    from trainer.parallel.compile import compile_blocks, resolve_compile
    from trainer.parallel.stages import split_model

    t = cfg.train
    full = model_spec(cfg.model, vocab)
    cfg.model.num_hidden_layers = 1
    spec = model_spec(cfg.model, vocab)
    model = build_model(spec, cfg.model, t.seed)
    parts, _ = split_model(model, [StageRange(0, 0, 0), StageRange(1, 0, 1), StageRange(2, 1, 1)])
    del model
    mods = dict(zip(KINDS, (parts[0], parts[1], parts[2]), strict=True))
    mods["head"].loss_chunks = resolve_loss_chunks(t.loss_chunks, spec.task, int(spec.hf_config.vocab_size),
                                                   t.batch_size // t.microbatch_num * cfg.data.seq_len)
    compile_mode = resolve_compile(t.compile, device.type)
    for m in mods.values():
        m.to(device)
        apply_activation_checkpointing(m, t.activation_checkpointing)
        if compile_mode != "false":
            compile_blocks(m, mode=compile_mode, backend=t.compile_backend)
    return full, spec, mods, compile_mode


def _time_kinds(fwd_bwd, window: float, sync) -> tuple[dict[str, float], dict[str, int]]:
    """(fastest mean seconds, repetitions) per layer kind: timed in windows of `window` seconds,
    the kinds taking turns; a kind slower than a window gets two windows."""
    one = {k: _window(lambda k=k: fwd_bwd(k), 0.0, sync)[0] for k in KINDS}
    count = {k: WINDOWS if one[k] < window else 2 for k in KINDS}
    best = dict.fromkeys(KINDS, float("inf"))
    reps = dict.fromkeys(KINDS, 1)
    for w in range(WINDOWS):
        for kind in KINDS:
            if w < count[kind]:
                mean, n = _window(lambda k=kind: fwd_bwd(k), window, sync)
                best[kind] = min(best[kind], mean, one[kind] if count[kind] == 2 else float("inf"))
                reps[kind] += n
    return best, reps


def _optimizer_costs(mods: dict, cfg, window: float, sync, res: dict) -> None:
    """Each kind's parameter, gradient and optimizer-state bytes and its optimizer step's time,
    into res; one kind's optimizer at a time (the next one's state fits where these were)."""
    import torch

    from trainer.optim import build_optimizer

    for kind in KINDS:
        params = [q for q in mods[kind].parameters() if q.requires_grad]
        opt = build_optimizer(params, cfg)
        opt.step()  # allocates the state: then its size is known
        res["param_bytes"][kind] = sum(q.numel() * q.element_size() for q in params)
        state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        grads = sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None)
        res["train_bytes"][kind] = res["param_bytes"][kind] + grads + state
        res["optim_s"][kind] = min(_window(opt.step, window / 2, sync)[0] for _ in range(2))
        del opt
        for q in params:
            q.grad = None


