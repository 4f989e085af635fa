"""The trainer's command line, config files and launcher env, fuzzed (hypothesis): each input is
either accepted or refused with the trainer's one-line error type (ConfigError: one line by
construction), within bounded time and memory, and never ends in any other exception.

Each example goes in-process through what `trainer` does before it starts anything: argv parsed
(trainer/config/argv.py), resolved and validated (trainer/config/resolve.py, env fallbacks from
a fake env), the launcher's env read (trainer/runtime/dist_env.py), the layout checked against
that world (ParallelDims, compose.check_supported), and `--dry-run`'s plan (trainer/tools/dry_run.py:
the model on the meta device, one microbatch through its stages). No process group, no training,
nothing written but the example's own config file.

Inputs: structured (known flags and config keys with hostile values: huge, negative, zero, nan, inf,
unicode, control characters, format placeholders, long strings, YAML of the wrong type, keys one
typo away from real ones), mutated (tokens of valid command lines dropped, duplicated, swapped,
spliced, replaced), hostile config files (deep nesting, aliases, over a MiB, UTF-16 and Latin-1,
random bytes, sections of the wrong type) and hostile launcher env (a RANK not below WORLD_SIZE,
negative, non-numeric, huge).

Profiles and bounds are tests/support/fuzz_support.py's (shared with the runner's fuzzer): `ci` (the
default) a fixed, derandomized set of examples, this file well under a minute; `long` new examples
each round of `scripts/fuzz.sh MINUTES`, which records the examples tried per target (and how many
were accepted: how deep they reach) in bench/results/fuzz.json. Each example runs under its hang
guard and memory bound (Python's allocations), and here also under an address-space limit
(RLIMIT_AS: what torch or a tokenizer allocates outside Python).
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzz_support import COUNTS, LONG_EXAMPLES, PROFILE, bounded, examples
from trainer.config import ConfigError, config_keys
from trainer.config.argv import OWN_OPTIONS, parse_train_args
from trainer.config.flags import FLAGS

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_BYTES = 4 << 30                 # address space one example may add (RLIMIT_AS)
TARGETS = {"cmdline": "trainer argv (structured)", "plausible": "trainer argv (plausible layouts)",
           "mutated": "trainer argv (mutated)", "yaml": "trainer config file", "env": "trainer launcher env"}


def _examples(ci: int, long_share: int = 1):
    """tests/support/fuzz_support.py's settings; a target whose examples reach the model build and the meta
    forward (seconds, not milliseconds) takes 1/long_share of a long round's examples."""
    from hypothesis import settings

    return examples(ci) if PROFILE != "long" else settings(max_examples=max(LONG_EXAMPLES // long_share, 1))


# ---------------------------------------------------------------- the harness

def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) << 10
    return 0


@contextlib.contextmanager
def _address_space():
    """At most EXAMPLE_BYTES more address space: an allocation past it (by torch, a tokenizer, any
    C code tracemalloc does not see) is a MemoryError, which fails the example."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = _vm_bytes() + EXAMPLE_BYTES
    if hard == resource.RLIM_INFINITY or want < hard:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _start(argv: list[str], environ: dict[str, str]) -> str:
    """What `trainer` does with argv and env before anything runs; "accepted" or raises."""
    from trainer.config import resolve
    from trainer.parallel.compose import check_supported
    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import from_environ
    from trainer.tools.dry_run import FLAGS as DRY
    from trainer.tools.dry_run import format_plan, make_plan

    config, overrides = parse_train_args([a for a in argv if a not in DRY])
    cfg = resolve(config, overrides, environ=environ)
    env = from_environ(environ)
    ParallelDims.from_config(cfg.parallel, env.world_size, env.local_world_size)
    check_supported(cfg)
    # --dry-run sizes the launch its own degrees name (world = pp x dp x tp), whatever the env says.
    plan = make_plan(resolve(config, overrides, environ=environ))
    json.dumps(plan)
    format_plan(plan)
    return "accepted"


def check(kind: str, argv: list[str], environ: dict[str, str] | None = None) -> None:
    """The property: accepted, or one ConfigError line; anything else fails the example."""
    import warnings

    accepted = False
    with bounded(TARGETS[kind]), _address_space(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            accepted = _start(argv, environ or {}) == "accepted"
        except ConfigError as e:
            message = str(e)
            assert message and "\n" not in message and "\r" not in message, repr(message[:300])
    COUNTS[f"{TARGETS[kind]}: accepted"] += accepted


# ---------------------------------------------------------------- values

SMALL = ("tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-bert", "tiny-t5", "tiny-bloom", "tiny-vitmae",
         "tiny-wide-resnet")
NUMBERS = ("0", "-1", "1", "2", "3", "4", "8", "16", "1024", "65536", "2147483648", "9223372036854775808",
           "1e30", "-1e30", "1.5", "1e-300", "nan", ".nan", "inf", "-inf", ".inf", "0x10", "1_000", "+3", "٣",
           "9" * 400, "9" * 5000)
TEXTS = ("", " ", "auto", "none", "null", "true", "synthetic", "{}", "{0}", "{step}", "{step.__class__}",
         "%s", "%(x)s", "%n", "{{", "}", "\n", "a\nb", "\r", "\x1b[31mred", "\x00", "\u2028", "é", "名前",
         "a" * 5000, "/", "/etc/passwd", "/proc/self/status", "../..", "~", ".", "-", "--", "step-{step}",
         "{step}/x", ".hidden-{step}")
YAMLISH = ("[1, 2]", "{a: 1}", "&a [*a]", "{hidden_size: 0}", "{num_attention_heads: 0}", "{vocab_size: -1}",
           "{hidden_size: 1.0e30}", "{num_hidden_layers: 2000}", "{rope_theta: .nan}", "{1: 2}", "{a: {b: {c: 1}}}",
           "[" * 200, "{" * 200, "!!python/object:os.system x", "? [a]\n: 1", "{hidden_size: 8, "
           "num_attention_heads: 3}", "{max_position_embeddings: 1}", "{intermediate_size: 1}", "'x' : 1 :")
TYPOS = ("--train.step", "--trian.steps", "--lr", "--train.steps.x", "--.", "--", "---x", "--train.", "--model",
         "--parallel.tpp", "--checkpoint.dir.x", "--profile_batchx", "--train_step", "-x", "--Train.Steps")


def values() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(NUMBERS), st.sampled_from(TEXTS), st.sampled_from(YAMLISH),
                     st.sampled_from(SMALL), st.text(max_size=20),
                     st.integers(min_value=-(1 << 70), max_value=1 << 70).map(str),
                     st.floats(allow_nan=True, allow_infinity=True).map(repr))


def flags() -> st.SearchStrategy[str]:
    keys = [f"--{k}" for k in config_keys()]
    return st.one_of(st.sampled_from(keys), st.sampled_from(sorted(FLAGS)), st.sampled_from(OWN_OPTIONS),
                     st.sampled_from(TYPOS))


def _ints(lo: int, hi: int) -> st.SearchStrategy[str]:
    return st.integers(lo, hi).map(str)


# Values a user would plausibly give (mostly within bounds): they get past validation into the model
# build, the layout and the meta-device forward, where the combinations are.
PLAUSIBLE: dict[str, st.SearchStrategy[str]] = {
    "--parallel.pp": _ints(1, 4), "--parallel.tp": _ints(1, 4), "--parallel.dp": _ints(1, 4),
    "--parallel.virtual_stages": _ints(1, 3), "--parallel.dp_shard": _ints(1, 4),
    "--parallel.sharding": st.sampled_from(("ddp", "zero0", "zero2", "zero3", "zero2_hybrid", "zero3_hybrid")),
    "--parallel.pp_schedule": st.sampled_from(("gpipe", "1f1b", "interleaved1f1b", "interleaved_zb", "zbv",
                                               "dualpipev", "afab")),
    "--parallel.partition": st.sampled_from(("uniform", "uniform_transformer", "parameters", "custom:0,1",
                                             "custom:0,1,2", "weighted:1,2", "weighted:1,1,1", "auto")),
    "--parallel.sequence_parallel": st.sampled_from(("true", "false")),
    "--train.batch_size": _ints(1, 16), "--train.microbatch_num": _ints(1, 8), "--train.grad_acc_steps": _ints(1, 3),
    "--train.loss_chunks": st.one_of(st.just("auto"), _ints(1, 64)),
    "--train.activation_checkpointing": st.sampled_from(("none", "selective", "full")),
    "--train.dtype": st.sampled_from(("auto", "fp32", "bf16")), "--data.seq_len": _ints(1, 256),
    "--model.preset": st.sampled_from(SMALL), "--model.num_hidden_layers": _ints(1, 6),
    "--model.hidden_size": _ints(1, 96), "--model.num_attention_heads": _ints(1, 8),
    "--model.intermediate_size": _ints(1, 200), "--model.vocab_size": _ints(2, 600),
    "--model.attn_implementation": st.sampled_from(("sdpa", "eager")),
    "--model.hf_overrides": st.dictionaries(
        st.sampled_from(("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                         "intermediate_size", "max_position_embeddings", "vocab_size", "d_model", "num_heads",
                         "d_kv", "n_embd", "n_head", "n_layer", "image_size", "patch_size", "num_channels",
                         "decoder_hidden_size", "decoder_num_attention_heads", "num_classes")),
        st.integers(1, 64), max_size=3).map(lambda d: "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"),
}


@st.composite
def plausible(draw) -> list[str]:
    argv = ["--data.source", "synthetic", "--train_steps", "2"]
    for key in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), min_size=1, max_size=6, unique=True)):
        argv += [key, draw(PLAUSIBLE[key])]
    return argv


# A small model, synthetic data: the command lines the mutations start from (every one accepted).
VALID = [
    ["--data.source", "synthetic", "--train_steps", "2"],
    ["configs/tiny.yaml", "--train.steps", "2", "--checkpoint.enabled", "true"],
    ["--config", "configs/tiny.yaml", "--pp", "2", "--parallel.pp_schedule", "gpipe"],
    ["--data.source", "synthetic", "--train_steps", "3", "--model.preset", "tiny-gpt2", "--tp", "2",
     "--train.batch_size", "8", "--microbatch_num", "2"],
    ["--data.source", "synthetic", "--max-steps", "1", "--model_name", "tiny-qwen3", "--seq_len", "64",
     "--parallel.sharding", "zero3", "--dp", "2", "--profile_batch", "0,1"],
    ["--data.source", "synthetic", "--train_steps", "1", "--model.preset", "tiny-t5",
     "--model.hf_overrides", "{d_model: 32, num_heads: 2, d_kv: 16}"],
    ["--data.source", "synthetic", "--train_steps", "2", "--model.preset", "tiny-vitmae", "--json", "--dry-run"],
]


@st.composite
def structured(draw) -> list[str]:
    argv = [] if draw(st.booleans()) and draw(st.booleans()) else list(VALID[0])
    for _ in range(draw(st.integers(0, 4))):
        flag, value = draw(flags()), draw(values())
        form = draw(st.sampled_from(("pair", "eq", "bare")))
        argv += [flag, value] if form == "pair" else [f"{flag}={value}"] if form == "eq" else [flag]
    return argv


@st.composite
def mutated(draw) -> list[str]:
    argv = list(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 4))):  # 0: the valid line itself, what the others are measured from
        op = draw(st.sampled_from(("drop", "dup", "swap", "splice", "replace", "insert")))
        i = draw(st.integers(0, max(len(argv) - 1, 0)))
        if op == "drop" and argv:
            del argv[i]
        elif op == "dup" and argv:
            argv.insert(i, argv[i])
        elif op == "swap" and len(argv) > 1:
            j = draw(st.integers(0, len(argv) - 1))
            argv[i], argv[j] = argv[j], argv[i]
        elif op == "splice":
            other = draw(st.sampled_from(VALID))
            k = draw(st.integers(0, len(other)))
            argv = argv[:i] + other[k:]
        elif op == "replace" and argv:
            argv[i] = draw(values())
        else:
            argv.insert(i, draw(st.one_of(flags(), values())))
    return argv


# ---------------------------------------------------------------- config files

def _nested(depth: int, flow: bool) -> str:
    return "[" * depth + "]" * depth if flow else "".join(f"{'  ' * i}k{i}:\n" for i in range(depth)) + "  " * depth + "1"


@st.composite
def config_bytes(draw) -> bytes:
    valid = "model:\n  preset: tiny-llama\ndata:\n  source: synthetic\n  seq_len: 32\ntrain:\n  steps: 2\n"
    kind = draw(st.sampled_from(("nested", "flow", "alias", "huge", "utf16", "latin1", "bytes", "sections",
                                 "values", "stub", "bom")))
    if kind == "nested":
        return _nested(draw(st.integers(1, 60)), False).encode()
    if kind == "flow":
        return ("x: " + _nested(draw(st.integers(1, 3000)), True)).encode()
    if kind == "alias":
        n = draw(st.integers(1, 9))
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]"
                                                        for i in range(1, n)]
        return ("\n".join(lines) + "\n").encode()
    if kind == "huge":
        return valid.encode() + b"# " + b"x" * ((1 << 20) + draw(st.integers(0, 10))) + b"\n"
    if kind == "utf16":
        return (valid + "output_dir: caf\u00e9\n").encode("utf-16")
    if kind == "latin1":
        return (valid + "output_dir: caf\u00e9\n").encode("latin-1")
    if kind == "bom":
        return b"\xef\xbb\xbf" + valid.encode()
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "sections":
        section = draw(st.sampled_from(("model", "train", "data", "parallel", "checkpoint", "dist", "x", "1", "~")))
        return valid.encode() + f"{section}: {draw(st.sampled_from(YAMLISH + NUMBERS[:8]))}\n".encode()
    if kind == "stub":  # the FSDP stub's keys with hostile values
        key = draw(st.sampled_from(("dist.sharding_stage", "dataset.batch_size", "lr_scheduler.total_iterations",
                                    "checkpoint.directory", "model.hf_config", "dist.cpu_only")))
        a, b = key.split(".")
        return valid.encode() + f"{a}:\n  {b}: {json.dumps(draw(values()))}\n".encode()
    key = draw(st.sampled_from(config_keys()))
    section, _, name = key.rpartition(".")
    value = json.dumps(draw(values()))
    body = f"{section}:\n  {name}: {value}\n" if section else f"{name}: {value}\n"
    return (valid + body).encode()


# ---------------------------------------------------------------- launcher env

ENV_NUMBERS = ("0", "1", "2", "3", "4", "-1", "7", "x", "", " 2", "2(x3)", "4,2", "1e3", "99999999999999999999",
               "٣", "9" * 5000)


@st.composite
def launcher_env(draw) -> dict[str, str]:
    launcher = draw(st.sampled_from(("torchrun", "slurm", "mpi", "none")))
    names = {"torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
             "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
             "mpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                     "OMPI_COMM_WORLD_LOCAL_SIZE")}.get(launcher, ())
    env = {n: draw(st.sampled_from(ENV_NUMBERS)) for n in names if draw(st.integers(0, 4))}
    if names and draw(st.booleans()):
        env[names[0]] = env.get(names[0]) or "0"
    for var in ("MASTER_ADDR", "MASTER_PORT", "BATCH_SIZE", "MICROBATCH_NUM", "PROFILE_BATCH", "OUTPUT_DIR",
                "PERSEUS_URL"):
        if draw(st.integers(0, 3)) == 0:
            env[var] = draw(st.one_of(st.sampled_from(ENV_NUMBERS), st.sampled_from(TEXTS)))
    return {k: v.replace("\0", "") for k, v in env.items()}  # an env value cannot hold NUL


# ---------------------------------------------------------------- the properties

@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Every import and lazily loaded model class first, outside the examples' bounds: they measure
    what an input costs, not what Python, torch and transformers cost to load once."""
    import os
    import warnings

    from trainer.config import resolve
    from trainer.tools.dry_run import make_plan

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for preset in SMALL:
                make_plan(resolve(None, [*parse_train_args([*VALID[0], "--model.preset", preset])[1]], environ={}))
            make_plan(resolve(None, parse_train_args([*VALID[0], "--pp", "2"])[1], environ={}))
    finally:
        os.chdir(cwd)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the command lines name configs/... as users run them from a checkout


@_examples(ci=60)
@given(structured())
def test_command_lines_of_known_flags_with_hostile_values(argv):
    check("cmdline", argv)


@_examples(ci=50, long_share=4)
@given(plausible())
def test_command_lines_of_plausible_layouts_and_models(argv):
    check("plausible", argv)


@_examples(ci=40)
@given(mutated())
def test_mutated_valid_command_lines(argv):
    check("mutated", argv)


@_examples(ci=30)
@given(config_bytes(), st.sampled_from(("--config", "positional")))
def test_hostile_config_files(tmp_path_factory, data, form):
    f = tmp_path_factory.getbasetemp() / "fuzz-config.yaml"
    f.write_bytes(data)
    check("yaml", ["--config", str(f)] if form == "--config" else [str(f)])


@_examples(ci=40)
@given(launcher_env(), st.sampled_from(VALID[:3]))
def test_hostile_launcher_env(environ, argv):
    check("env", list(argv), environ)


def test_the_harness_fails_on_anything_but_a_one_line_refusal(monkeypatch):
    """The property can fail: another exception, a message of two lines, an example past its time."""
    resolve_mod = sys.modules["trainer.config.resolve"]

    def boom(*_a, **_k):
        raise ZeroDivisionError("x")

    monkeypatch.setattr(resolve_mod, "validate", boom)
    with pytest.raises(ZeroDivisionError):
        check("cmdline", list(VALID[0]))
    two = ConfigError("x")
    two.args = ("a\nb",)
    monkeypatch.setattr(resolve_mod, "validate", lambda cfg: (_ for _ in ()).throw(two))
    with pytest.raises(AssertionError):
        check("cmdline", list(VALID[0]))
    import time

    from tests.support import fuzz_support

    monkeypatch.setattr(fuzz_support, "HANG_S", 1)
    monkeypatch.setattr(resolve_mod, "validate", lambda cfg: time.sleep(5))
    with pytest.raises(fuzz_support.Hang):
        check("cmdline", list(VALID[0]))


def test_the_examples_were_both_accepted_and_refused():
    """A fuzzer whose every input is refused at the first flag tests nothing past it."""
    ran = {t: (COUNTS[t], COUNTS[f"{t}: accepted"]) for t in TARGETS.values() if COUNTS[t]}
    if not ran:
        pytest.skip("no property ran in this session")
    print(json.dumps(ran))
    for target, (tried, accepted) in ran.items():
        assert 1 <= accepted < tried, (target, tried, accepted)
