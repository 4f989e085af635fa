"""The GPU-server features, checked on CPU (tiny models, fp32, gloo): loss chunks, activation
checkpointing and compile change no loss beyond 1e-5 relative (one process, zero3 x 2, pp=2 1F1B),
meta-device init materialises the seeded weights exactly, the defaults a GPU user meets (one
microbatch without a pipeline, dtype auto, TF32 only on CUDA), and the chunked loss never holds
the [tokens, vocab] logits.

Each equivalence run is compared with the default run of the SAME layout (the suites of
test_trainer_dp.py / test_pipeline_schedules.py compare the layouts with each other).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.trainer_run import checkpoint_tensors, read_metrics, run_trainer

RTOL = 1e-5
BASE = ("--config", "configs/tiny.yaml", "--train.steps", "4", "--optim.lr", "0.01", "--train.grad_clip", "0.5")
LAYOUTS = {
    "single": ((), 1),
    "zero3x2": (("--parallel.sharding", "zero3", "--train.batch_size", "2"), 2),
    "pp2_1f1b": (("--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--train.microbatch_num", "2"), 2),
}
# Every feature on every layout; the multi-process layouts take two features per run (CI time).
FEATURES = {
    "single": [("--train.loss_chunks", "4"), ("--train.activation_checkpointing", "full"),
               ("--train.activation_checkpointing", "selective")],
    "zero3x2": [("--train.loss_chunks", "4", "--train.activation_checkpointing", "selective"),
                ("--train.activation_checkpointing", "full")],
    "pp2_1f1b": [("--train.loss_chunks", "4", "--train.activation_checkpointing", "selective"),
                 ("--train.activation_checkpointing", "full")],
}
# CI: the first run of each layout (loss chunks, and on two ranks with selective checkpointing);
# full checkpointing and single-process selective in the slow tier, RUN_SLOW=1.
CASES = [pytest.param(layout, feats, marks=pytest.mark.slow) if i else (layout, feats)
         for layout, runs in FEATURES.items() for i, feats in enumerate(runs)]


def _series(out: Path) -> list[tuple[float, float]]:
    m = read_metrics(out)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    return [(r["loss"], r["grad_norm"]) for r in m]


def _assert_close(got: list, want: list, what: str) -> None:
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want, strict=True), 1):
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"{what} step {step}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), f"{what} step {step}: grad norm {norm} vs {ref_norm}"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    done: dict[str, list] = {}

    def get(layout: str) -> list:
        if layout not in done:
            args, nproc = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"default-{layout}")
            run_trainer(out, *BASE, *args, nproc=nproc)
            cfg = yaml.safe_load((out / "config.yaml").read_text())["train"]
            assert (cfg["loss_chunks"], cfg["activation_checkpointing"], cfg["compile"]) == (1, "none", "false")
            done[layout] = _series(out)
        return done[layout]

    return get


@pytest.mark.multiproc
@pytest.mark.parametrize("layout, feats", CASES,
                         ids=[f"{lay}-{'-'.join(f[1::2])}" for lay, runs in FEATURES.items() for f in runs])
def test_feature_keeps_the_losses(tmp_path, default_run, layout, feats):
    args, nproc = LAYOUTS[layout]
    proc = run_trainer(tmp_path, *BASE, *args, *feats, nproc=nproc)
    train = yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]
    log = proc.stdout + proc.stderr
    if "--train.loss_chunks" in feats:
        assert train["loss_chunks"] == 4 and "loss in 4 chunk(s)" in log
    mode = dict(zip(feats[::2], feats[1::2], strict=True)).get("--train.activation_checkpointing")
    if mode:
        assert re.search(rf"activation checkpointing {mode} on \d+ blocks", log), log[-2000:]
    _assert_close(_series(tmp_path), default_run(layout), f"{layout} {' '.join(feats)}")


def test_compile_true_keeps_the_losses(tmp_path, default_run):
    """One short single-process run with every block compiled (inductor's CPU backend)."""
    proc = run_trainer(tmp_path, *BASE, "--train.compile", "true", timeout=900)
    log = proc.stdout + proc.stderr
    assert "torch.compile: 2 blocks compiled in place + LM head and loss (backend inductor" in log
    assert "WON'T CONVERT" not in log, log[-3000:]  # a frame that fell back to eager would hide here
    assert re.search(r"torch\.compile: [1-9]\d* graph\(s\) compiled in the first step, 0 graph break", log)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["compile"] == "true"
    _assert_close(_series(tmp_path), default_run("single"), "compile true")


def test_checkpointing_and_compile_keep_parameter_names():
    """Blocks wrapped for activation checkpointing and compiled in place: the state dict (what
    checkpoints and DCP see) keeps the model's own names and tensors."""
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec
    from trainer.parallel.activation_checkpoint import CheckpointedBlock, apply_activation_checkpointing
    from trainer.parallel.compile import compile_blocks

    mc = ModelConfig(preset="tiny-qwen3")
    spec = model_spec(mc)
    plain, wrapped = build_model(spec, mc, 0), build_model(spec, mc, 0)
    assert apply_activation_checkpointing(wrapped, "selective") == 2
    assert compile_blocks(wrapped) == 2
    assert all(isinstance(b, CheckpointedBlock) for b in wrapped.model.layers)
    a, b = plain.state_dict(), wrapped.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert wrapped.lm_head.weight is wrapped.model.embed_tokens.weight  # the tie survives


# ------------------------------------------------------------------ meta-device init


@pytest.mark.multiproc
@pytest.mark.parametrize("preset, args", [
    ("tiny-bert", ("--parallel.sharding", "zero3", "--train.batch_size", "2")),   # tied weight and bias
    ("tiny-qwen3", ("--parallel.tp", "2")),                                        # TP shards, tied head
], ids=["bert-zero3x2", "qwen3-tp2"])
def test_meta_init_materialises_the_seeded_weights(tmp_path, preset, args):
    """Sharded layouts are built on the meta device and each rank materialises its shards from the
    seeded CPU model, which only rank 0 builds (rank 1 receives its values): a 0-step run's
    checkpoint holds exactly the single-process weights."""
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec

    run_trainer(tmp_path, "--config", "configs/tiny.yaml", "--model.preset", preset, "--train.steps", "0",
                "--checkpoint.enabled", "true", *args, nproc=2)
    built = [(tmp_path / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    assert ["model built on the meta device" in log for log in built] == [False, True]
    saved = checkpoint_tensors(tmp_path / "checkpoints" / "step-0")
    mc = ModelConfig(preset=preset)
    ref = build_model(model_spec(mc), mc, 1234).state_dict()  # configs/tiny.yaml's seed
    model = {k[len("app.model."):]: v for k, v in saved.items() if k.startswith("app.model.")}
    assert set(model) <= set(ref) and len(model) >= len(ref) - 2  # tied names may be stored once
    for name, tensor in model.items():
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.parametrize("preset", ["tiny-bert", "tiny-qwen3"])
def test_materialize_fills_meta_parameters_and_buffers_and_keeps_ties(preset):
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec
    from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
    from trainer.parallel.materialize import materialize, to_meta

    mc = ModelConfig(preset=preset)
    spec = model_spec(mc)
    ref_model, model = build_model(spec, mc, 5), build_model(spec, mc, 5)

    def ties(m) -> list[bool]:
        if preset == "tiny-bert":
            head = m.cls.predictions
            return [head.decoder.weight is m.bert.embeddings.word_embeddings.weight, head.decoder.bias is head.bias]
        return [m.lm_head.weight is m.model.embed_tokens.weight]

    assert all(ties(model))
    values = to_meta(model)
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert all(ties(model))  # a tie broken here would train two weights where the model has one
    apply_activation_checkpointing(model, "full")  # wrapper names are mapped back
    materialize(model, values, torch.device("cpu"))
    assert all(ties(model))
    want = dict(ref_model.named_buffers()) | dict(ref_model.named_parameters())
    got = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in
           [*model.named_buffers(), *model.named_parameters()]}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_stage_built_on_cpu_keeps_the_ties_of_one_built_on_meta():
    """In a sharded pipeline, the stage's source rank builds on the CPU and moves its stage to meta,
    the other ranks build on meta: both must hold the same parameters (BERT ties decoder.bias to
    predictions.bias inside the last stage), else materialize's collectives differ between them."""
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec
    from trainer.parallel.materialize import move
    from trainer.parallel.pipeline import plan_ranges
    from trainer.parallel.stages import split_model

    mc = ModelConfig(preset="tiny-bert")
    spec = model_spec(mc)
    last = []
    for meta in (False, True):
        model = build_model(spec, mc, 0, meta=meta)
        part = split_model(model, plan_ranges(model, "uniform_transformer", 2), keep=[1])[0][1]
        move(part, "meta")
        last.append(part)
    assert [n for n, _ in last[0].named_parameters()] == [n for n, _ in last[1].named_parameters()]
    head = last[0].cls.predictions
    assert head.decoder.bias is head.bias


# ------------------------------------------------------------------ defaults a GPU user meets


def test_one_microbatch_per_batch_without_a_pipeline(tmp_path):
    """pp=1 and no microbatch_num given: the model runs one forward per batch (the Pi guide's 4
    stay the default of pipelines)."""
    from trainer.config import resolve
    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import DistEnv
    from trainer.train import Trainer, setup_logging

    cfg = resolve(None, [("train.steps", 2), ("train.batch_size", 8), ("data.seq_len", 16),
                         ("profile.batch", "none"), ("output_dir", str(tmp_path))], environ={})
    assert cfg.train.microbatch_num == 1
    assert resolve(None, [("train.steps", 2), ("parallel.pp", 2)], environ={}).train.microbatch_num == 4
    setup_logging(0, tmp_path, console=False)
    trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), torch.device("cpu"), "gloo")
    batches: list[int] = []
    trainer.par.model_parts[0].register_forward_pre_hook(lambda m, a, kw: batches.append(kw["input_ids"].shape[0]),
                                                         with_kwargs=True)
    trainer.par.train(True)
    loss, norm = trainer.train_step()
    assert batches == [8] and torch.isfinite(loss) and torch.isfinite(norm)


def test_token_count_all_reduce_only_where_counts_differ(monkeypatch):
    """Causal LM on packed blocks: every rank's count is its share of the global count, so no
    collective per batch; a masked LM (counts differ per rank) still sums them."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from trainer.models.build import Task
    from trainer.parallel.parallelized import Parallelized

    calls = []

    def fake_all_reduce(t, group=None):
        calls.append(int(t))
        t.mul_(2)  # what two equal ranks would sum to

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    dims = SimpleNamespace(mesh=object(), dp=2, dp_mesh=SimpleNamespace(get_group=lambda: None))
    x = torch.zeros(2, 8, dtype=torch.long)
    causal = Parallelized([], Task("causal_lm", fused=True), dims, torch.device("cpu"))
    assert causal.loss_denominator(x, x) == 16.0 and calls == []
    masked = Parallelized([], Task("masked_lm", fused=True), dims, torch.device("cpu"))
    labels = torch.full((2, 8), -100)
    labels[0, :3] = 1
    assert masked.loss_denominator(x, labels) == 3.0 and calls == [3]


def test_dtype_auto_is_fp32_on_cpu_and_bf16_on_cuda_with_native_bf16(tmp_path):
    from trainer.runtime.dist_env import training_dtype

    assert training_dtype("auto", "cpu") == ("fp32", None)
    assert training_dtype("auto", "cuda", native_bf16=True) == ("bf16", None)
    assert training_dtype("auto", "cuda", native_bf16=False) == ("fp32", None)
    run_trainer(tmp_path, "--config", "configs/tiny.yaml", "--train.steps", "1")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["dtype"] == "fp32"


def test_tf32_only_for_fp32_on_cuda():
    from trainer.runtime.dist_env import configure_matmul_precision

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.backends.mkldnn.matmul.fp32_precision)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert configure_matmul_precision("cpu", "fp32") is None
        assert configure_matmul_precision("cuda", "bf16") is None
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert configure_matmul_precision("cuda", "fp32") is not None
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        # CPU matmuls (oneDNN) keep full fp32 whatever was set for CUDA
        assert torch.backends.mkldnn.matmul.fp32_precision == before[2]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]


def test_mfu_counts_attention_with_heads_times_head_dim():
    from trainer.config import ModelConfig
    from trainer.metrics import flops_per_token
    from trainer.models import model_spec

    qwen = model_spec(ModelConfig(preset="qwen3-0.6b"))
    assert (qwen.hidden_size, qwen.attention_width) == (1024, 16 * 128)
    assert model_spec(ModelConfig(preset="smollm-360m")).attention_width == 960
    assert flops_per_token(qwen.num_params, qwen.num_layers, qwen.attention_width, 2048) == \
        6 * qwen.num_params + 12 * 28 * 2048 * 2048


# ------------------------------------------------------------------ the chunked loss


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-bert"])
def test_chunked_loss_never_holds_the_full_logits(preset):
    """Loss and gradients of 4 chunks equal one call's; no tensor kept for backward (and no head
    output) has more than a chunk's rows of logits. Llama's bias-free linear head computes its
    gradients in the forward (head_loss_grad.py): the head module is not called, and no logits are
    kept even in one chunk; BERT's head (transform + decoder) keeps one call's logits."""
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec
    from trainer.models.lm_loss import install_loss_forward

    mc = ModelConfig(preset=preset)
    spec = model_spec(mc)
    vocab = spec.hf_config.vocab_size
    x = torch.randint(0, vocab - 1, (4, 32))
    y = torch.randint(0, vocab - 1, (4, 32))
    def run(chunks: int) -> tuple:
        model = install_loss_forward(build_model(spec, mc, 0), chunks)
        head = model.cls if hasattr(model, "cls") else model.lm_head
        rows: list[int] = []
        head.register_forward_hook(lambda m, a, out: rows.append(out.reshape(-1, out.shape[-1]).shape[0]))
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=x, targets=y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, rows, max(saved)

    results = {chunks: run(chunks) for chunks in (1, 4)}
    (l1, g1, rows1, saved1), (l4, g4, rows4, saved4) = results[1], results[4]
    assert torch.allclose(l4, l1, rtol=1e-6)
    assert all(torch.allclose(g4[n], g1[n], rtol=1e-4, atol=1e-6) for n in g1)
    full = x.numel() * vocab
    if preset == "tiny-llama":  # the weight is used directly; what is kept: [tokens, hidden] and [vocab, hidden]
        assert rows1 == rows4 == [] and max(saved1, saved4) == vocab * spec.hf_config.hidden_size < full
        return
    assert rows1 == [x.numel()] and saved1 >= full          # one call: the whole [tokens, vocab] logits
    assert set(rows4) == {x.numel() // 4} and saved4 < full // 2  # chunks: a quarter at a time, none kept


def test_one_data_permutation_per_epoch(monkeypatch):
    """Packed text: one randperm per epoch, not per sample (19 ms each at 1M blocks)."""
    from trainer.config import DataConfig
    from trainer.data.loader import DataStream

    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    blocks = torch.arange(40 * 9).view(40, 9)
    stream = DataStream("causal_lm", DataConfig(seq_len=8), 0, 4, 0, 2, vocab_size=400, blocks=blocks)
    seen = [stream.next_batch()[0] for _ in range(10)]  # 10 batches x 8 samples = 2 epochs of 40
    assert calls == [40, 40]
    first = torch.cat([s[:, 0] for s in seen[:5]])
    assert len(set((first // 9).tolist())) == 20  # rank 0's half of epoch 0: no block twice


def test_prefetched_batch_is_the_next_batch():
    from trainer.config import DataConfig
    from trainer.data.loader import DataStream

    a = DataStream("causal_lm", DataConfig(seq_len=8), 3, 2, 1, 2, vocab_size=100)
    b = DataStream("causal_lm", DataConfig(seq_len=8), 3, 2, 1, 2, vocab_size=100)
    b.prefetch()
    for _ in range(3):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch(), strict=True))
        b.prefetch()
    b.load_state_dict({"consumed": 0, "seed": 3})  # a resume moves the position: the prefetched batch is dropped
    assert torch.equal(b.next_batch()[0], DataStream("causal_lm", DataConfig(seq_len=8), 3, 2, 1, 2,
                                                     vocab_size=100).next_batch()[0])


def test_json_records_stay_plain_numbers(tmp_path):
    """Losses and norms are device tensors until a log step: what lands in metrics.jsonl are floats."""
    run_trainer(tmp_path, "--config", "configs/tiny.yaml", "--train.steps", "3", "--logging.log_interval", "2")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert [r["step"] for r in records] == [2, 3]  # every 2nd step, and the last
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in records)
