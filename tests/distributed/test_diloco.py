"""DiLoCo data parallelism (parallel.dp_sync diloco, trainer/parallel/diloco.py) on CPU gloo.

- With plain SGD, H = 1, outer lr 1, no outer momentum and fp32 sync, averaging the replicas'
  updates is averaging their gradients: dp 3 gives DDP's losses and parameters, pp 2 x dp 2 gives
  pp 2 x DDP 2's, and zero3_hybrid (shards 2 x replicas 2: DiLoCo across replicas only) gives DDP 4's,
  within 1e-6 over 20 (dp 3) and 10 steps. Not bit for bit: each replica's own step rounds its
  parameters before the pseudo-gradient is taken (anchor - local is then exact), up to half an ulp
  per step that DDP does not have; at lr 0.5 the final norm weights (~1.04, ulp 2.4e-7) of dp 3
  drift by 4-5 ulps over 40 steps (1.07e-6, printed), which is why the bound is checked at 20.
- With AdamW and H = 20, dp 3 equals the algorithm written out here in one process: three model
  copies stepped in turn on their own batches, then the outer Nesterov step on the averaged change.
- Bytes, read from metrics.jsonl: the sync's bytes are the model's parameter count times the dtype
  size times the syncs (DDP: every step; DiLoCo: every H steps; int8: one byte each plus a 4-byte
  scale per tensor).
- A run stopped between two outer steps, with a fragment's sync in flight, resumes bit for bit.

The runs of one world size share one torchrun (run_trainers): the dp 3 runs are built once per
module and read by several tests.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.support.trainer_run import (
    checkpoint_tensors,
    numeric_metrics,
    read_metrics,
    run_trainer,
    run_trainers,
)

STEPS, PP_STEPS, TOL = 40, 10, 1e-6
JOB = ("--config", "configs/tiny.yaml", "--train.grad_clip", "0", "--checkpoint.enabled", "true")
SGD = ("--optim.name", "sgd", "--optim.lr", "0.5")
DILOCO = ("--parallel.dp_sync", "diloco")
H1 = (*DILOCO, "--parallel.diloco.inner_steps", "1", "--parallel.diloco.outer_lr", "1",
      "--parallel.diloco.outer_momentum", "0", "--parallel.diloco.sync_dtype", "fp32")
H20 = (*DILOCO, "--parallel.diloco.inner_steps", "20", "--parallel.diloco.outer_lr", "0.7",
       "--parallel.diloco.outer_momentum", "0.9")
# Streaming: 2 fragments (one synced every 10 steps), each sent a step before its outer step.
STREAMING = (*H20, "--parallel.diloco.sync_dtype", "int8", "--parallel.diloco.fragments", "2",
             "--parallel.diloco.overlap_steps", "1")
EVERY20 = ("--checkpoint.interval", "20")
DP3 = {"ddp_sgd": (*SGD, *EVERY20), "h1_sgd": (*SGD, *H1, *EVERY20), "h20": H20, "h20_int8_streaming": STREAMING}
PP = ("--parallel.pp", "2", "--train.microbatch_num", "2")
HYBRID = ("--parallel.sharding", "zero3_hybrid", "--parallel.dp_shard", "2")
WORLD4 = {"pp2_ddp2": (*SGD, *PP), "pp2_h1": (*SGD, *PP, *H1), "ddp4": SGD, "hybrid_h1": (*SGD, *HYBRID, *H1)}


def _final(out: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(out / "checkpoints" / f"step-{steps}")


def _model(tensors: dict[str, torch.Tensor], prefix: str = "app.model.") -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and len(a) > 5, (sorted(a)[:4], sorted(b)[:4])
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _differences(out: Path, ref: Path, steps: int) -> tuple[float, float]:
    """(largest loss difference over the first `steps` steps, largest parameter difference after them)."""
    got, want = [r["loss"] for r in read_metrics(out)][:steps], [r["loss"] for r in read_metrics(ref)][:steps]
    assert len(got) == len(want) == steps
    return (max(abs(a - b) for a, b in zip(got, want, strict=True)),
            _max_diff(_model(_final(out, steps)), _model(_final(ref, steps))))


def _assert_same_run(out: Path, ref: Path, steps: int) -> None:
    loss, params = _differences(out, ref, steps)
    print(f"{out.name} vs {ref.name}, {steps} steps: losses within {loss:.2e}, parameters within {params:.2e}")
    assert loss <= TOL and params <= TOL


@pytest.fixture(scope="module")
def dp3(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("diloco-dp3")
    run_trainers([(base / name, (*JOB, "--train.steps", str(STEPS), *args)) for name, args in DP3.items()], nproc=3)
    return base


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("diloco-world4")
    run_trainers([(base / name, (*JOB, "--train.steps", str(PP_STEPS), *args)) for name, args in WORLD4.items()],
                 nproc=4)
    return base


@pytest.mark.multiproc
def test_h1_sgd_equals_ddp(dp3):
    _assert_same_run(dp3 / "h1_sgd", dp3 / "ddp_sgd", 20)
    loss, params = _differences(dp3 / "h1_sgd", dp3 / "ddp_sgd", STEPS)  # the rounding drift (module doc)
    print(f"h1_sgd vs ddp_sgd, {STEPS} steps: losses within {loss:.2e}, parameters within {params:.2e}")
    assert loss < 1e-5 and params < 1e-5


@pytest.mark.multiproc
def test_h1_sgd_equals_ddp_on_pipeline_stages_and_hybrid_shards(world4):
    _assert_same_run(world4 / "pp2_h1", world4 / "pp2_ddp2", PP_STEPS)
    _assert_same_run(world4 / "hybrid_h1", world4 / "ddp4", PP_STEPS)


@pytest.mark.multiproc
def test_replicas_hold_the_anchor_after_an_outer_step(dp3):
    """Step 40 is an outer step: each replica's own parameters are the anchors bit for bit (one
    average on every replica, not three that differ in their last bits)."""
    t = _final(dp3 / "h20")
    anchors = _model(t)
    for r in range(3):
        mine = _model(t, f"app.replica{r}.model.")
        assert mine.keys() == anchors.keys()
        assert all(torch.equal(mine[k], anchors[k]) for k in anchors), f"replica {r} differs from the anchors"
    assert {k.split(".")[2] for k in t if k.startswith("app.diloco.")} == {"momentum"}


def reference(steps: int, inner: int, outer_lr: float, momentum: float, dp: int = 3) -> tuple[list, dict]:
    """DiLoCo in one process, written from the paper: `dp` copies of the trainer's model, each with
    the trainer's AdamW and LR schedule, stepped in turn on the batches its rank would get; every
    `inner` steps the anchor takes an outer SGD step with Nesterov momentum on the mean of
    (anchor - copy), and every copy restarts from it. Returns (per-step mean losses, anchors)."""
    from trainer.config import resolve
    from trainer.config.checks import microbatch_tokens, resolve_loss_chunks
    from trainer.data.loader import build_data
    from trainer.models.build import Task, build_model, model_spec
    from trainer.models.lm_loss import install_loss_forward
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.parallel.mesh import ParallelDims
    from trainer.parallel.parallelized import Parallelized

    cfg = resolve("configs/tiny.yaml", [("train.steps", steps), ("train.grad_clip", 0)], environ={})
    spec = model_spec(cfg.model, None)
    model = build_model(spec, cfg.model, cfg.train.seed, meta=False, copies=1)
    install_loss_forward(model, resolve_loss_chunks("auto", spec.task, spec.hf_config.vocab_size,
                                                    microbatch_tokens(cfg)))
    names = [n for n, _ in model.named_parameters()]
    anchor = [p.detach().clone() for p in model.parameters()]
    buf = [torch.zeros_like(a) for a in anchor]
    replicas = []
    for r in range(dp):
        m = copy.deepcopy(model)
        opt = build_optimizer(list(m.parameters()), cfg)
        replicas.append((Parallelized([m], Task(spec.task, fused=True), ParallelDims(1), torch.device("cpu")),
                         opt, build_scheduler(opt, cfg, steps),
                         build_data(cfg.data, spec.task, spec.hf_config, cfg.train.seed, cfg.train.batch_size, r, dp)))
    losses = []
    for step in range(1, steps + 1):
        step_losses = []
        for par, opt, sched, data in replicas:
            step_losses.append(par.forward_backward(*data.next_batch(), 1).detach())
            par.clip_grad_norm(0.0, opt)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(sum(step_losses[1:], step_losses[0].clone()) / dp))
        if step % inner == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    delta = sum((a - list(par.model_parts[0].parameters())[i]) for par, *_ in replicas) / dp
                    buf[i] = momentum * buf[i] + delta
                    a -= outer_lr * (delta + momentum * buf[i])
                for par, *_ in replicas:
                    for p, a in zip(par.model_parts[0].parameters(), anchor, strict=True):
                        p.copy_(a)
    return losses, dict(zip(names, anchor, strict=True))


@pytest.mark.multiproc
def test_adamw_h20_equals_the_one_process_algorithm(dp3):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runs (OMP_NUM_THREADS=1): the same matmul kernels
    try:
        want_losses, want = reference(STEPS, 20, 0.7, 0.9)
    finally:
        torch.set_num_threads(threads)
    got_losses = [r["loss"] for r in read_metrics(dp3 / "h20")]
    worst = max(abs(a - b) for a, b in zip(got_losses, want_losses, strict=True))
    assert len(got_losses) == STEPS and worst <= TOL, f"losses differ by up to {worst:.2e}"
    assert abs(want_losses[-1] - want_losses[0]) > 0.05  # it trained: the comparison is not of constants
    diff = _max_diff(_model(_final(dp3 / "h20")), want)
    assert diff <= TOL, f"anchors differ from the reference by up to {diff:.2e}"
    print(f"AdamW H=20 dp3 vs one-process reference: losses within {worst:.2e}, parameters within {diff:.2e}")


@pytest.mark.multiproc
def test_sync_bytes_in_metrics(dp3):
    """Per rank: DDP hands its 4-byte gradients to an all-reduce every step; DiLoCo fp32 its 4-byte
    pseudo-gradient every 20 steps (1/20); int8 one byte a value plus one 4-byte scale per tensor and
    sync (two fragments every 10 steps: each tensor still once per 20 steps)."""
    from trainer.config import resolve
    from trainer.models.build import build_model, model_spec

    cfg = resolve("configs/tiny.yaml", [], environ={})
    params = list(build_model(model_spec(cfg.model, None), cfg.model, 0, meta=True, copies=1).parameters())
    values, tensors = sum(p.numel() for p in params), len(params)
    last = {name: read_metrics(dp3 / name)[-1] for name in ("ddp_sgd", "h20", "h20_int8_streaming")}
    ddp, fp32, int8 = (last[n]["dp_sync_bytes"] for n in ("ddp_sgd", "h20", "h20_int8_streaming"))
    assert ddp == STEPS * 4 * values
    assert fp32 == STEPS // 20 * 4 * values and fp32 * 15 <= ddp
    assert int8 == STEPS // 20 * (values + 4 * tensors) and int8 < fp32 / 3.9
    print(f"dp_sync_bytes over {STEPS} steps: DDP {ddp}, DiLoCo H=20 fp32 {fp32} ({ddp / fp32:.1f}x less), "
          f"int8 {int8} ({fp32 / int8:.3f}x less than fp32)")
    for name in last:  # cumulative, and timed where a sync ran
        rows = read_metrics(dp3 / name)
        assert [r["dp_sync_s"] for r in rows] == sorted(r["dp_sync_s"] for r in rows)
        assert rows[-1]["dp_sync_s"] > rows[0]["dp_sync_s"]


@pytest.mark.multiproc
def test_resume_between_outer_steps_is_bitwise(dp3, tmp_path):
    """Stopped after step 29: fragment 0 synced at 20, fragment 1's int8 sync for step 30 in flight."""
    straight, resumed = dp3 / "h20_int8_streaming", tmp_path / "resumed"
    args = (*JOB, "--train.steps", str(STEPS), *STREAMING)
    run_trainer(resumed, *args, "--train.exit_interval", "29", nproc=3)
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step-29"
    run_trainer(resumed, *args, "--resume", "latest", nproc=3)
    want, got = numeric_metrics(straight), numeric_metrics(resumed)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got, strict=True):
        assert a == b, f"step {a['step']}: straight {a} != resumed {b}"
    a, b = _final(straight), _final(resumed)
    assert a.keys() == b.keys() and any(k.startswith("app.diloco.pending.") for k in a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


def test_refused_combinations_name_the_key():
    from types import SimpleNamespace

    from trainer.config import ConfigError, resolve
    from trainer.parallel.diloco import check_layout

    def cfg(*pairs):
        return resolve("configs/tiny.yaml", [("parallel.dp_sync", "diloco"), *pairs], environ={})

    for pairs, msg in [((("parallel.diloco.inner_steps", 0),), "parallel.diloco.inner_steps must be >= 1"),
                       ((("parallel.diloco.fragments", 3),), "fragments 3 must divide parallel.diloco.inner_steps 50"),
                       ((("parallel.diloco.inner_steps", 4), ("parallel.diloco.fragments", 8)), "fragments 8 must"),
                       ((("parallel.diloco.overlap_steps", 25), ("parallel.diloco.fragments", 2)),
                        "overlap_steps 25 must be below inner_steps / fragments = 25"),
                       ((("parallel.diloco.sync_dtype", "int4"),), "sync_dtype: 'int4'"),
                       ((("parallel.dp_sync", "gossip"),), "parallel.dp_sync: 'gossip'")]:
        with pytest.raises(ConfigError, match=msg):
            cfg(*pairs)
    c = cfg()
    layout = dict(sharding="ddp", tp=1, dp=3, dp_replicate=3)
    assert check_layout(c, SimpleNamespace(**layout)) is True
    assert check_layout(c, SimpleNamespace(**{**layout, "dp_replicate": 1, "dp": 1})) is False  # warns, trains
    with pytest.raises(ConfigError, match="zero3 shards over every dp rank.*zero3_hybrid"):
        check_layout(c, SimpleNamespace(**{**layout, "sharding": "zero3", "dp_replicate": 1}))
    with pytest.raises(ConfigError, match="parallel.tp > 1"):
        check_layout(c, SimpleNamespace(**{**layout, "tp": 2}))


def test_fragments_follow_the_blocks():
    """4 blocks in 2 fragments: embeddings with blocks 0-1, final norm and head with blocks 2-3, a
    tied weight alone in the first; 3 fragments of 4 blocks is refused with the divisors' hint."""
    from trainer.config import resolve
    from trainer.models.build import build_model, model_spec
    from trainer.parallel.activation_checkpoint import blocks_of
    from trainer.parallel.diloco import split_fragments

    cfg = resolve("configs/tiny.yaml", [("model.num_hidden_layers", 4)], environ={})
    model = build_model(model_spec(cfg.model, None), cfg.model, 0, meta=True, copies=1)
    names = {id(p): n for n, p in model.named_parameters()}
    head = model.lm_head.weight
    frags, problem = split_fragments([model], blocks_of(model), 2, tied=[head])
    assert problem is None and [len(f.buckets) for f in frags] == [2, 1]
    first = [names[id(p)] for p in frags[0].params]
    second = [names[id(p)] for p in frags[1].params]
    assert first[0] == "model.embed_tokens.weight" and first[-1] == "lm_head.weight"
    assert {n.split(".")[2] for n in first if ".layers." in n} == {"0", "1"}
    assert {n.split(".")[2] for n in second if ".layers." in n} == {"2", "3"} and second[-1] == "model.norm.weight"
    assert len(first) + len(second) == len(names)
    _, problem = split_fragments([model], blocks_of(model), 3, tied=[])
    assert problem and "does not divide the 4 transformer blocks" in problem
