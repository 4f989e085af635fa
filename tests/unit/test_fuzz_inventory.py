"""A fuzzer for what the runner reads (issue 54): inventories, `--job` files, Slurm inventories and
the job configs they name, generated two ways, each example read through the loader and through
`runner up --dry-run` (no network: the `no_network` fixture), and required to end either accepted
or refused with one UserError line, never another exception, within the bounds of
tests/support/fuzz_support.py (a hang guard, a memory bound), writing nothing.

- structured: YAML trees shaped like an inventory (every field the runner knows, and some it does
  not) holding hostile values: huge, negative and zero numbers, nan and inf, unicode and control
  characters, format placeholders, paths with `..`, `//` and protected places, long strings, deep
  nesting, wrong types; written by PyYAML (which writes an anchor and an alias for a value used
  twice) or with raw YAML put in (aliases, merge keys, tags, deep flows);
- mutated: the bytes of valid inventories and job files flipped, cut, duplicated and spliced.

CI runs a fixed, derandomized number of examples (HYPOTHESIS_PROFILE=ci, the default);
`scripts/fuzz.sh MINUTES` runs new ones until the time is spent and records the counts in
bench/results/fuzz.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from runner.core.errors import UserError
from runner.inventory import load_inventory
from runner.inventory.slurm import load_slurm_inventory
from runner.planning.sizing import check_sizing
from tests import REPO
from tests.support.fuzz_support import COUNTS, bounded, examples
from tests.support.runner_helpers import run_cli

# --- values ---------------------------------------------------------------------------------------

PLACEHOLDERS = ["{}", "{0}", "{x}", "{__class__}", "%s", "%d", "%(x)s", "%n", "$HOME", "${X}", "`id`", "$(id)"]
PATHS = ["/", "/proc/1/root", "/sys/kernel", "/dev/sda", "/run/user/1000", "/etc/ssh", "/etc/shadow", "~/.ssh",
         "/home/u/.ssh", "/var/lib/docker", "/var/run/docker.sock", "/srv/containerd.sock", "../../etc",
         "/data/../out", "//out", "/out", "/out/x", "/run/runner", "/data/", "~", "~root", "/data:rw", "/d,x",
         "relative/path", "/data\n", "/tmp/a b", "/x" * 300, "C:\\data", "/data\x00", "/\u202edata"]
NUMBERS = [0, -1, 1, 2, 7, 1023, 1024, 1025, 65535, 65536, 2**31, 2**63, -2**63, 2**64, 10**30, 10**400, 0.0, -0.5,
           0.01, 1e308, float("inf"), float("-inf"), float("nan"), True, False, None]
WORDS = ["auto", "master", "worker", "amd64", "arm64", "x86_64", "relay", "direct", "none", "pyxis", "oci",
         "PointSolution", "PlanSequence", "all", "4g", "512m", "6m", "1t", "99999999999999999999g", "64G",
         "04:00:00", "2-00:00:00", "1:99:99", "UNLIMITED", "t:1", "runner-trainer:latest", "localhost",
         "10.9.0.1", "127.1", "0x7f.1", "::1", "fe80::1%eth0", "fe80::1%$(reboot)", "gpu-0", "SHA256:" + "A" * 43,
         "https://hooks.example.com/x", "http://127.0.0.1:2375/containers/create", "https://169.254.169.254/",
         "https://localhost/x", "echo pwned", "--constraint=a100", "--output=/home/%u/.bashrc",
         "--export=ALL,PATH=/tmp", "--out=/tmp/x", "--exclusive", "--gres=gpu:2", "--mail-type=END",
         "--tp", "--pp", "--hidden-size", "--seq_len", "--batch_size", "--model.vocab_size", "0", "-3",
         "9" * 40, "1e9", "nan"]

scalars = st.one_of(
    st.sampled_from(NUMBERS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WORDS + PLACEHOLDERS + PATHS),
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x3000), max_size=20),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "[", "{", "9", "é", "\x1b", "%s", "../"]),
              st.integers(min_value=1, max_value=20000)),
)


def trees(depth: int = 3):
    """Values of any YAML shape: scalars, lists and mappings nested up to `depth` levels."""
    if depth <= 0:
        return scalars
    inner = trees(depth - 1)
    keys = st.one_of(st.sampled_from(WORDS + PLACEHOLDERS), st.text(max_size=12))
    return st.one_of(scalars, st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4))


def deep(n: int) -> object:
    out: object = "x"
    for i in range(n):
        out = [out] if i % 2 else {"k": out}
    return out


anything = st.one_of(scalars, trees(2), st.integers(min_value=30, max_value=200).map(deep))


FP = "SHA256:" + "A" * 42 + "Q"
ARGS = ["--pp", "2", "--tp", "1", "--batch_size", "8", "--seq_len", "64", "--model.num_hidden_layers", "4",
        "--parallel.virtual_stages", "2", "--train.microbatch_num", "4", "--hidden-size", "64", "--num-layers", "2"]
# values each field takes: most examples are valid but for a field or two, so the checks behind the
# first are reached (sizing, the plan) and not only the first refusal
GOOD = {
    "port": [22, 2222], "user": ["ubuntu", "pi"], "addr": ["10.8.0.9", "fe80::1%eth0"], "role": ["worker", "master"], "arch": ["amd64", "arm64", "x86_64"], "slots": [1, 2, 4],
    "workdir": ["~/runner", "/srv/runner"], "gpus": [0, 1, "all"], "env": [{"A": "1"}, {"OMP_NUM_THREADS": 2}],
    "cpus": [0.5, 2], "memory": ["4g", "512m", "64g"], "compress": [True, False, "auto"], "host_key": [FP],
    "identity_file": ["~/.ssh/id_ed25519"], "known_hosts": ["~/.ssh/known_hosts"],
    "image": ["t:1", {"amd64": "t:1", "arm64": "t:2"}], "config": ["cfg.yaml"], "env_file": ["job.env"],
    "master_port": ["auto", 29500], "nproc_per_node": [1, 2], "grace_period": [5, 0.5],
    "command": [["python", "-c", "pass"]], "sync": [[{"src": "data", "dst": "/d"}]],
    "mounts": [{"/nfs/ds": "/ds"}, {"~/hf": "/hf:rw"}], "registry": ["reg.lan:5000"], "push": ["relay", "direct"],
    "perseus": [{"plan": "plan.py"}, {"plan": "plan.py", "port": "auto"}], "notify": ["https://hooks.example.com/x"],
    "elastic": [True, {"min_nodes": 1, "rejoin": False}], "partition": ["gpu"], "nodes": [1, 2],
    "gpus_per_node": [0, 8], "cpus_per_task": [4], "mem": ["64G", "16000"], "account": ["proj-1"], "qos": ["high"],
    "time": ["01:00:00", "2-00:00:00", 90], "container": ["none", "pyxis", "oci"], "venv": ["~/venv"],
    "sbatch": [["--constraint=a100", "--exclusive"], ["--gres=gpu:a100:2"]],
}
HOSTILE = {
    "args": st.lists(st.sampled_from(ARGS + WORDS[50:] + PLACEHOLDERS + ["--parallel.tp=0", "--train.batch_size=-1",
                                                                           "--model.vocab_size=" + "9" * 50]),
                     max_size=8),
    "mounts": st.dictionaries(st.sampled_from(PATHS), st.sampled_from(["/data", "/data:rw", "/out", "/proc/x",
                                                                       "//data", "/d:xx"]), max_size=3),
    "sbatch": st.lists(st.sampled_from([w for w in WORDS if w.startswith("--")]), max_size=4),
}


def rarely(usual, rare):
    """`rare` about one time in twenty, else `usual` (7 of 0..19: hypothesis favours the ends of a
    range, so the rare branch is a value from its middle)."""
    return st.integers(min_value=0, max_value=19).flatmap(lambda r: rare if r == 7 else usual)


def field_values(name: str):
    """A value for a known field: mostly one it takes (or a plausible mistake), sometimes anything."""
    good = st.sampled_from(GOOD[name]) if name in GOOD else None
    if name == "args":
        good = st.lists(st.sampled_from(ARGS), max_size=8)
    hostile = st.one_of(HOSTILE[name], anything) if name in HOSTILE else anything
    return hostile if good is None else rarely(good, hostile)


def mapping_of(fields: list[str], required: dict | None = None):
    """A mapping holding `required` and some of `fields`, rarely an unknown key too."""
    required = required or {}
    known = st.fixed_dictionaries(required, optional={f: field_values(f) for f in fields if f not in required})
    unknown = rarely(st.just({}), st.dictionaries(st.text(max_size=8), anything, min_size=1, max_size=1))
    return st.tuples(known, unknown).map(lambda t: {**t[0], **t[1]})


NODE = ["port", "user", "identity_file", "known_hosts", "host_key", "arch", "slots", "workdir", "gpus", "env",
        "cpus", "memory", "compress", "addr", "role"]
JOB = ["image", "config", "args", "env", "env_file", "master_port", "nproc_per_node", "grace_period", "command",
       "sync", "mounts", "unsafe_mounts", "registry", "push", "perseus", "notify", "elastic"]
SLURM = ["partition", "gpus_per_node", "cpus_per_task", "mem", "account", "qos", "time", "container", "image",
         "arch", "workdir", "venv", "chdir", "bundle_dir", "sbatch"]


@st.composite
def nodes(draw) -> list:
    n = draw(st.integers(min_value=1, max_value=3))
    out = [draw(mapping_of(NODE, {"name": st.just(f"n{i}"), "host": st.just(f"10.9.0.{i + 1}")})) for i in range(n)]
    for node in out:
        if "role" in node and draw(st.integers(min_value=0, max_value=3)):
            node.pop("role")  # one master at most, most of the time
    return out


DEFAULTS = [f for f in NODE if f not in ("addr", "role", "host_key")]
jobs = mapping_of(JOB, {"image": st.just("t:1")})
inventories = st.fixed_dictionaries({"nodes": rarely(nodes(), anything)},
                                    optional={"defaults": mapping_of(DEFAULTS), "job": jobs})
slurm_inventories = st.fixed_dictionaries({"slurm": mapping_of(SLURM, {"nodes": field_values("nodes")})},
                                          optional={"job": jobs})

# raw YAML put into a generated document: what PyYAML would not write
RAW = ["a: &a [x, x]\nb: *a\n", "<<: {x: 1}\n", "n: !!python/object:os.system x\n", "n: !!binary aGk=\n",
       "n: " + "[" * 60 + "]" * 60 + "\n", "n: 2001-13-45\n", "n: 0o777777777777777777777777777\n",
       "n: " + "9" * 5000 + "\n", "? [a, b]\n: c\n", "n: \"\\uD800\"\n", "%YAML 1.1\n---\nn: 1\n", "--- a\n--- b\n",
       "n: |\n  " + "x" * 5000 + "\n", "\t- a\n", "n: 'x\x07\x1b[2J'\n"]


class _Plain(yaml.SafeDumper):
    """Writes a value used twice twice (PyYAML would write an anchor and an alias: RAW has those)."""

    def ignore_aliases(self, data) -> bool:
        return True


def render(doc: object, raw: str | None) -> str:
    text = yaml.dump(doc, Dumper=_Plain, allow_unicode=True, sort_keys=False, width=1 << 16)
    return text + raw if raw else text


# --- mutated examples -----------------------------------------------------------------------------

SEEDS = [(REPO / "hosts" / name).read_bytes() for name in ("local.yaml", "pis.yaml", "ec2.yaml", "slurm.yaml")
         if (REPO / "hosts" / name).exists()] + [
    b"nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64, slots: 2, memory: 4g}\n  - {name: b, host: 10.9.0.2}\n"
    b"job:\n  image: t:1\n  args: [--pp, '2', --batch_size, '8']\n  mounts: {/data: '/d:rw'}\n"
    b"  notify: https://hooks.example.com/x\n  master_port: 29500\n  grace_period: 5\n",
    b"slurm:\n  nodes: 2\n  mem: 64G\n  time: '01:00:00'\n  sbatch: [--constraint=a100, --exclusive]\njob:\n"
    b"  image: t:1\n",
]


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        if not data:
            break
        at = draw(st.integers(min_value=0, max_value=len(data) - 1))
        op = draw(st.sampled_from(["flip", "set", "cut", "dup", "truncate", "splice", "insert"]))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif op == "set":
            data[at] = draw(st.sampled_from(b"\x00\n\t :[]{}&*!|>'\"%#-\xff\xc3"))
        elif op == "cut":
            del data[at:at + draw(st.integers(min_value=1, max_value=40))]
        elif op == "dup":
            data[at:at] = data[at:at + draw(st.integers(min_value=1, max_value=200))] * draw(
                st.integers(min_value=1, max_value=50))
        elif op == "truncate":
            del data[at:]
        elif op == "splice":
            other = draw(st.sampled_from(SEEDS))
            data[at:] = other[draw(st.integers(min_value=0, max_value=len(other) - 1)):]
        else:
            data[at:at] = draw(st.sampled_from(RAW)).encode()
    return bytes(data)


# --- the checks -----------------------------------------------------------------------------------

@pytest.fixture
def files(tmp_path: Path) -> Path:
    """Files the generated documents may name (a config, an env file, a data folder, a plan)."""
    (tmp_path / "cfg.yaml").write_text("parallel: {pp: 2}\ntrain: {batch_size: 8}\n")
    (tmp_path / "job.env").write_text("TOKEN=abcd\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "plan.py").write_text("[[('forward', 1410), ('backward', 1410)]]\n")
    return tmp_path


def _one_line(exc: UserError) -> None:
    msg = str(exc)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)


def _write(tmp: Path, name: str, data: bytes | str) -> Path:
    p = tmp / name
    p.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    return p


def _names(tmp: Path) -> set[str]:
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*")}


def _load(target: str, loader, *args, **kw) -> object | None:
    """Accepted (the value) or refused with one line (None); any other exception fails the example."""
    with bounded(target):
        try:
            out = loader(*args, **kw)
        except UserError as exc:
            _one_line(exc)
            return None
    COUNTS[f"{target}: accepted"] += 1  # how deep the examples reach, for bench/results/fuzz.json
    return out


def _substitute(text: str, files: Path) -> str:
    """Names of the fixture's files put in place of some strings, so deeper checks are reached."""
    return re.sub(r"\b(cfg\.yaml|job\.env|plan\.py|data)\b", lambda m: str(files / m[1]), text)


@examples(ci=300)
@given(doc=inventories, raw=rarely(st.none(), st.sampled_from(RAW)))
def test_structured_inventories_load_or_refuse_in_one_line(files, no_network, doc, raw):
    text = _substitute(render(doc, raw), files)
    inv = _load("inventory: structured", load_inventory, _write(files, "inv.yaml", text), check_files=False)
    if inv is not None:
        _load("sizing: structured", check_sizing, inv, show=False, ignore=True)


@examples(ci=600)
@given(data=mutated())
def test_mutated_inventories_load_or_refuse_in_one_line(files, no_network, data):
    p = _write(files, "inv.yaml", data)
    if data.lstrip().startswith(b"slurm:"):
        _load("slurm inventory: mutated", load_slurm_inventory, str(p), check_files=False)
    else:
        inv = _load("inventory: mutated", load_inventory, p, check_files=False)
        if inv is not None:
            _load("sizing: mutated", check_sizing, inv, show=False, ignore=True)


@examples(ci=200)
@given(job=jobs, raw=rarely(st.none(), st.sampled_from(RAW)), wrapped=st.booleans())
def test_structured_job_files_load_or_refuse_in_one_line(files, no_network, job, raw, wrapped):
    inv = _write(files, "inv.yaml", "nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64}\n")
    p = _write(files, "job.yaml", _substitute(render({"job": job} if wrapped else job, raw), files))
    _load("job file: structured", load_inventory, inv, job_path=str(p), check_files=False)


@examples(ci=200)
@given(doc=slurm_inventories, raw=rarely(st.none(), st.sampled_from(RAW)))
def test_structured_slurm_inventories_load_or_refuse_in_one_line(files, no_network, doc, raw):
    p = _write(files, "slurm.yaml", _substitute(render(doc, raw), files))
    _load("slurm inventory: structured", load_slurm_inventory, str(p), check_files=False)


SECTIONS = {"parallel": ["dp", "tp", "pp", "virtual_stages", "pp_schedule", "partition", "sharding", "device"],
            "train": ["batch_size", "microbatch_num", "grad_acc_steps", "dtype", "loss_chunks",
                      "activation_checkpointing"],
            "data": ["seq_len"], "checkpoint": ["replicas"], "dist": ["dtype", "sharding_stage", "cpu_only"],
            "model": ["preset", "path", "num_hidden_layers", "hidden_size", "num_attention_heads",
                      "intermediate_size", "vocab_size", "hf_overrides", "hf_config", "attn_implementation"]}
CONFIG_VALUES = st.one_of(st.sampled_from([1, 2, 4, 8, 64, "auto", "1f1b", "gpipe", "zero3", "custom:0,2,4",
                                           "uniform", "tiny-llama", "/d/model", {"num_hidden_layers": 4}]),
                          st.sampled_from(NUMBERS), anything)
configs = st.fixed_dictionaries({}, optional={
    sec: st.fixed_dictionaries({}, optional={k: CONFIG_VALUES for k in keys}) for sec, keys in SECTIONS.items()})


@examples(ci=150)
@given(config=configs, args=st.lists(st.sampled_from(ARGS + ["--model_name", "/d/model", "--use_cpu", "0", "-1"]),
                                     max_size=6))
def test_job_configs_size_or_refuse_in_one_line(files, no_network, config, args):
    """The job.config (and job.args) the runner sizes a job from, with hostile numbers and shapes."""
    _write(files, "cfg.yaml", render(config, None))
    inv = _write(files, "inv.yaml", "nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64, slots: 2}\n"
                 f"job:\n  image: t:1\n  config: {files / 'cfg.yaml'}\n  sync: [{{src: {files / 'data'}, dst: /d}}]\n"
                 f"  args: {json.dumps(args)}\n")
    loaded = _load("job.config: structured", load_inventory, inv, check_files=False)
    if loaded is not None:
        _load("sizing: job.config", check_sizing, loaded, show=False, ignore=True)


@examples(ci=150)
@given(source=st.one_of(inventories.map(lambda d: render(d, None)), slurm_inventories.map(lambda d: render(d, None)),
                        mutated()))
def test_dry_run_plans_or_refuses_in_one_line_and_writes_nothing(files, no_network, capsys, source):
    """`runner up --dry-run` in this process (an SSH or a Slurm inventory): exit 0 with a plan, or
    exit 2 with one `runner: error:` line; nothing written next to the inventory; any other
    exception fails the example."""
    p = _write(files, "inv.yaml", _substitute(source, files) if isinstance(source, str) else source)
    before = _names(files)
    with bounded("runner up --dry-run"):
        rc, _ = run_cli("up", "-i", str(p), "--dry-run")
    err = capsys.readouterr().err
    assert rc in (0, 2), (rc, err[-2000:])
    COUNTS["runner up --dry-run: accepted"] += rc == 0
    errors = [ln for ln in err.splitlines() if ln.startswith("runner: error:")]
    assert rc == 0 or len(errors) == 1, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert _names(files) == before


def test_a_node_name_with_control_characters_is_named_on_one_line(files, no_network):
    """Found by the 39-minute fuzz run (bench/results/fuzz.json): a node named "p\\t- a\\n-2" put a raw
    newline into the "(node ...)" suffix of the refusal of its other fields."""
    p = _write(files, "inv.yaml", 'nodes:\n  - {name: "p\\t- a\\n-2", host: 10.9.0.1, arch: amd64, memory: lots}\n')
    with pytest.raises(UserError) as err:
        load_inventory(p, check_files=False)
    _one_line(err.value)
    assert "nodes[0].name" in str(err.value)
