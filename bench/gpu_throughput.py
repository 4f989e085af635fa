"""The trainer against a plain transformers loop, eager and compiled two ways, on one CUDA GPU.

    PYTHONPATH=. python3 -m bench gpu_throughput [--budget S] [--quick]     (or: python -m bench.gpu_throughput)

Presets at seq 2048, bf16, synthetic tokens: smollm-360m batch 8, qwen3-0.6b batch 8, smollm-1.7b
batch 4. Every row of a preset starts from the same seeded weights and trains the same batches
with the same optimizer (fused AdamW, constant LR 3e-4, grad clip 1.0). Loops:
- plain eager: `model(input_ids=x, labels=y, shift_labels=y).loss` under bf16 autocast (the
  trainer's targets, so the losses are comparable);
- plain compiled, whole model: the same with `torch.compile(model)`;
- plain compiled, per layer: each `model.model.layers[i].compile()`, the mask, embeddings, head
  and loss eager (torchtitan's granularity; immune to the whole-model quirk below);
- trainer (defaults): `Trainer.train_step` as a CUDA run resolves `auto` (compiled blocks and loss,
  bf16 parameters through FSDP2, loss chunks by logits size, reading the loss every 10th step);
- the trainer with one feature changed (compile false, loss_chunks 1, param_dtype fp32, activation
  checkpointing selective / full), so the table shows where a gain comes from;
- the largest smollm-1.7b batch that fits (trainer defaults, then selective checkpointing).

Why two compiled plain loops: with some transformers/torch pairs, whole-model compile makes the
model build a full causal mask (`torch.compiler.is_exporting()` folded to True under compile
before pytorch#176347), which loses the flash kernel; the SDPA kernel column shows what ran.

Every row runs in its own process with its own timeout (clean peak-memory counters and compile
caches; an out-of-memory or a hang ends only that row, recorded as `oom` / `timeout`; a row that
printed its result and then outlived its time keeps the result, marked `killed_after_result`).
Rows run in priority order: the targets' rows first (trainer defaults and the per-layer compiled
loop per preset, smollm-1.7b at batch 8, the whole-model compiled loops, the rest of the batch
search), then one feature changed at a time; `--budget` seconds bound the whole run: rows that no
longer fit are recorded as `skipped`.
The JSON (`--json`, default bench/results/gpu_throughput.json) and a CSV of its rows beside it are
rewritten after every row, so a run cut short keeps what finished. Per row: tokens/s as the median of up to 3 timed windows
(`--steps` each, after `--warmup` steps that include compilation) with their spread (windows
that no longer fit the row's deadline are cut, and the row says how many ran), MFU, peak memory
allocated and reserved (GiB), the loss after warmup + one window (the same step for every row: all
rows of a preset must agree to bf16 tolerance), dynamo's graph and graph-break counts (proof that
compiled code ran), and the SDPA kernels one profiled step launched. Needs only torch (CUDA) and
transformers: `datasets` is never imported (synthetic tokens).

`--smoke` runs every path of the harness on CPU with a tiny model in seconds (numbers meaningless):
real rows, a forced out-of-memory row, a row that hangs into its timeout, and a budget that runs
out; bench/gpu_session.sh --smoke runs it (tests/unit/test_bench_imports.py, with RUN_SLOW=1).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ = 2048
PRESETS = {"smollm-360m": 8, "qwen3-0.6b": 8, "smollm-1.7b": 4}
TRAINER_DEFAULTS = "trainer (defaults)"
COMPILED_PLAIN = ("plain compiled, per layer", "plain compiled, whole model")
# name -> (loop, trainer config overrides)
LOOPS = {
    TRAINER_DEFAULTS: ("trainer", {}),
    "plain compiled, per layer": ("plain-layers", {}),
    "plain compiled, whole model": ("plain-model", {}),
    "plain eager": ("plain", {}),
    "trainer, compile false": ("trainer", {"train.compile": "false"}),
    "trainer, param_dtype fp32 (autocast)": ("trainer", {"train.param_dtype": "fp32"}),
    "trainer, loss_chunks 1": ("trainer", {"train.loss_chunks": 1}),
    "trainer, AC selective": ("trainer", {"train.activation_checkpointing": "selective"}),
    "trainer, AC full": ("trainer", {"train.activation_checkpointing": "full"}),
    "trainer, gc_interval 0": ("trainer", {"train.gc_interval": 0}),
}
SEARCH = ("smollm-1.7b", [(8, {}), (12, {}), (16, {}), (16, {"train.activation_checkpointing": "selective"}),
                          (24, {"train.activation_checkpointing": "selective"}),
                          (32, {"train.activation_checkpointing": "selective"})])
# Targets of issue 28 (trainer defaults vs the better compiled plain loop at equal batch).
SPEED_TARGET = 1.10
MEMORY_TARGET = {"smollm-360m": 0.8, "qwen3-0.6b": 0.8, "smollm-1.7b": 1.0}
MFU_TARGET = 0.50
LOSS_RTOL = 3e-2        # rows of one preset: loss at the same step, bf16 paths of different shapes
LOG_EVERY = 10          # the trainer's CUDA log cadence; the plain loops read their loss as often


# --smoke and tests: rows that fail on purpose (words: oom, hang, linger after the result)
FAULTS = {"smoke-oom": "oom", "smoke-hang": "hang", "test-oom-linger": "oom linger"}


@dataclass
class Row:
    name: str
    loop: str
    preset: str
    batch: int
    overrides: dict = field(default_factory=dict)
    group: str = "headline"             # headline | features | search | smoke-*


def plan(args: argparse.Namespace) -> list[Row]:
    """Every row, in the order they run: the headline first, whatever the budget then allows."""
    if args.smoke:
        tiny = [Row(n, LOOPS[n][0], "tiny-llama", 2, dict(LOOPS[n][1])) for n in (TRAINER_DEFAULTS, *COMPILED_PLAIN)]
        return [*tiny, Row("smoke: forced out-of-memory", "plain", "tiny-llama", 2, group="smoke-oom"),
                Row("smoke: hangs into its timeout", "plain", "tiny-llama", 2, group="smoke-hang"),
                Row("smoke: after the budget", "plain", "tiny-llama", 2, group="smoke-skip")]
    rows = [Row(n, LOOPS[n][0], p, b, dict(LOOPS[n][1])) for p, b in PRESETS.items()
            for n in (TRAINER_DEFAULTS, COMPILED_PLAIN[0])]
    preset, tries = SEARCH
    search = [Row("trainer, largest batch" + (", AC selective" if o else ""), "trainer", preset, b, dict(o), "search")
              for b, o in tries]
    whole = [Row(COMPILED_PLAIN[1], "plain-model", p, b) for p, b in PRESETS.items()]
    if args.quick:
        return rows + whole
    # The targets before the explanations: smollm-1.7b's first larger batch (the MFU target is at
    # its best batch), the whole-model plain loops (the speed target is against the better compiled
    # loop), the rest of the batch search, then one feature changed at a time.
    features = [Row(n, loop, p, b, dict(o), "features") for p, b in PRESETS.items()
                for n, (loop, o) in LOOPS.items() if n not in (TRAINER_DEFAULTS, *COMPILED_PLAIN)]
    return rows + search[:1] + whole + search[1:] + features


def select(rows: list[Row], presets: list[str], names: list[str]) -> list[Row]:
    """The rows of these presets and names (none given: all), in the plan's order."""
    for given, known, what in ((presets, {r.preset for r in rows}, "preset"), (names, {r.name for r in rows}, "row")):
        unknown = [g for g in given if g not in known]
        if unknown:
            raise ValueError(f"no {what} named {unknown[0]!r}; one of: {', '.join(map(repr, sorted(known)))}")
    return [r for r in rows if (not presets or r.preset in presets) and (not names or r.name in names)]


# ------------------------------------------------------------------ one row (worker process)


def _config(job: dict, out_dir: str):
    from trainer.config import resolve

    pairs = [("model.preset", job["preset"]), ("data.seq_len", job["seq"]), ("train.batch_size", job["batch"]),
             ("train.steps", 10 ** 6), ("train.seed", 0), ("optim.lr", 3e-4), ("train.grad_clip", 1.0),
             ("schedule.decay", "constant"), ("profile.batch", "none"), ("checkpoint.on_signal", False),
             ("output_dir", out_dir)]
    if job["device"] == "cpu":  # what `auto` resolves to on CUDA, asked for explicitly (smoke runs)
        pairs += [("train.dtype", "bf16"), ("train.param_dtype", "bf16"), ("train.compile", "true"),
                  ("train.compile_backend", job["backend"]), ("logging.log_interval", LOG_EVERY),
                  ("logging.peak_flops", 1e12)]  # no CPU bf16 matmul probe: MFU means nothing here
    return resolve(None, [*pairs, *job["overrides"].items()], environ={})


def _plain_step(cfg, job: dict, device):
    import torch

    from trainer.data.loader import build_data
    from trainer.models import build_model, model_spec

    spec = model_spec(cfg.model)
    model = build_model(spec, cfg.model, cfg.train.seed).to(device)
    model.train()
    run = model
    if job["loop"] == "plain-model":
        run = torch.compile(model, backend=job["backend"])
    elif job["loop"] == "plain-layers":
        for layer in model.model.layers:
            layer.compile(backend=job["backend"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                            weight_decay=0.0, fused=True)
    data = build_data(cfg.data, spec.task, spec.hf_config, cfg.train.seed, cfg.train.batch_size, 0, 1)
    data.pin = device.type == "cuda"

    def step() -> torch.Tensor:
        x, y = data.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            # shift_labels: the trainer's targets (every input token predicts its successor).
            loss = run(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return spec, step


def _trainer_step(cfg, device):
    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import DistEnv
    from trainer.train import Trainer, setup_logging

    setup_logging(0, Path(cfg.output_dir), console=False)
    trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), device,
                      "nccl" if device.type == "cuda" else "gloo")
    trainer.par.train(True)
    # What Trainer.fit does around its loop (train.gc_interval), held open for as long as step lives
    # (a context dropped here would be closed at once, the collector re-enabled).
    held = contextlib.ExitStack()
    held.enter_context(trainer.gc.active())

    def step():
        loss, _ = trainer.train_step()
        trainer.step += 1
        trainer.gc.after_step(trainer.step)
        return loss

    step.gc_schedule = held  # type: ignore[attr-defined]
    return trainer.spec, step


# First match wins per name: cuDNN's kernels carry "flash" in their names too.
SDPA_KINDS = (("cudnn", ("cudnn_attention", "_scaled_dot_product_cudnn", "sdpa_cudnn", "cudnn_generated_fort_native_sdpa")),
              ("flash", ("flash_fwd", "flash_bwd", "_scaled_dot_product_flash_attention", "flash_attention")),
              ("efficient", ("fmha_cutlass", "efficient_attention", "_scaled_dot_product_efficient", "mem_eff")),
              ("math", ("_scaled_dot_product_attention_math",)))


def sdpa_kernels(names: list[str]) -> list[str]:
    """The SDPA implementations among profiler event names (CUDA kernels and aten ops), e.g.
    ["flash"]; ["none seen"] where attention ran as plain matmuls (a decomposed math path)."""
    found = set()
    for name in (n.lower() for n in names):
        kind = next((k for k, marks in SDPA_KINDS if any(m in name for m in marks)), None)
        if kind:
            found.add(kind)
    return [k for k, _ in SDPA_KINDS if k in found] or ["none seen"]


def _profile_step(step, device) -> tuple[list[str], list[str]]:
    """One step under the profiler: (SDPA kinds, the attention kernel/op names seen)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events()})
    attn = [n for n in names if any(m in n.lower() for _, marks in SDPA_KINDS for m in marks)]
    return sdpa_kernels(names), attn[:8]


def measure(job: dict) -> dict:
    # --smoke only, before any import (seconds matter there): the paths a CUDA out-of-memory
    # error and a hung compile take.
    faults = (job.get("fault") or "").split()
    if "oom" in faults:
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB (forced by --smoke, not a real allocation)")
    if "hang" in faults:
        time.sleep(3600)
    import torch

    from trainer.metrics import flops_per_token, memory_bytes, peak_flops
    from trainer.parallel.compile import compile_report
    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    if cuda and job["loop"] == "trainer":
        from trainer.runtime.dist_env import configure_allocator

        configure_allocator()  # what `trainer` itself sets before touching the GPU
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(job, tmp)
        t0 = time.perf_counter()
        spec, step = _trainer_step(cfg, device) if job["loop"] == "trainer" else _plain_step(cfg, job, device)
        setup_s = time.perf_counter() - t0
        done = 0

        def timed(n: int):
            nonlocal done
            loss = None
            for _ in range(n):
                loss = step()
                done += 1
                if done % LOG_EVERY == 0:
                    float(loss)  # the loss read of a log step, in every loop alike
            return loss

        t0 = time.perf_counter()
        timed(job["warmup"])
        sync()
        warmup_s = time.perf_counter() - t0
        windows: list[float] = []
        loss_at = None
        while len(windows) < job["reps"]:
            t0 = time.perf_counter()
            loss = timed(job["steps"])
            sync()
            windows.append(time.perf_counter() - t0)
            if loss_at is None:
                loss_at = (done, float(loss))
            if time.time() + windows[-1] * 1.5 + 15 > job["deadline"]:
                break  # the next window might not fit this row's time: keep what ran
        graphs = compile_report()
        kinds, attn = _profile_step(step, device)
    tps = sorted(job["steps"] * job["batch"] * job["seq"] / w for w in windows)
    median = tps[len(tps) // 2]
    fpt = flops_per_token(spec.num_params, spec.num_layers, spec.attention_width, job["seq"])
    peak, _ = peak_flops(device, "bf16", cfg.logging.peak_flops)
    alloc, reserved = memory_bytes(device)
    return {"status": "ok", "tokens_per_s": median, "tokens_per_s_windows": tps,
            "spread": (tps[-1] - tps[0]) / median, "reps": len(windows), "reps_planned": job["reps"],
            "mfu": median * fpt / peak, "peak_memory_gib": alloc / 2 ** 30,
            "reserved_memory_gib": None if reserved is None else reserved / 2 ** 30,
            "loss_step": loss_at[0], "loss": loss_at[1], "graphs": graphs["graphs"],
            "graph_breaks": graphs["graph_breaks"], "sdpa": kinds, "attention_kernels": attn,
            "setup_s": setup_s, "warmup_s": warmup_s, "step_time_s": job["batch"] * job["seq"] / median,
            "params": spec.num_params, "flops_per_token": fpt, "peak_flops": peak}


def is_oom(e: BaseException | None) -> bool:
    """An out-of-memory anywhere in the chain: the allocator's, or one inductor/triton wrapped."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", MemoryError) if torch is not None else MemoryError
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (oom, MemoryError)) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def worker(job: dict) -> int:
    try:
        out = measure(job)
    except Exception as e:  # noqa: BLE001 - every failure becomes this row's status
        out = {"status": "oom" if is_oom(e) else "error", "error": traceback.format_exc()[-2000:]}
    print("RESULT " + json.dumps(out), flush=True)
    if "linger" in (job.get("fault") or "").split():  # tests only: a process outliving its result
        time.sleep(3600)
    return 0


# ------------------------------------------------------------------ orchestration


def run_row(row: Row, args: argparse.Namespace, timeout: float, log: Path) -> dict:
    job = {"loop": row.loop, "preset": row.preset, "batch": row.batch, "overrides": row.overrides,
           "steps": args.steps, "warmup": args.warmup, "reps": args.reps, "seq": args.seq,
           "device": "cpu" if args.smoke else "cuda:0", "backend": args.backend, "deadline": time.time() + timeout,
           "fault": FAULTS.get(row.group)}
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_throughput", "--worker", json.dumps(job)],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # a timeout, or this process stopped (SIGTERM from a backstop): no row outlives it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the row's whole process group: compile workers too
                proc.wait()
    text = log.read_text(errors="replace")
    line = next((ln for ln in reversed(text.splitlines()) if ln.startswith("RESULT ")), None)
    if line is not None:
        res = json.loads(line[len("RESULT "):])
        if timed_out:  # measured, then the process outlived the row's time (its exit: compile workers)
            res["killed_after_result"] = True
    elif timed_out:
        res = {"status": "timeout", "error": f"no result within {timeout:.0f} s"}
    else:
        res = {"status": "error", "error": f"exit {proc.returncode} without a result: {text[-1500:]}"}
    res.update({**asdict(row), "wall_s": round(time.time() - t0, 1), "timeout_s": round(timeout), "log": str(log)})
    print(f"  {row.preset} batch {row.batch} {row.name}: {describe(res)} ({res['wall_s']:.0f} s)", flush=True)
    return res


def describe(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"].upper()
    cut = f", {r['reps']}/{r['reps_planned']} windows" if r["reps"] < r["reps_planned"] else ""
    return (f"{r['tokens_per_s'] / 1e3:.1f}K tok/s (spread {100 * r['spread']:.1f}%{cut}), {100 * r['mfu']:.1f}% MFU, "
            f"{r['peak_memory_gib']:.1f} GiB, loss {r['loss']:.3f}, {r['graphs']} graphs, sdpa {'+'.join(r['sdpa'])}")


def summarise(rows: list[dict]) -> dict:
    """Targets (trainer defaults vs the better compiled plain loop), loss agreement, best MFU."""
    out: dict = {"targets": {}, "loss_agreement": {}}
    for preset in dict.fromkeys(r["preset"] for r in rows):
        mine = [r for r in rows if r["preset"] == preset and r["status"] == "ok"]
        plain = [r for r in mine if r["name"] in COMPILED_PLAIN]
        ours = next((r for r in mine if r["name"] == TRAINER_DEFAULTS), None)
        if plain and ours:
            base = max(plain, key=lambda r: r["tokens_per_s"])
            speed = ours["tokens_per_s"] / base["tokens_per_s"]
            mem = ours["peak_memory_gib"] / base["peak_memory_gib"] if base["peak_memory_gib"] else float("nan")
            out["targets"][preset] = {
                "baseline": base["name"], "baselines_measured": [r["name"] for r in plain],
                "speed_vs_compiled": speed, "speed_met": speed >= SPEED_TARGET, "memory_vs_compiled": mem,
                "memory_met": mem <= MEMORY_TARGET.get(preset, 1.0)}
        same = [r for r in mine if r["batch"] == PRESETS.get(preset, r["batch"]) and r["group"] != "search"]
        steps = {r["loss_step"] for r in same}
        if len(same) >= 2 and len(steps) == 1:
            losses = sorted(r["loss"] for r in same)
            mid = losses[len(losses) // 2]
            worst = max(abs(v - mid) / abs(mid) for v in losses)
            out["loss_agreement"][preset] = {"step": steps.pop(), "rows": len(same), "median": mid,
                                             "max_rel_dev": worst, "agree": worst <= LOSS_RTOL}
    search = [r for r in rows if r["preset"] == SEARCH[0] and r["loop"] == "trainer" and r["status"] == "ok"]
    if search:
        best = max(search, key=lambda r: r["mfu"])
        out["targets"]["smollm-1.7b best MFU"] = {"batch": best["batch"], "row": best["name"], "mfu": best["mfu"],
                                                  "met": best["mfu"] >= MFU_TARGET}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| preset | batch | loop | tokens/s (spread) | MFU | peak / reserved GiB | loss | graphs | SDPA | "
             "vs trainer defaults |", "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['preset']} | {r['batch']} | {r['name']} | {r['status']} | | | | | | |")
            continue
        ours = next((x for x in rows if x["preset"] == r["preset"] and x["name"] == TRAINER_DEFAULTS
                     and x["status"] == "ok"), None)
        ratio = f"{ours['tokens_per_s'] / r['tokens_per_s']:.2f}x" if ours and ours is not r else ""
        res = "" if r["reserved_memory_gib"] is None else f" / {r['reserved_memory_gib']:.1f}"
        lines.append(f"| {r['preset']} | {r['batch']} | {r['name']} | {r['tokens_per_s'] / 1e3:.1f}K "
                     f"({100 * r['spread']:.1f}%, {r['reps']}x) | {100 * r['mfu']:.1f}% | {r['peak_memory_gib']:.1f}{res} "
                     f"| {r['loss']:.3f} | {r['graphs']} | {'+'.join(r['sdpa'])} | {ratio} |")
    return "\n".join(lines)


CSV_FIELDS = ("preset", "batch", "name", "overrides", "status", "tokens_per_s", "spread", "reps", "mfu",
              "peak_memory_gib", "reserved_memory_gib", "loss_step", "loss", "graphs", "graph_breaks", "sdpa",
              "setup_s", "warmup_s", "wall_s", "why")


def write(path: Path, meta: dict, rows: list[dict], pending: list[Row], complete: bool) -> None:
    doc = {**meta, "complete": complete, "rows": rows, **summarise(rows),
           "not_run": [{**asdict(r), "status": "skipped", "why": "budget"} for r in pending]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)  # a reader (or a run cut short) sees the last complete state
    with tmp.open("w", newline="") as f:  # the same rows flat, next to it (same name, .csv)
        w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in [*rows, *doc["not_run"]]:
            w.writerow({**r, "sdpa": "+".join(r.get("sdpa") or []), "overrides": json.dumps(r.get("overrides") or {})})
    tmp.replace(path.with_suffix(".csv"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed window")
    ap.add_argument("--reps", type=int, default=3, help="timed windows per row (median and spread)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation happens there)")
    ap.add_argument("--quick", action="store_true", help="only the headline rows")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0 = no limit)")
    ap.add_argument("--row-timeout", type=float, default=420, help="seconds per row at most")
    ap.add_argument("--min-row-s", type=float, default=50,
                    help="start no row with less time left than this (a GPU row compiles for most of a minute)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the plain loops")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "gpu_throughput.json"))
    ap.add_argument("--logs", default=None, help="directory for each row's output (default: next to --json)")
    ap.add_argument("--smoke", action="store_true", help="every path on CPU, tiny model, seconds")
    ap.add_argument("--preset", action="append", default=[], metavar="NAME",
                    help=f"only this preset's rows (repeatable): {', '.join(PRESETS)}")
    ap.add_argument("--row", action="append", default=[], metavar="NAME",
                    help="only rows of this name (repeatable), e.g. 'trainer (defaults)', in the plan's order")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    try:
        pending = select(plan(args), args.preset, args.row)
    except ValueError as e:
        print(f"gpu_throughput: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_row, which ends the running row
    args.seq = SEQ
    start = time.time()
    from importlib.metadata import version

    if args.smoke:  # this process never imports torch then: only its workers pay for it
        args.seq, args.steps, args.warmup, args.reps, args.backend = 32, 2, 1, 2, "eager"
        device, cuda_version = "CPU (smoke run)", None
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_throughput: no CUDA device visible; nothing measured (run it on a GPU host)")
            return 0
        device, cuda_version = torch.cuda.get_device_name(0), torch.version.cuda
    versions = {"torch": version("torch"), "cuda": cuda_version, "transformers": version("transformers")}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(args.logs) if args.logs else out.parent / (out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    meta = {"device": device, **versions, "seq_len": args.seq, "dtype": "bf16",
            "steps_per_window": args.steps, "warmup": args.warmup, "reps": args.reps, "budget_s": args.budget,
            "compile_backend_plain": args.backend, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"{device}, torch {versions['torch']} (CUDA {cuda_version}), transformers {versions['transformers']}, "
          f"seq {args.seq}, bf16, budget {args.budget or 'none'} s", flush=True)
    rows: list[dict] = []
    stopped: set[str] = set()  # search: a batch that failed stops the larger ones of its setting
    while pending:
        row = pending[0]
        left = args.budget - (time.time() - start) if args.budget else float("inf")
        if row.group == "smoke-skip":
            left = 0.0  # the smoke's last row: the budget has run out
        if left < (20 if args.smoke else args.min_row_s):
            break
        pending.pop(0)
        key = json.dumps(row.overrides, sort_keys=True)
        if row.group == "search" and key in stopped:
            continue
        timeout = 8.0 if row.group == "smoke-hang" else min(args.row_timeout, left)
        res = run_row(row, args, timeout, logs / f"{len(rows):02d}-{row.preset}-{row.loop}-{row.batch}.log")
        rows.append(res)
        if row.group == "search" and res["status"] != "ok":
            stopped.add(key)
        write(out, meta, rows, pending, complete=False)
    if pending:
        print(f"budget: {len(pending)} row(s) not run (recorded as skipped): "
              + "; ".join(f"{r.preset} {r.name}" for r in pending), flush=True)
    write(out, {**meta, "wall_s": round(time.time() - start, 1)}, rows, pending, complete=not pending)
    print("\n" + table(rows))
    summary = summarise(rows)
    print("\ntargets:", json.dumps(summary["targets"], indent=1))
    print("loss agreement:", json.dumps(summary["loss_agreement"], indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
