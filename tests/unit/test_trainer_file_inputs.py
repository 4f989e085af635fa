"""Files the trainer reads that a previous job, another node or the user's folders wrote:
a hostile or corrupt one is refused in one line (exit 2), runs nothing and starts nothing.

The checkpoint tests resume a real 2-step CPU run whose checkpoint was tampered with; each
planted file is also given its right size and crc32 in manifest.rank0.json, as anyone who can
write the file can do, so the checksum check is no defence."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from tests.support.trainer_run import run_trainer
from tests.unit.test_perseus_units import answering  # noqa: F401 - a fixture: a loopback HTTP server

TINY = ("configs/tiny.yaml", "--train.steps", "2", "--checkpoint.interval", "1")


class _Runs:
    """Unpickling this calls os.mkdir(marker): what any pickle can do with any callable."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    run_trainer(out, *TINY)
    return out


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    return out, out / "checkpoints" / "step-1"


def _plant(ckpt: Path, name: str, data: bytes) -> None:
    (ckpt / name).write_bytes(data)
    manifest = ckpt / "manifest.rank0.json"
    files = json.loads(manifest.read_text())
    files[name] = [len(data), zlib.crc32(data)]
    manifest.write_text(json.dumps(files))


def _resume(out: Path, *extra: str):
    return run_trainer(out, *TINY, "--checkpoint.resume", "step-1", *extra, check=False)


def _one_error(r, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors, r.stderr[-3000:]
    for w in words:
        assert w in errors[-1], errors[-1]
    return errors[-1]


def test_resume_runs_no_code_from_a_rank_rng_file(trained, tmp_path):
    out, ckpt = _copy(trained, tmp_path)
    marker = tmp_path / "ran"
    buf = Path(tmp_path / "evil.pt")
    torch.save({"rng": _Runs(marker), "data": {}, "coords": {}}, buf)
    _plant(ckpt, "rank0.pt", buf.read_bytes())
    r = _resume(out)
    assert not marker.exists(), "unpickling rank0.pt ran code"
    _one_error(r, "rank0.pt")


def test_a_rank_rng_file_larger_than_rng_state_is_refused_unread(tmp_path):
    """A rank<r>.pt is a few KB of RNG state; one of any size was loaded whole into memory."""
    from trainer.checkpoint.safe_read import MAX_RANK_FILE, load_rank_file
    from trainer.config import ConfigError

    f = tmp_path / "rank0.pt"
    torch.save({"rng": {"torch": torch.zeros(MAX_RANK_FILE // 4 + 1024, dtype=torch.int32)}, "data": {}}, f)
    with pytest.raises(ConfigError, match=r"rank0.pt: \d+ bytes, not a trainer RNG file"):
        load_rank_file(f)
    small = tmp_path / "rank1.pt"
    torch.save({"rng": {"torch": torch.get_rng_state()}, "data": {}}, small)
    assert torch.equal(load_rank_file(small)["rng"]["torch"], torch.get_rng_state())


def test_resume_runs_no_code_from_dcp_metadata(trained, tmp_path):
    out, ckpt = _copy(trained, tmp_path)
    marker = tmp_path / "ran"
    _plant(ckpt, ".metadata", pickle.dumps(_Runs(marker)))
    r = _resume(out)
    assert not marker.exists(), "unpickling .metadata ran code"
    _one_error(r, ".metadata")


def test_dcp_metadata_larger_than_any_the_trainer_writes_is_refused_unread(trained, tmp_path):
    """.metadata was unpickled at any size (a sparse file here: no disk used)."""
    from trainer.checkpoint.safe_read import MAX_METADATA, read_metadata
    from trainer.config import ConfigError

    out, ckpt = _copy(trained, tmp_path)
    assert read_metadata(ckpt / ".metadata").storage_data
    big = tmp_path / ".metadata"
    with big.open("wb") as f:
        f.truncate(MAX_METADATA + 1)
    with pytest.raises(ConfigError, match=rf"\.metadata: {MAX_METADATA + 1} bytes, not DCP checkpoint metadata"):
        read_metadata(big)


def test_resume_runs_no_code_from_a_shard_value(trained, tmp_path):
    """DCP stores a non-tensor value (an optimizer's lr, betas...) as torch.save bytes in a shard
    file, and its default planner loaded them with weights_only=False."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    out, ckpt = _copy(trained, tmp_path)
    marker = tmp_path / "ran"
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    index = next(i for i in md.storage_data if i.fqn.endswith(".lr"))
    buf = tmp_path / "evil.pt"
    torch.save(_Runs(marker), buf)
    shard = ckpt / "__0_0.distcp"
    data = shard.read_bytes()
    md.storage_data[index] = _StorageInfo(relative_path=shard.name, offset=len(data), length=buf.stat().st_size)
    _plant(ckpt, shard.name, data + buf.read_bytes())
    _plant(ckpt, ".metadata", pickle.dumps(md))
    r = _resume(out)
    assert not marker.exists(), "loading a shard's bytes ran code"
    _one_error(r, "step-1")


def test_resume_reads_no_shard_outside_the_checkpoint(trained, tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    out, ckpt = _copy(trained, tmp_path)
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    outside = tmp_path / "outside.distcp"
    shutil.copy(ckpt / "__0_0.distcp", outside)
    for index, info in list(md.storage_data.items()):
        md.storage_data[index] = _StorageInfo(relative_path="../../../outside.distcp", offset=info.offset,
                                              length=info.length, transform_descriptors=info.transform_descriptors)
    (ckpt / "__0_0.distcp").unlink()
    files = json.loads((ckpt / "manifest.rank0.json").read_text())
    del files["__0_0.distcp"]
    (ckpt / "manifest.rank0.json").write_text(json.dumps(files))
    _plant(ckpt, ".metadata", pickle.dumps(md))
    r = _resume(out)
    _one_error(r, "outside.distcp")


def test_a_genuine_checkpoint_still_resumes(trained, tmp_path):
    out, _ = _copy(trained, tmp_path)
    r = _resume(out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr


# ---------------------------------------------------------------- trainer_state.json

def _set(key: str, value: object):
    def edit(state: dict) -> str:
        d = state
        *path, last = key.split(".")
        for k in path:
            d = d[k]
        d[last] = value
        return json.dumps(state)
    return edit


@pytest.mark.parametrize("edit, why", [
    (lambda state: "[]", "not a mapping"),
    (lambda state: "[" * 100_000 + "]" * 100_000, "nested"),
    (_set("tokens_seen", None), "'tokens_seen'"),
    (_set("data", []), "'data'"),
    (_set("data.consumed", -1), "'data.consumed'"),
    (_set("scheduler", [1]), "'scheduler'"),
    (_set("model", "x"), "'model'"),
], ids=["list", "nested", "tokens-null", "data-list", "consumed-neg", "scheduler-list", "model-str"])
def test_resume_refuses_a_malformed_state_file_in_one_line(trained, tmp_path, edit, why):
    out, ckpt = _copy(trained, tmp_path)
    _plant(ckpt, "trainer_state.json", edit(json.loads((ckpt / "trainer_state.json").read_text())).encode())
    line = _one_error(_resume(out), "trainer_state.json")
    assert why in line


@pytest.mark.parametrize("text", ['{"step": 1e999}', '[1]', '"x"', '{"step": [1]}', "[" * 100_000 + "]" * 100_000])
def test_checkpoint_list_passes_over_a_malformed_state_file(tmp_path, text):
    """list_checkpoints runs after every save (pruning) and on every per-node resume: another
    checkpoint's bad state file is passed over, not a crash after a save."""
    from trainer.checkpoint.on_disk import list_checkpoints

    for name, body in (("step-1", '{"step": 1}'), ("step-9", text)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(body)
    assert [(s, d.name) for s, d in list_checkpoints(tmp_path)] == [(1, "step-1")]


# ---------------------------------------------------------------- manifest.rank<r>.json

@pytest.mark.parametrize("doc, why", [
    ([], "not a mapping"),
    ({"a.bin": "5"}, "a.bin"),
    ({"a.bin": [5]}, "a.bin"),
    ({"a.bin": [5, 1, 2]}, "a.bin"),
    ({"../../outside.bin": [5, None]}, "outside.bin"),
    ({"/etc/hostname": [5, None]}, "hostname"),
    ("nested", "nested"),
], ids=["list", "str", "short", "long", "climbs", "absolute", "nested"])
@pytest.mark.parametrize("all_present", [False, True])
def test_a_malformed_manifest_is_one_error(tmp_path, doc, why, all_present):
    from trainer.checkpoint.on_disk import verify_manifests

    d = tmp_path / "ckpts" / "step-1"
    d.mkdir(parents=True)
    (d / "a.bin").write_bytes(b"12345")
    (tmp_path / "outside.bin").write_bytes(b"12345")
    text = "[" * 100_000 + "]" * 100_000 if doc == "nested" else json.dumps(doc)
    (d / "manifest.rank0.json").write_text(text)
    err = verify_manifests(d, 1, 0, 1, all_present=all_present)
    assert err is not None and "manifest.rank0.json" in err and why in err, err
    assert "\n" not in err


# ---------------------------------------------------------------- latest

@pytest.mark.parametrize("name", ["../../elsewhere/step-1", "{abs}", "step-1/../../../elsewhere/step-1"])
def test_latest_names_a_checkpoint_of_its_own_dir_only(tmp_path, name):
    from trainer.checkpoint.on_disk import resolve_resume
    from trainer.config import ConfigError

    root = tmp_path / "run" / "checkpoints"
    (root / "step-1").mkdir(parents=True)
    (tmp_path / "elsewhere" / "step-1").mkdir(parents=True)
    name = name.format(abs=tmp_path / "elsewhere" / "step-1")
    (root / "latest").write_text(name + "\n")
    with pytest.raises(ConfigError, match="latest"):
        resolve_resume("latest", root)


# ---------------------------------------------------------------- model.path config.json

@pytest.fixture(scope="module")
def model_config(trained) -> dict:
    """The tiny Llama's config.json as the trainer wrote it (a save_pretrained folder's config)."""
    return json.loads((trained / "config.json").read_text())


@pytest.mark.parametrize("key, value", [
    ("vocab_size", 10**12), ("vocab_size", -1), ("vocab_size", 0), ("vocab_size", "x"), ("vocab_size", None),
    ("hidden_size", 10**9), ("num_hidden_layers", 1.5),
])
def test_a_model_config_with_impossible_sizes_is_one_line(model_config, tmp_path, key, value):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**model_config, key: value}))
    r = run_trainer(tmp_path / "out", *TINY, "--model.path", str(d), "--model.load_weights", "false", check=False)
    _one_error(r, "config.json", key)


def test_a_model_too_large_for_this_machine_is_refused_before_it_is_allocated(model_config, tmp_path, capsys,
                                                                              monkeypatch):
    """vocab_size 10**7 x hidden 64 x 2 matrices: 5.1 GB of fp32 weights (allocated and trained
    before), within every field's bound but over this machine's memory, here faked at 2 GiB."""
    from trainer.cli import main
    from trainer.models import build

    monkeypatch.setenv("PROFILE_BATCH", "0")  # run() exports it; keep it this test's
    monkeypatch.setattr(build, "physical_memory", lambda: 2 << 30)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**model_config, "vocab_size": 10**7}))
    capsys.readouterr()
    rc = main([*TINY, "--model.path", str(d), "--model.load_weights", "false", "--output-dir", str(tmp_path / "out")])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert "config.json" in lines[0] and "5.1 GB" in lines[0] and "this machine's memory (2.1 GB)" in lines[0], lines[0]
    assert "check its sizes (vocab_size 10000000" in lines[0], lines[0]


@pytest.mark.parametrize("sharding, tp, pp, world, local, rank, want", [
    ("ddp", 1, 1, 8, 8, 3, 8),        # every rank of the 8-GPU server builds a full copy
    ("zero3", 1, 1, 8, 8, 5, 1),      # sharded: rank 0 builds, the others build on meta
    ("zero3", 1, 1, 16, 8, 9, 0),     # the second machine of two: its weights come from rank 0
    ("zero3", 2, 1, 8, 8, 0, 1),      # tp 2 x dp 4: one stage of 8
    ("zero3", 2, 2, 8, 8, 7, 2),      # pp 2 x tp 2 x dp 2: stages of 4, ranks 0 and 4 build
    ("ddp", 1, 2, 8, 4, 6, 4),        # a pipeline without sharding: each of the 4 local ranks builds
    ("ddp", 1, 1, 1, 1, 0, 1),        # one process
])
def test_copies_built_on_one_machine_follow_the_layout(sharding, tp, pp, world, local, rank, want):
    from trainer.config import ParallelConfig
    from trainer.parallel.compose import copies_built_here
    from trainer.parallel.mesh import ParallelDims

    dims = ParallelDims.from_config(ParallelConfig(tp=tp, pp=pp, sharding=sharding), world, local)
    dims.mesh = object() if world > 1 else None  # what _sharded asks: a mesh exists (no process group here)
    assert copies_built_here(dims, rank, rank % local, local) == want


def test_eight_ranks_of_a_model_that_fits_once_are_refused_naming_the_ranks(model_config, monkeypatch):
    """8 DDP ranks on one machine each build the fp32 model (5.1 GB here, faked RAM 16 GiB): 41 GB.
    Before, the check counted one copy and the OOM killer ended the run (exit 137, no message)."""
    from trainer.config import ModelConfig
    from trainer.models import build

    monkeypatch.setattr(build, "physical_memory", lambda: 16 << 30)
    monkeypatch.setattr(build.container_limits, "CGROUP", Path("/nonexistent"))
    spec = build.ModelSpec("llama", "lm", None, 1_280_000_000, 2, 64, 64)
    build.check_fits(spec, ModelConfig(), copies=3)  # 15.4 GB of 17.2: fits
    with pytest.raises(build.ConfigError) as exc:
        build.check_fits(spec, ModelConfig(), copies=8)
    assert str(exc.value) == ("model: 1,280,000,000 parameters are 5.1 GB in fp32, and the 8 ranks on this machine "
                              "each build one at once (41.0 GB), more than this machine's memory (17.2 GB); fewer "
                              "ranks per machine, or a sharded layout (parallel.sharding zero3: one rank of each "
                              "stage builds it)")


@pytest.mark.parametrize("files, want", [
    ({"memory.max": "4294967296\n"}, (4 << 30, "this container's memory limit")),             # cgroup v2
    ({"memory/memory.limit_in_bytes": "536870912\n"}, (512 << 20, "this container's memory limit")),  # v1
    ({"memory.max": "max\n"}, (64 << 30, "this machine's memory")),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, (64 << 30, "this machine's memory")),
    ({"memory.max": "-1"}, (64 << 30, "this machine's memory")),
    ({"memory.max": "0"}, (64 << 30, "this machine's memory")),
    ({}, (64 << 30, "this machine's memory")),
])
def test_memory_limit_is_the_containers_when_below_the_ram(tmp_path, monkeypatch, files, want):
    from trainer.models import build

    monkeypatch.setattr(build, "physical_memory", lambda: 64 << 30)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert build.memory_limit(tmp_path) == want


def test_pretrained_pytorch_model_bin_runs_no_code(model_config, tmp_path):
    """model.path with pickled weights (pytorch_model.bin, as older Hub repos ship): transformers
    reads it with weights_only=True unless asked otherwise, and the trainer never asks."""
    marker = tmp_path / "ran"
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(model_config))
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": _Runs(marker)}, d / "pytorch_model.bin")
    r = run_trainer(tmp_path / "out", *TINY, "--model.path", str(d), check=False)
    assert not marker.exists(), "loading pytorch_model.bin ran code"
    _one_error(r, "model.path", "pytorch_model*.bin", "posix.mkdir, which is not data")


# ---------------------------------------------------------------- model.path weights index

@pytest.mark.parametrize("index", ["[]", '{"weight_map": {"a": 5}}', '"x"',
                                   "[" * 100_000 + "]" * 100_000])
def test_a_malformed_weights_index_is_one_error(model_config, tmp_path, index):
    from trainer.config import ConfigError
    from trainer.config.hub_layout import model_dir

    (tmp_path / "config.json").write_text(json.dumps(model_config))
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ConfigError, match="model.safetensors.index.json"):
        model_dir(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors",
                                   ".."])
def test_a_weights_index_naming_a_shard_outside_the_folder_is_refused(model_config, tmp_path, shard):
    """The shard existed outside the folder, so the existence check passed and transformers loaded
    weights from wherever the index pointed."""
    from trainer.config import ConfigError
    from trainer.config.hub_layout import model_dir

    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    (model / "config.json").write_text(json.dumps(model_config))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    with pytest.raises(ConfigError, match=r"lists weight shard .* which is not a file of the model folder"):
        model_dir(model)


# ---------------------------------------------------------------- instructions-<rank>.csv (trainer perseus-plans)

HEADER = "instruction,stage,microbatch,start\n"


@pytest.mark.parametrize("files, where", [
    ({"instructions-0.csv": HEADER + "forward_microstep,0,0,x\n"}, "instructions-0.csv:2"),
    ({"instructions-0.csv": HEADER + "forward_microstep,,0,1.0\n"}, "instructions-0.csv:2"),
    ({"instructions-0.csv": "instruction,start\nforward_microstep,1.0\n"}, "instructions-0.csv:2"),
    ({"instructions-0.csv": HEADER + "forward_microstep,0,0,nan\n"}, "instructions-0.csv:2"),
    ({"instructions-0.csv": HEADER + "forward_microstep,0,0,1.0\n", "instructions-x.csv": HEADER},
     "instructions-x.csv"),
], ids=["start", "stage-empty", "no-columns", "start-nan", "rank-name"])
def test_perseus_plans_refuse_a_malformed_instructions_csv_in_one_line(tmp_path, files, where):
    from trainer.config import ConfigError
    from trainer.profiling.perseus_plans import orders

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        orders(tmp_path)
    assert where in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- a Perseus server's answer

@pytest.mark.parametrize("status", [200, 500])
def test_a_perseus_answer_nested_past_the_recursion_limit_is_one_line(answering, status):  # noqa: F811
    from trainer.profiling.perseus_client import PerseusClient, PerseusError

    url = answering(status, b"[" * 200_000 + b"]" * 200_000)  # 400 kB, within the 4 MiB bound
    with pytest.raises(PerseusError, match="Perseus server"):
        PerseusClient(url).register_job(2, 1, 1, 2, None)


# ---------------------------------------------------------------- image folder

def test_a_decompression_bomb_image_is_one_line(tmp_path):
    """A 20000 x 20000 PNG of one colour is a 50 kB file; PIL refuses to decode it (over twice
    MAX_IMAGE_PIXELS) with DecompressionBombError, which is not an OSError: a traceback mid-run."""
    from PIL import Image

    from trainer.config import ConfigError
    from trainer.data.loader import ImageFolder

    (tmp_path / "cats").mkdir()
    bomb = tmp_path / "cats" / "bomb.png"
    Image.new("1", (20_000, 20_000)).save(bomb, optimize=True)
    assert bomb.stat().st_size < 1 << 20
    folder = ImageFolder.scan(str(tmp_path), 0, 0.0, 10, 3)
    with pytest.raises(ConfigError, match="bomb.png"):
        folder.load(folder.train_files[0], 32)


# ---------------------------------------------------------------- data.source folders

def test_a_data_folder_with_a_loading_script_runs_nothing_and_is_one_line(tmp_path):
    """A Hub dataset snapshot may still hold an old loading script: datasets 4+ refuses it with a
    RuntimeError (not caught: a traceback); it must never run."""
    from trainer.config import ConfigError
    from trainer.config.schema import DataConfig
    from trainer.data.text_sources import load_texts

    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    marker = tmp_path / "ran"
    (tmp_path / f"{tmp_path.name}.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    with pytest.raises(ConfigError, match="data.source"):
        load_texts(DataConfig(source=str(tmp_path)), cache_dir=str(tmp_path / "cache"))
    assert not marker.exists()


@pytest.mark.parametrize("edit", [
    _set("scheduler.last_epoch", "x"),
    _set("scheduler.base_lrs", "x"),
    _set("scheduler.optimizer", {}),
], ids=["last_epoch-str", "base_lrs-str", "optimizer"])
def test_resume_refuses_a_scheduler_state_that_is_not_this_schedulers(trained, tmp_path, edit):
    """LambdaLR.load_state_dict copies every key of the mapping onto the scheduler (and lr_lambdas'
    items onto its functions): a key or type it does not have broke the run at its first step."""
    out, ckpt = _copy(trained, tmp_path)
    _plant(ckpt, "trainer_state.json", edit(json.loads((ckpt / "trainer_state.json").read_text())).encode())
    _one_error(_resume(out), "trainer_state.json", "scheduler")


# ---------------------------------------------------------------- metrics.jsonl on resume

@pytest.mark.parametrize("line", ['{"step": [1]}', '{"step": 1e999}', "[" * 100_000 + "]" * 100_000])
def test_truncating_metrics_on_resume_drops_a_malformed_line(tmp_path, line):
    from trainer.checkpoint.checkpointer import _truncate_metrics

    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 1}\n' + line + '\n{"step": 2}\n{"step": 3}\n')
    _truncate_metrics(m, 2)
    assert m.read_text() == '{"step": 1}\n{"step": 2}\n'


# ---------------------------------------------------------------- model files copied out of a checkpoint

def test_model_files_copy_follows_no_link_out_of_a_checkpoint(tmp_path):
    """`trainer export` copies a checkpoint's tokenizer files into the export (which is then shared,
    pushed to the Hub): a tokenizer.json that is a link to a key put the key in the export."""
    from trainer.config import ConfigError
    from trainer.models import files as model_files

    ckpt, out = tmp_path / "step-1", tmp_path / "export"
    ckpt.mkdir()
    out.mkdir()
    secret = tmp_path / "id_ed25519"
    secret.write_text("PRIVATE KEY")
    (ckpt / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ConfigError, match="tokenizer.json"):
        model_files.copy(ckpt, out, model_files.TOKENIZER_FILES)
    assert not (out / "tokenizer.json").exists()


# ---------------------------------------------------------------- a checkpoint's config.yaml

def _alias_bomb(levels: int) -> str:
    lines = ["l0: &l0 {a: 1, b: 1}"] + [f"l{i}: &l{i} {{a: *l{i - 1}, b: *l{i - 1}}}" for i in range(1, levels + 1)]
    return "\n".join([*lines, f"model: *l{levels}"]) + "\n"


@pytest.mark.parametrize("text, why", [(_alias_bomb(20), "alias"), ("a: " + "[" * 100_000 + "]" * 100_000, "nested")],
                         ids=["alias-bomb", "nested"])
def test_a_config_yaml_bomb_is_refused_before_it_expands(tmp_path, monkeypatch, text, why):
    """`trainer export` reads the checkpoint's config.yaml: 575 bytes of nested aliases took 5.2 s
    and 1.1 GB to flatten (each level more doubles both); nesting was a RecursionError traceback
    after seconds of pure-Python parsing. Both are refused from the parser's events: nothing is
    composed (safe_load never runs) and the refusal allocates under 16 MB."""
    import tracemalloc

    import yaml

    from trainer.config import Config, ConfigError, apply_yaml

    def no_compose(*a, **k):
        raise AssertionError("composed before the refusal")

    monkeypatch.setattr(yaml, "safe_load", no_compose)
    f = tmp_path / "config.yaml"
    f.write_text(text)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=why) as e:
            apply_yaml(Config(), f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert "config.yaml" in str(e.value) and "\n" not in str(e.value)


def test_a_config_yaml_larger_than_a_config_is_refused_unread(tmp_path):
    from trainer.config import Config, ConfigError, apply_yaml

    f = tmp_path / "config.yaml"
    f.write_text("train:\n" + "".join(f"  k{i}: {i}\n" for i in range(100_000)))
    with pytest.raises(ConfigError, match=r"config.yaml' is \d+ bytes; a trainer config is at most 1048576"):
        apply_yaml(Config(), f)


def _dump_with_enums_by_getattr(md) -> bytes:
    """The .metadata as the image's Python (Debian's 3.11.2) writes it: each Enum member as
    getattr(EnumClass, 'NAME'). This machine's 3.11.7 writes EnumClass(value) instead."""
    import copyreg
    import enum
    import io

    import torch.distributed.checkpoint.metadata as dcp_metadata

    buf = io.BytesIO()
    p = pickle.Pickler(buf)
    enums = [c for c in vars(dcp_metadata).values() if isinstance(c, type) and issubclass(c, enum.Enum)]
    p.dispatch_table = {**copyreg.dispatch_table, **{c: (lambda m: (getattr, (type(m), m.name))) for c in enums}}
    p.dump(md)
    return buf.getvalue()


def test_a_checkpoint_whose_metadata_names_enum_members_by_getattr_resumes(trained, tmp_path):
    """Every checkpoint the image's trainer wrote: the reader refused 'builtins.getattr', so each
    multi-node resume (elastic, partition) stopped with 'not DCP checkpoint metadata'."""
    out, ckpt = _copy(trained, tmp_path)
    data = _dump_with_enums_by_getattr(pickle.loads((ckpt / ".metadata").read_bytes()))
    assert b"getattr" in data
    _plant(ckpt, ".metadata", data)
    r = _resume(out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr


def test_metadata_getattr_reaches_enum_members_only():
    """getattr is allowed for a metadata enum's member by name; on any other allowed class
    (torch.Size's attributes, a dataclass's methods) it is one error and nothing runs."""
    from trainer.checkpoint import safe_read

    with pytest.raises(pickle.UnpicklingError):
        safe_read._enum_member(torch.Size, "__class__")
    with pytest.raises(pickle.UnpicklingError):
        safe_read._enum_member(safe_read.Metadata, "__init__")
    import torch.distributed.checkpoint.metadata as dcp_metadata

    member = next(iter(dcp_metadata._MEM_FORMAT_ENCODING))
    assert safe_read._enum_member(dcp_metadata._MEM_FORMAT_ENCODING, member.name) is member
