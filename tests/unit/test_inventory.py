"""Inventory parsing: valid files load with defaults merged; every malformed one fails with ONE
line naming file, line and field, a non-zero exit, and nothing contacted."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from tests import REPO
from tests.support.runner_helpers import no_socket_env, shipped

GOOD = """\
defaults: {{user: pi, port: 22, identity_file: {key}, workdir: ~/runner}}
nodes:
  - {{name: pi-0, host: 192.168.1.10, arch: arm64, slots: 1, role: master}}
  - {{name: pi-1, host: 192.168.1.11}}
  - {{name: pi-2, host: 192.168.1.12, host_key: "SHA256:{fp}"}}
job:
  image: {{amd64: trainer:latest, arm64: trainer:arm64}}
  config: {cfg}
  args: [--train_steps, "5", --batch_size, 16]
  env: {{OMP_NUM_THREADS: 4}}
  env_file: {envf}
  master_port: auto
"""
FP = "A" * 43


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    key = tmp_path / "id_ed25519"
    key.write_text("not really a key\n")
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: tiny\n")
    envf = tmp_path / ".env"
    envf.write_text("# secrets\nHF_TOKEN=hf_secret_value\nexport OTHER='x y'\n")
    return {"key": str(key), "cfg": str(cfg), "envf": str(envf), "fp": FP, "dir": str(tmp_path)}


def write(tmp: str, text: str) -> Path:
    p = Path(tmp) / "inv.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_good_inventory_merges_defaults(files):
    inv = load_inventory(write(files["dir"], GOOD.format(**files)))
    assert [n.name for n in inv.nodes] == ["pi-0", "pi-1", "pi-2"]
    assert inv.master.name == "pi-0"
    assert all(n.user == "pi" and n.port == 22 and n.identity_file == files["key"] for n in inv.nodes)
    assert inv.nodes[1].arch is None and inv.nodes[1].slots == 1 and inv.nodes[1].role == "worker"
    assert inv.nodes[2].host_key == f"SHA256:{FP}"
    assert inv.job.image == {"amd64": "trainer:latest", "arm64": "trainer:arm64"}
    assert inv.job.args == ["--train_steps", "5", "--batch_size", "16"]
    assert inv.job.env == {"OMP_NUM_THREADS": "4"}
    assert inv.job.master_port == "auto"
    assert inv.job.secrets() == {"HF_TOKEN": "hf_secret_value", "OTHER": "x y"}
    assert inv.job.image_for("arm64") == "trainer:arm64"


def test_first_node_is_master_when_no_role(files):
    p = write(files["dir"], "nodes:\n  - {name: a, host: 127.0.0.1}\n  - {name: b, host: 127.0.0.2}\n")
    inv = load_inventory(p)
    assert inv.master.name == "a" and [n.name for n in inv.ordered()] == ["a", "b"]


def test_master_is_rank0_even_when_listed_last(files):
    p = write(files["dir"], "nodes:\n  - {name: a, host: 127.0.0.1}\n  - {name: b, host: 127.0.0.2, role: master}\n")
    assert [n.name for n in load_inventory(p).ordered()] == ["b", "a"]


def test_shipped_inventories_parse(tmp_path):
    pis = load_inventory(shipped("pis.yaml", tmp_path), check_files=False)
    assert [(n.name, n.host, n.arch, n.user) for n in pis.nodes] == [
        ("pi-0", "192.168.1.10", "arm64", "pi"), ("pi-1", "192.168.1.11", "arm64", "pi"),
        ("pi-2", "192.168.1.12", "arm64", "pi")]
    assert pis.master.name == "pi-0" and pis.job.image_for("arm64") == "runner-trainer:arm64"
    ec2 = load_inventory(shipped("ec2.yaml", tmp_path), check_files=False)
    assert ec2.master.name == "gpu-0" and all(n.slots == 4 and n.gpus == "all" for n in ec2.nodes)
    assert ec2.job.master_port == 29500


N = "nodes:\n  - {name: a, host: 127.0.0.1}\n"
# (inventory text, expected "line: field" fragment). Lines are 1-based.
MALFORMED = [
    ("missing_host", "nodes:\n  - {name: a}\n", ":2: nodes[0].host: missing"),
    ("missing_name", "nodes:\n  - {host: 127.0.0.1}\n", ":2: nodes[0].name: missing"),
    ("duplicate_names", "nodes:\n  - {name: a, host: 127.0.0.1}\n  - {name: a, host: 127.0.0.2}\n",
     ":3: nodes[1].name: duplicate node name 'a' (first at line 2)"),
    ("bad_port_str", "nodes:\n  - {name: a, host: 127.0.0.1, port: ssh}\n", ":2: nodes[0].port: must be an integer"),
    ("port_out_of_range", "nodes:\n  - name: a\n    host: 127.0.0.1\n    port: 70000\n", ":4: nodes[0].port"),
    ("unknown_arch", "nodes:\n  - {name: a, host: 127.0.0.1, arch: sparc}\n", ":2: nodes[0].arch: unknown arch 'sparc'"),
    ("missing_key_file", "defaults:\n  identity_file: /nonexistent/id_rsa\n" + N,
     ":2: defaults.identity_file: file not found: /nonexistent/id_rsa"),
    ("two_masters", "nodes:\n  - {name: a, host: 127.0.0.1, role: master}\n  - {name: b, host: 127.0.0.2, role: master}\n",
     ":3: nodes[1].role: two masters (a, b)"),
    ("slots_zero", "nodes:\n  - {name: a, host: 127.0.0.1, slots: 0}\n", ":2: nodes[0].slots: must be an integer in 1..1024, got 0"),
    ("yaml_syntax", "nodes:\n  - {name: a, host: 127.0.0.1\n  - {name: b}\n", "YAML syntax error"),
    ("unknown_field", "nodes:\n  - name: a\n    host: 127.0.0.1\n    hots: x\n", ":4: nodes[0].hots: unknown field (did you mean host?)"),
    ("unknown_top_field", N + "jobs: {}\n", ":3: jobs: unknown field"),
    ("nodes_not_list", "nodes: {name: a, host: 127.0.0.1}\n", ":1: nodes: must be a non-empty list"),
    ("empty_nodes", "nodes: []\n", ":1: nodes: must be a non-empty list"),
    ("no_nodes", "job: {image: x}\n", "nodes: missing"),
    ("empty_file", "", ":1: nodes: inventory is empty"),
    ("slots_wrong_type", "nodes:\n  - {name: a, host: 127.0.0.1, slots: [1]}\n", ":2: nodes[0].slots: must be an integer"),
    ("host_wrong_type", "nodes:\n  - {name: a, host: 12}\n", ":2: nodes[0].host: must be a non-empty string, got 12"),
    ("bad_host", "nodes:\n  - {name: a, host: 'no such host!'}\n", ":2: nodes[0].host: 'no such host!' is not"),
    ("bad_master_port", N + "job: {master_port: 80}\n", ":3: job.master_port: must be an integer in 1024..65535"),
    ("master_port_word", N + "job: {master_port: random}\n", ":3: job.master_port: must be 'auto' or an integer"),
    ("image_missing_for_arch", "nodes:\n  - {name: a, host: 127.0.0.1, arch: arm64}\njob:\n  image: {amd64: t:1}\n",
     ":4: job.image: no image for arch arm64 (node a)"),
    ("env_file_missing", N + "job:\n  env_file: /nonexistent/.env\n", ":4: job.env_file: env_file not found"),
    ("bad_host_key", "nodes:\n  - {name: a, host: 127.0.0.1, host_key: 'md5:aa:bb'}\n", ":2: nodes[0].host_key: must be an OpenSSH SHA256"),
    ("bad_role", "nodes:\n  - {name: a, host: 127.0.0.1, role: boss}\n", ":2: nodes[0].role: must be 'master' or 'worker'"),
    ("env_not_mapping", "nodes:\n  - {name: a, host: 127.0.0.1, env: [A=1]}\n", ":2: nodes[0].env: must be a mapping"),
    ("bad_env_name", N + "job:\n  env: {1BAD: x}\n", ":4: job.env.1BAD: not a valid environment variable name"),
    ("args_not_list", N + "job: {args: --steps 5}\n", ":3: job.args: must be a list of strings"),
    ("config_missing", N + "job: {config: /nonexistent/cfg.yaml}\n", ":3: job.config: config file not found"),
    ("same_address_twice", "nodes:\n  - {name: a, host: 127.0.0.1}\n  - {name: b, host: 127.0.0.1}\n",
     ":3: nodes[1].host: 127.0.0.1:22 is also node 'a'"),
    ("bad_node_name", "nodes:\n  - {name: 'a b', host: 127.0.0.1}\n", ":2: nodes[0].name: 'a b': use letters"),
    ("grace_negative", N + "job: {grace_period: -1}\n", ":3: job.grace_period: must be seconds"),
    ("push_mode", N + "job: {push: torrent}\n", ":3: job.push: must be relay or direct, got 'torrent'"),
    ("nproc_zero", N + "job: {nproc_per_node: 0}\n", ":3: job.nproc_per_node: must be an integer in 1..1024"),
    ("defaults_not_mapping", "defaults: [1]\n" + N, ":1: defaults: must be a mapping"),
    ("name_in_defaults", "defaults: {name: x}\n" + N, ":1: defaults.name: unknown field"),
    # YAML keys are unique; PyYAML would silently keep the last one.
    ("duplicate_node_field", "nodes:\n  - name: a\n    host: 127.0.0.1\n    port: 22\n    port: 2222\n",
     ":5: nodes[0].port: duplicate key (first at line 4)"),
    ("duplicate_top_key", N + "job: {image: x}\njob: {image: y}\n", ":4: job: duplicate key (first at line 3)"),
    ("duplicate_env_key", N + "job:\n  env: {A: 1, B: 2, A: 3}\n", ":4: job.env.A: duplicate key (first at line 4)"),
    ("duplicate_in_defaults", "defaults:\n  user: pi\n  user: root\n" + N, ":3: defaults.user: duplicate key (first at line 2)"),
]


@pytest.mark.parametrize("name,text,expected", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_inventory_one_line(tmp_path, name, text, expected):
    p = tmp_path / "inv.yaml"
    p.write_text(text)
    with pytest.raises(UserError) as ei:
        load_inventory(p)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(str(p)), msg
    assert expected in msg, msg


def test_env_file_bad_line_does_not_echo_value(tmp_path):
    envf = tmp_path / ".env"
    envf.write_text("GOOD=1\nthis-line-has-the-SECRETVALUE\n")
    p = tmp_path / "inv.yaml"
    p.write_text(N + f"job:\n  env_file: {envf}\n")
    with pytest.raises(UserError) as ei:
        load_inventory(p)
    assert "SECRETVALUE" not in str(ei.value) and ":4: job.env_file:" in str(ei.value) and ".env:2:" in str(ei.value)


def test_malformed_cli_exit_and_no_socket(tmp_path):
    """Through the real CLI: exit 2, exactly one stderr line, and no socket opened (a sitecustomize
    makes any socket creation fatal in the child)."""
    cases = [m for m in MALFORMED if m[0] in ("missing_host", "two_masters", "yaml_syntax", "bad_port_str",
                                               "unknown_field", "empty_nodes")]
    env = no_socket_env(tmp_path)
    for name, text, expected in cases:
        p = tmp_path / f"{name}.yaml"
        p.write_text(text)
        for cmd in (["up", "--inventory", str(p)], ["up", "--inventory", str(p), "--dry-run"],
                    ["check", "--inventory", str(p)]):
            proc = subprocess.run([sys.executable, "-m", "runner", *cmd], capture_output=True, text=True,
                                  env=env, cwd=REPO, timeout=60)
            assert proc.returncode == 2, (name, cmd, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("runner: error: "), (name, proc.stderr)
            assert "SOCKET OPENED" not in proc.stderr + proc.stdout
            # the whole message, anchored at the file: "runner: error: <file>:<line>: <field>: <what>"
            assert lines[0].startswith(f"runner: error: {p}") and expected in lines[0], (name, lines[0])


def test_no_socket_module_used_by_parsing(monkeypatch, files):
    def boom(*a, **k):
        raise AssertionError("socket opened while parsing")

    monkeypatch.setattr(socket, "socket", boom)
    monkeypatch.setattr(socket, "create_connection", boom)
    inv = load_inventory(write(files["dir"], GOOD.format(**files)))
    assert len(inv.nodes) == 3


def test_job_push_mode(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n  - {name: a, host: 127.0.0.1}\n")
    assert load_inventory(p).job.push == "relay"  # the default: this host sends each layer once
    p.write_text("nodes:\n  - {name: a, host: 127.0.0.1}\njob: {push: direct}\n")
    assert load_inventory(p).job.push == "direct"
