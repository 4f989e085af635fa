"""`trainer --dry-run`: every paper command of the Perseus guide (plus t5-11b and gpt3-175b) is
planned on the meta device, with each stage's memory, reading no data, allocating no weights and
starting no process group; the arithmetic is contract/memory.py's (torch-free)."""

from __future__ import annotations

import json
import re
import resource
import shlex
from pathlib import Path

import pytest

from contract.memory import StageLoad, in_flight, stage_memory, transformer_activation_bytes
from tests import REPO


def readme_commands() -> dict[str, list[str]]:
    """The guide's ten commands (A100 4-stage, A40 8-stage) exactly as docs/experiments/perseus.md's table gives them:
    "<model> <GPUs>" -> the arguments after `-m trainer`."""
    rows = re.findall(r"^\| (?:4 A100|8 A40) \| `([^`]+)` \|", (REPO / "docs" / "experiments" / "perseus.md").read_text(),
                      re.M)
    out = {}
    for cmd in rows:
        argv = shlex.split(cmd)
        nproc = int(argv[argv.index("--nproc-per-node") + 1]) * (int(argv[argv.index("--nnodes") + 1])
                                                                 if "--nnodes" in argv else 1)
        argv = argv[argv.index("-m") + 2:]
        out[f"{Path(argv[argv.index('--config') + 1]).stem.removeprefix('perseus-')} {nproc}"] = argv
    return out


# Beyond the guide: the largest T5 and GPT-3 on the same configs.
EXTRA = {
    "t5-11b 8": ["--config", "configs/perseus-t5-3b.yaml", "--model.preset", "t5-11b", "--pp", "8",
                 "--partition_method", "uniform_transformer"],
    "gpt3-175b 8 x zero3 dp2": ["--config", "configs/perseus-gpt3-2.7b.yaml", "--model.preset", "gpt3-175b",
                                "--dp", "2", "--parallel.sharding", "zero3"],
}

# units per stage the partition means (Merak's items read as blocks / layers / bottlenecks)
UNITS = {
    "bert-huge 4": [7, 6, 6, 5], "bloom-3b 4": [9, 8, 8, 5], "gpt3-xl 4": [6, 6, 7, 5], "t5-3b 4": [15, 13, 10, 10],
    "wide-resnet101_8 4": [7, 9, 9, 8], "bert-huge 8": [3] * 8, "bloom-3b 8": [5, 4, 4, 4, 4, 4, 4, 1],
    "gpt3-2.7b 8": [4] * 8, "t5-3b 8": [8, 7, 8, 5, 5, 5, 5, 5], "wide-resnet101_8 8": [4, 5, 4, 4, 4, 4, 5, 3],
    "t5-11b 8": [6] * 8, "gpt3-175b 8 x zero3 dp2": [12] * 8,
}


def test_every_paper_command_plans_on_the_meta_device(tmp_path, capsys, monkeypatch):
    """Each command exactly as the docs' table gives it, through the `trainer` entry point with
    --dry-run, in this process."""
    import torch.distributed as dist

    from trainer.cli import main
    from trainer.config.flags import ENV_KEYS
    from trainer.tools.dry_run import format_plan

    for var in ENV_KEYS:  # the command line and the config alone, as on a fresh node
        monkeypatch.delenv(var, raising=False)
    # a "corpus" the dry run must not read: parsing it would fail
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "bad.jsonl").write_text("{not json\n")
    out = tmp_path / "out"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    paper = readme_commands()
    assert sorted(paper) == sorted(set(UNITS) - set(EXTRA)), sorted(paper)  # all ten, once each
    plans = {}
    for name, argv in {**paper, **EXTRA}.items():
        argv = [str(REPO / a) if a.startswith("configs/") else a for a in argv]
        extra = ("--data.source", str(corpus)) if name == "bloom-3b 4" else ()
        assert main(["--dry-run", "--json", *argv, *extra, "--output-dir", str(out)]) == 0, name
        plans[name] = plan = json.loads(capsys.readouterr().out)
        assert plan["world"] == (16 if "175b" in name else int(name.split()[1])), name
        assert [s["pp_rank"] for s in plan["stages"]] == list(range(len(UNITS[name])))
        assert [s["units"][1] - s["units"][0] for s in plan["stages"]] == UNITS[name], name
        assert format_plan(plan).count("\n  memory per rank ") == len(plan["stages"])
    # 175B parameters were never allocated, no process group was started, nothing was written
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2 * 1024 * 1024  # KiB: < 2 GiB
    assert not dist.is_initialized()
    assert not out.exists()
    assert any("not read by a dry run" in n for n in plans["bloom-3b 4"]["notes"])

    t5 = plans["t5-3b 4"]
    assert t5["schedule"] == "1f1b"
    assert (t5["params"], t5["units"], t5["merak_items"], t5["world"]) == (2851598336, 48, 74, 4)
    assert [s["line"] for s in t5["stages"]][1] == \
        "stage 1 (pp rank 1): encoder 15-23 + decoder 0-3 (13 blocks, 754.35M params)"
    assert "read as item boundaries, i.e. blocks custom:0,15,28,38,48" in t5["partition_note"]
    # 1F1B: stage s holds pp - s microbatches; AdamW fp32 state = 16 bytes per parameter held
    for s in t5["stages"]:
        mem = s["memory"]
        assert mem["in_flight"] == 4 - s["stage"]
        assert mem["weights"] == 4 * s["params"] and mem["optimizer"] == 8 * s["params"]
        assert mem["activations"] == (s["activation_bytes_per_microbatch"] + 2 * s["boundary_bytes_per_microbatch"]
                                      ) * mem["in_flight"]
    # ZeRO-3 over dp 2 halves weights, gradients and optimizer state
    big = plans["gpt3-175b 8 x zero3 dp2"]
    assert big["world"] == 16 and big["mesh"]["dp_shard"] == 2
    s0 = big["stages"][0]
    assert s0["memory"]["weights"] == 2 * s0["params"] and s0["memory"]["optimizer"] == 4 * s0["params"]
    # images: 4-D activations, no LM loss scratch
    wrn = plans["wide-resnet101_8 4"]
    assert wrn["seq_len"] is None and wrn["stages"][-1]["memory"]["transient"] == 0
    assert wrn["stages"][0]["line"].startswith("stage 0 (pp rank 0): stem + bottlenecks 0-6 (7 bottlenecks")


def test_dry_run_one_line_errors(capsys):
    from trainer.cli import main

    argv = ["--dry-run", "--config", str(REPO / "configs/perseus-t5-3b.yaml"), "--pp", "8", "--partition_method",
            "custom:0,9,16,24,34,43,53,63,74"]
    # a boundary inside a decoder block: refused in one line naming the nearest legal boundaries
    assert main(argv) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.splitlines() == [
        "error: parallel.partition: custom:0,9,16,24,34,43,53,63,74: item 34 (decoder 4 FFN) cannot start a stage "
        "(it continues item 33, decoder 4 self attention + decoder 4 cross attention); the nearest legal "
        "boundaries are 33 or 35"]
    # an unknown model: the close names
    assert main(["--dry-run", "--model.preset", "wide_resnet101_8", "--train.steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: model.preset: unknown preset 'wide_resnet101_8' (did you mean wide-resnet101_8, wide-resnet101_4, " \
        "wide-resnet101_2, wide-resnet50_8?)"


def test_memory_arithmetic():
    load = StageLoad(params=1_000_000, activation_bytes=3_000, boundary_bytes=100, transient_bytes=50,
                     largest_unit_params=10_000)
    m = stage_memory(load, in_flight=4, dtype="bf16")
    assert (m.weights, m.gradients, m.optimizer, m.activations, m.transient) == (4e6, 4e6, 8e6, 4 * 3200, 50)
    assert m.total == 16_000_000 + 12_800 + 50
    z3 = stage_memory(load, in_flight=1, dtype="bf16", sharding="zero3", dp=4)
    assert (z3.weights, z3.gradients, z3.optimizer, z3.transient) == (1e6, 1e6, 2e6, 50 + 2 * 10_000 * 2)
    z2 = stage_memory(load, in_flight=1, sharding="zero2", dp=4)
    assert (z2.weights, z2.gradients, z2.optimizer) == (4e6, 1e6, 2e6)
    assert stage_memory(load, in_flight=1, tp=2).weights == 2e6
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8] * 4
    assert in_flight("1f1b", 0, 4, 2) == 2 and in_flight("none", 0, 1, 32) == 1
    with pytest.raises(ValueError):
        stage_memory(load, in_flight=1, dtype="int8")


def test_activation_formula_matches_the_meta_measurement():
    """What the runner computes without torch agrees with what the dry run measures (SDPA, no scores)."""
    from trainer.config import resolve
    from trainer.tools.dry_run import make_plan

    cfg = resolve(None, [("model.preset", "smollm-360m"), ("train.steps", 1), ("train.batch_size", 2),
                         ("data.seq_len", 512), ("train.dtype", "bf16")], environ={})
    measured = make_plan(cfg)["stages"][0]["activation_bytes_per_microbatch"]
    formula = transformer_activation_bytes(2 * 512, 960, 2560, 32, "bf16", gated=True)
    assert 0.8 < measured / formula < 1.25, (measured, formula)
