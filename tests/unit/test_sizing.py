"""Sizing before launch (issue 24, item 3): `runner up --dry-run` shows each node's stage estimate
next to the node's memory and `runner up` refuses a stage that cannot fit, before contacting
anything and without torch; the runner's arithmetic (contract/model_size.py) equals what
`trainer --dry-run` counts on the meta device, and both are within 25 % of the peak memory a real
training run reaches on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.memory import auto_loss_chunks, in_flight, stage_memory
from contract.model_size import NotSized, model_shape, stage_loads, with_overrides
from contract.presets import PRESETS
from runner.core.errors import UserError
from runner.inventory import Job, load_inventory
from runner.planning.sizing import (
    DEFAULTS,
    ENV,
    FLAGS,
    RUNTIME_BYTES,
    SWITCHES,
    YAML,
    job_settings,
    model_of,
    size_job,
)
from tests import REPO
from tests.support.runner_helpers import no_socket_env

PI_CONFIG = REPO / "configs/pi-qwen3-3stage.yaml"
GIB = 1 << 30


def pis(tmp_path: Path, memory: tuple[str, str, str], job: str = "", config: Path = PI_CONFIG) -> Path:
    """Three Pis as hosts/pis.yaml has them, on loopback addresses nothing listens on."""
    p = tmp_path / "pis.yaml"
    nodes = "".join(f"  - {{name: pi-{i}, host: 127.33.240.{i + 1}, port: 9{i}{'' if m is None else ', memory: ' + m}"
                    f"{', role: master' if i == 0 else ''}}}\n" for i, m in enumerate(memory))
    p.write_text(f"defaults: {{user: pi, arch: arm64}}\nnodes:\n{nodes}job:\n  image: runner-trainer:arm64\n"
                 f"  config: {config}\n  args: [--train_steps, '5', --batch_size, '16', --microbatch_num, '4']\n{job}")
    return p


def test_up_dry_run_sizes_each_pi_and_refuses_the_stage_that_cannot_fit(tmp_path, capsys, monkeypatch):
    from runner.cli.main import main

    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "no-profiles"))
    inv = pis(tmp_path, ("8g", "8g", "4g"))
    assert main(["up", "-i", str(inv), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith(("sizing:", "  pi-"))]
    assert lines[0].startswith("sizing: qwen3-0.6b (qwen3), 596.05M parameters; world 3 = pp 3 x dp 1 x tp 1, ddp, "
                               "partition custom:0,7,21,28 (layers 0,7,21,28); 4 microbatches of 4 x 128 tokens")
    # The Pi guide's 7/14/7 split of Qwen3-0.6B: the end stages hold 265.70M parameters each (the
    # tied embedding twice), fp32 on a CPU: 4 + 4 + 8 bytes of weights, gradients and AdamW state.
    assert "pi-0: stage 0 (embeddings + layers 0-6): needs 5.68 GiB = runtime 400.0 MiB + weights 1013.6 MiB" \
        in lines[1] and lines[1].endswith("has 8.00 GiB (inventory memory: 8g): fits")
    assert "pi-1: stage 1 (layers 7-20): needs 5.43 GiB" in lines[2] and "(2 in flight)" in lines[2]
    assert "pi-2: stage 2 (layers 21-27 + head): needs 5.66 GiB" in lines[3] and \
        lines[3].endswith("has 4.00 GiB (inventory memory: 4g): DOES NOT FIT")
    assert err == ("runner: error: " + str(inv) + ": node pi-2 cannot hold pipeline stage 2 (layers 21-27 + head): it "
                   "needs 5.66 GiB and has 4.00 GiB (inventory memory: 4g); use `parallel.partition: auto` (stages "
                   "sized to each node's measured memory) or a smaller microbatch (--batch_size / --microbatch_num), "
                   "or give the node more memory (--ignore-sizing launches anyway)\n")
    sizing = size_job(load_inventory(inv))
    pi2 = sizing.nodes[2]
    assert sizing.shape.stage_params(21, 28, first=False, last=True) == 265_700_096
    assert (pi2.estimate[0].weights, pi2.estimate[0].optimizer) == (4 * 265_700_096, 8 * 265_700_096)
    assert pi2.need == RUNTIME_BYTES + pi2.estimate[0].total and pi2.have == 4 * GIB

    # 8 GB boards and a halved microbatch: every stage fits, exit 0; a node without `memory:` is
    # shown as unknown and never refused.
    inv = pis(tmp_path, ("8g", "8g", None))
    assert main(["up", "-i", str(inv), "--dry-run", "--", "--microbatch_num", "8"]) == 0
    out = capsys.readouterr().out
    assert "8 microbatches of 2 x 128 tokens" in out and out.count(": fits") == 2
    assert "pi-2: stage 2 (layers 21-27 + head)" in out and "memory not known (set the node's `memory:` or run " \
        "`runner profile`)" in out
    # --ignore-sizing prints the same and goes on
    assert main(["up", "-i", str(pis(tmp_path, ("8g", "8g", "4g"))), "--dry-run", "--ignore-sizing"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_memory_probed_at_launch_counts_as_the_least_known(tmp_path, monkeypatch):
    """What `up` learns on connecting (each node's MemAvailable) joins `memory:` and the profile:
    the least of them is the node's memory. A node without `memory:` whose MemAvailable is short is
    refused by name; one whose probe said nothing keeps what was known."""
    from runner.planning.sizing import check_sizing

    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "no-profiles"))
    inv = load_inventory(pis(tmp_path, ("8g", None, None)))
    sizing = size_job(inv, probed={"pi-0": 7 * GIB, "pi-1": 3 * GIB})
    assert [(n.have, n.have_from) for n in sizing.nodes] == [
        (7 * GIB, "probed: the node's MemAvailable"), (3 * GIB, "probed: the node's MemAvailable"),
        (None, "set the node's `memory:` or run `runner profile`")]
    assert [n.fits for n in sizing.nodes] == [True, False, None]
    with pytest.raises(UserError) as e:
        check_sizing(inv, show=False, ignore=False, probed={"pi-0": 7 * GIB, "pi-1": 3 * GIB})
    assert str(e.value).startswith(f"{inv.path}: node pi-1 cannot hold pipeline stage 1 (layers 7-20): it needs "
                                   "5.43 GiB and has 3.00 GiB (probed: the node's MemAvailable)")
    check_sizing(inv, show=False, ignore=True, probed={"pi-1": 3 * GIB})  # --ignore-sizing: goes on
    check_sizing(inv, show=False, ignore=False, probed={"pi-1": 64 * GIB})  # enough: nothing said
    assert size_job(inv, probed={"pi-0": 64 * GIB}).nodes[0].have == 8 * GIB  # `memory:` is less


def test_up_refuses_before_any_socket_and_without_torch(tmp_path):
    """The same refusal without --dry-run: one line, exit 2, no socket opened, torch never imported."""
    inv = pis(tmp_path, ("8g", "8g", "4g"))
    code = ("import sys; sys.modules['torch'] = None; from runner.cli.main import main; "
            f"sys.exit(main(['up', '-i', {str(inv)!r}]))")
    env = {**no_socket_env(tmp_path), "RUNNER_PROFILE_CACHE": str(tmp_path / "none")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"runner: error: {inv}: node pi-2 cannot hold pipeline stage 2 (layers 21-27 + "
                                     "head): it needs 5.66 GiB and has 4.00 GiB (inventory memory: 4g); use "
                                     "`parallel.partition: auto` (stages sized to each node's measured memory) or a "
                                     "smaller microbatch (--batch_size / --microbatch_num), or give the node more "
                                     "memory (--ignore-sizing launches anyway)"]


def test_profiled_memory_and_a_synced_hub_snapshot(tmp_path, monkeypatch, capsys):
    """model.path sized from the config.json job.sync sends (a Hub cache repo: refs/main ->
    snapshots/<rev>/); the node's memory from `runner profile`'s cache, the smaller of it and `memory:`."""
    from runner.cli.main import main

    repo = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    fields = {**PRESETS["smollm-360m"].config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (snap / "config.json").write_text(json.dumps(fields))
    job = (f"  sync: [{{src: {repo}, dst: /data/model}}]\n"
           "  env: {BATCH_SIZE: '8'}\n")
    config = tmp_path / "pi.yaml"  # the Pi config less its vocab_size: the weights' vocabulary then
    config.write_text("".join(ln for ln in PI_CONFIG.read_text().splitlines(True) if "vocab_size: 151936" not in ln))
    inv = pis(tmp_path, ("8g", "8g", "8g"), job=job, config=config)
    text = inv.read_text().replace("--microbatch_num, '4']", "--microbatch_num, '4', --model.path, /data/model, "
                                   "--parallel.partition, uniform_transformer]")
    inv.write_text(text)
    cache = tmp_path / "profiles"
    cache.mkdir()
    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(cache))
    # what `runner profile` left for pi-1 (and a file of another cluster's pi-1, another address: not used)
    doc = {"host": "127.33.240.2", "memory_available": 3 * GIB, "memory_source": "cgroup limit", "runtime_bytes": 300 << 20}
    (cache / "node-pi-1-0123456789abcdef.json").write_text(json.dumps(doc))
    (cache / "node-pi-1-fedcba9876543210.json").write_text(json.dumps({**doc, "host": "10.0.0.9", "memory_available": 1}))
    sizing = size_job(load_inventory(inv))
    assert sizing.model == "/data/model" and sizing.shape.params == 361_821_120  # SmolLM-360M
    assert sizing.bounds == [0, 11, 22, 32]
    assert [n.have for n in sizing.nodes] == [8 * GIB, 3 * GIB, 8 * GIB]
    assert sizing.nodes[1].have_from == "runner profile: cgroup limit" and sizing.nodes[1].runtime == 300 << 20
    assert main(["up", "-i", str(inv), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "sizing: /data/model (llama), 361.82M parameters" in out and "layers 0,11,22,32" in out
    assert "pi-1: stage 1 (layers 11-21): needs" in out and "has 3.00 GiB (runner profile: cgroup limit)" in out
    # the Pi config's own split does not fit 32 layers: not estimated here (the trainer says why)
    assert main(["up", "-i", str(inv), "--dry-run", "--", "--parallel.partition", "custom:0,7,21,28"]) == 0
    assert "sizing: not estimated here: parallel.partition custom:0,7,21,28: not a split of 32 layers into 3 " \
        "stages" in capsys.readouterr().out
    # a config.json that links out of the synced folder is not read (job.sync refuses it too)
    outside = tmp_path / "elsewhere.json"
    outside.write_text((snap / "config.json").read_text())
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(outside)
    with pytest.raises(NotSized, match=f"model.path /data/model: {snap / 'config.json'} links out of the job.sync "
                                       f"source {repo}"):
        size_job(load_inventory(inv))


def test_the_runner_reads_the_sizing_keys_as_the_trainer_does():
    """Defaults, seed-flag spellings, env fallbacks and YAML aliases of the sizing keys are the
    trainer's (trainer/config/, trainer/config/flags.py); a job's settings resolve alike."""
    from trainer.config import Config, get_key, resolve
    from trainer.config.flags import ENV_KEYS, YAML_ALIASES
    from trainer.config.flags import FLAGS as TRAINER_FLAGS

    cfg = Config()
    assert {k: v for k, v in DEFAULTS.items()} == {k: get_key(cfg, k) for k in DEFAULTS}
    assert FLAGS == {f: a.canonical for f, a in TRAINER_FLAGS.items() if a.canonical in DEFAULTS}
    assert SWITCHES == {f for f, a in TRAINER_FLAGS.items() if a.is_switch}
    assert ENV == {v: k for v, k in ENV_KEYS.items() if k in DEFAULTS}
    assert YAML == {k: a.canonical for k, a in YAML_ALIASES.items() if a.canonical in DEFAULTS}

    args = ["--train_steps", "5", "--data.source", "synthetic", "--mbs", "6", "--export_timing_csv", "--pp=2", "--seq_len", "64", "--model.num_hidden_layers", "6",
            "--use_cpu", "--parallel.partition", "custom:0,2,6", "--model_name", "HuggingFaceTB/SmolLM-135M"]
    job = Job(config=str(REPO / "configs/pi-qwen3-3stage.yaml"), args=args, env={"MICROBATCH_NUM": "3"})
    ours = job_settings(job)
    from trainer.config.argv import parse_train_args

    path, overrides = parse_train_args(["--config", job.config, *args])
    theirs = resolve(path, overrides, environ=job.env)
    for key in DEFAULTS:
        if key not in ("train.microbatch_num", "model.path"):  # validate() fills the former in
            assert ours[key] == get_key(theirs, key), key
    assert (ours["train.microbatch_num"], ours["model.preset"], ours["parallel.device"]) == (3, "smollm-135m", "cpu")


WIDER = [("model.hidden_size", 128), ("model.num_attention_heads", 8)]  # overrides apply as the trainer's do
TINY = {  # family presets at test size (every family the arithmetic covers), and Qwen3-0.6B's own
    "tiny-llama": WIDER, "tiny-qwen2": WIDER, "tiny-qwen3": WIDER, "tiny-gpt2": [("model.intermediate_size", 100)],
    "tiny-bert": [], "tiny-bloom": [], "qwen3-0.6b": [("model.num_hidden_layers", 4), ("model.vocab_size", 4096)],
}


@pytest.mark.parametrize("preset", list(TINY))
def test_the_arithmetic_equals_the_meta_count(preset):
    """Per stage of a 3-stage split: parameters exact, saved activations within 3 %, the same loss
    scratch; Qwen3-0.6B's layers at 128 tokens = its head_dim, where k^T looks like scores."""
    from trainer.config import resolve
    from trainer.models.build import build_hf_config
    from trainer.tools.dry_run import make_plan

    over = [("model.preset", preset), ("train.steps", 1), ("train.batch_size", 8), ("data.seq_len", 128),
            ("train.dtype", "fp32"), ("parallel.pp", 3), ("parallel.partition", "custom:0,1,3,4"),
            ("model.num_hidden_layers", 4), *TINY[preset]]
    cfg = resolve(None, over, environ={})
    plan = make_plan(cfg)
    family, _ = build_hf_config(cfg.model)
    model = {k: getattr(cfg.model, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                 "intermediate_size", "vocab_size")}
    shape = model_shape(family, with_overrides(family, PRESETS[preset].config, model, {}, preset=True))
    loads = stage_loads(shape, [0, 1, 3, 4], micro=2, seq=128, dtype="fp32",
                        chunks=auto_loss_chunks(256, shape.vocab))
    for st, load in zip(plan["stages"], loads, strict=True):
        assert st["params"] == load.params
        assert st["boundary_bytes_per_microbatch"] == load.boundary_bytes
        assert abs(st["activation_bytes_per_microbatch"] / load.activation_bytes - 1) < 0.03, (st, load)
        assert st["memory"]["transient"] == load.transient_bytes


@pytest.mark.parametrize("preset", list(TINY))
@pytest.mark.parametrize("method", ["uniform", "parameters"])
def test_the_runner_splits_uniform_and_parameters_as_the_trainer_does(preset, method):
    """Merak's `uniform` and `parameters` splits, computed by the runner from the arithmetic's shape
    (contract/partition.py), equal the trainer's on its meta model: 3 and 4 stages of 6 layers."""
    from runner.planning.sizing import stage_bounds
    from trainer.config import resolve
    from trainer.models.build import build_hf_config
    from trainer.tools.dry_run import make_plan

    for pp in (3, 4):
        over = [("model.preset", preset), ("train.steps", 1), ("train.batch_size", 8), ("data.seq_len", 128),
                ("train.dtype", "fp32"), ("parallel.pp", pp), ("parallel.partition", method),
                *[kv for kv in TINY[preset] if kv[0] != "model.num_hidden_layers"], ("model.num_hidden_layers", 6)]
        cfg = resolve(None, over, environ={})
        trainer_bounds = [st["units"][0] for st in make_plan(cfg)["stages"]] + [6]
        family, _ = build_hf_config(cfg.model)
        model = {k: getattr(cfg.model, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                     "intermediate_size", "vocab_size")}
        shape = model_shape(family, with_overrides(family, PRESETS[preset].config, model, {}, preset=True))
        assert stage_bounds(method, 6, pp, shape) == trainer_bounds, (preset, method, pp)


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "zbv"])
def test_virtual_stages_are_sized_per_rank_as_the_trainer_does(schedule, tmp_path, monkeypatch):
    """Two stages a rank (pp 2 x 2): the runner places them as the schedule does (round-robin for
    interleaved 1F1B, the zig-zag of ZBV) and sizes each rank for all of its stages, equal to what
    `trainer --dry-run` totals per rank on its meta model (parameters exact, activations within 3 %)."""
    from runner.inventory import Inventory, Job, Node
    from trainer.config import resolve
    from trainer.tools.dry_run import make_plan

    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "no-profiles"))
    over = [("model.preset", "tiny-llama"), ("train.steps", 1), ("train.batch_size", 8), ("data.seq_len", 128),
            ("train.dtype", "fp32"), ("parallel.pp", 2), ("parallel.virtual_stages", 2),
            ("parallel.pp_schedule", schedule), ("parallel.partition", "uniform_transformer"),
            ("model.num_hidden_layers", 6), *WIDER]
    plan = make_plan(resolve(None, over, environ={}))
    args = [x for k, v in over for x in (f"--{k}", str(v))]
    inv = Inventory("inv.yaml", [Node("a", "127.33.9.1", role="master"), Node("b", "127.33.9.2")], Job(args=args))
    sizing = size_job(inv)
    assert sizing.rank_stages == {r["pp_rank"]: r["stages"] for r in plan["ranks"]}
    assert sizing.rank_stages == ({0: [0, 2], 1: [1, 3]} if schedule == "interleaved1f1b" else {0: [0, 3], 1: [1, 2]})
    for node, rank in zip(sizing.nodes, plan["ranks"], strict=True):
        got, want = node.estimate[0], rank["memory"]
        assert (got.weights, got.gradients, got.optimizer, got.transient) == \
            (want["weights"], want["gradients"], want["optimizer"], want["transient"]), (schedule, node.node)
        assert abs(got.activations / want["activations"] - 1) < 0.03, (got, want)
    assert "pp rank 1's stages " in sizing.render()


MEASURE = (Path(__file__).resolve().parents[1] / "support" / "sizing_peak.py")
MODELS = {  # big enough that the model, not the interpreter, makes the peak (~250 MB each)
    "llama": ["--model.preset", "tiny-llama", "--model.hidden_size", "256", "--model.intermediate_size", "1024",
              "--model.num_attention_heads", "4", "--model.vocab_size", "4096", "--model.num_hidden_layers", "4",
              "--train.batch_size", "8", "--data.seq_len", "128"],
    "gpt2": ["--model.preset", "tiny-gpt2", "--model.hidden_size", "256", "--model.vocab_size", "4096",
             "--model.num_hidden_layers", "4", "--train.batch_size", "8", "--data.seq_len", "128"],
}


def test_the_estimate_is_within_25_percent_of_the_measured_peak_on_cpu(tmp_path):
    """One process trains each model 2 steps (fp32, CPU, the trainer's own loop: one launch per
    model) and measures its peak RSS over the RSS after the imports (big tensors mmapped, so freed
    memory leaves RSS); `trainer --dry-run`'s estimate and the runner's arithmetic both within 25 %."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, str(MEASURE), json.dumps(MODELS), str(tmp_path)], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.splitlines()[-1])
    for name, m in result.items():
        measured, trainer = m["measured"], m["estimate"]
        _, shape = model_of(job_settings(Job(args=MODELS[name])), Job())  # what `runner up` computes
        load = stage_loads(shape, [0, shape.layers], micro=8, seq=128, dtype="fp32",
                           chunks=auto_loss_chunks(8 * 128, shape.vocab))[0]
        runner = stage_memory(load, in_flight=in_flight("none", 0, 1, 1), dtype="fp32").total
        print(name, f"measured {measured / 2**20:.1f} MiB, trainer --dry-run {trainer / 2**20:.1f} MiB, "
                    f"runner {runner / 2**20:.1f} MiB")
        assert measured > 150 << 20, (name, m)  # the model's memory, not noise
        for estimate in (trainer, runner):
            assert abs(estimate - measured) <= 0.25 * measured, (name, measured, estimate)


@pytest.mark.parametrize("sharding, tp, pp, nodes, per_node", [
    ("ddp", 1, 1, 1, 8),      # the 8-GPU server, DDP: eight copies
    ("zero3", 1, 1, 2, 4),    # ZeRO-3 over two machines: rank 0 only
    ("zero2", 2, 1, 2, 4),    # tp 2 x dp 4
    ("zero3", 2, 2, 2, 4),    # pp 2 x tp 2 x dp 2: ranks 0 and 4, one a machine
    ("ddp", 1, 3, 3, 1),      # the Pis' unsharded pipeline: every rank
    ("ddp", 2, 2, 2, 2),      # tp alone shards: ranks 0 and 2 of 4
])
def test_the_whole_model_is_sized_where_the_trainer_builds_it(sharding, tp, pp, nodes, per_node, tmp_path,
                                                              monkeypatch):
    """The runner counted no fp32 build at all for a sharded layout, while the trainer builds the
    whole model on each stage's first rank (trainer/parallel/compose.py copies_built_here): its node
    could be passed as fitting and then die of the OOM killer. The ranks that build, per node,
    equal the trainer's count."""
    from runner.inventory import Inventory, Job, Node
    from trainer.config import ParallelConfig
    from trainer.parallel.compose import copies_built_here
    from trainer.parallel.mesh import ParallelDims

    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "no-profiles"))
    args = ["--parallel.sharding", sharding, "--parallel.tp", str(tp), "--parallel.pp", str(pp),
            "--model.num_hidden_layers", "6"]
    inv = Inventory("inv.yaml", [Node(f"n{i}", f"127.33.9.{i + 1}", role="master" if i == 0 else "worker")
                                 for i in range(nodes)], Job(args=args, nproc_per_node=per_node))
    sizing = size_job(inv)
    whole = 4 * sizing.shape.params
    world = nodes * per_node
    dims = ParallelDims.from_config(ParallelConfig(tp=tp, pp=pp, sharding=sharding), world, per_node)
    dims.mesh = object()
    for i, node in enumerate(sizing.nodes):
        assert set(node.builds) <= {0, whole}, node.builds
        assert node.builds.count(whole) == copies_built_here(dims, i * per_node, 0, per_node), (i, node.builds)
    assert sum(n.builds.count(whole) for n in sizing.nodes) == (world if tp == 1 and sharding == "ddp" else pp)
