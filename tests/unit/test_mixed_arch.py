"""Mixed amd64 + arm64 jobs: each node is planned with the image of its own architecture, one
torchrun world spans both, and nothing is contacted (the addresses are a real home LAN's)."""

from __future__ import annotations

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from runner.planning.plan import Facts, make_plan
from tests.conftest import REPO
from tests.support.runner_helpers import run_cli

# A desktop with an amd64 CPU as master (stage 0) and two Raspberry Pis (stages 1, 2): the Pi
# experiment with a faster first stage. `aarch64` and `x86_64` are spellings users copy from uname.
MIXED = """\
defaults: {user: pi, identity_file: ~/.ssh/id_ed25519, workdir: ~/runner}
nodes:
  - {name: desk, host: 192.168.1.5, arch: x86_64, role: master, user: me}
  - {name: pi-1, host: 192.168.1.11, arch: aarch64}
  - {name: pi-2, host: 192.168.1.12, arch: arm64}
  - {name: pi-3, host: 192.168.1.13}
job:
  image: {amd64: runner-trainer:latest, arm64: runner-trainer:arm64}
  config: configs/pi-qwen3-3stage.yaml
  args: [--train_steps, "5", --batch_size, "16", --microbatch_num, "4", --profile_batch, "1"]
  env: {OMP_NUM_THREADS: "4"}
  master_port: 29500
"""


@pytest.fixture
def mixed(tmp_path):
    key = tmp_path / "id_ed25519"  # a dry-run refuses a key file that is not there
    key.write_text("not a real key\n")
    p = tmp_path / "mixed.yaml"
    p.write_text(MIXED.replace("configs/", f"{REPO}/configs/").replace("~/.ssh/id_ed25519", str(key)))
    return p


def test_dry_run_picks_the_image_per_arch(mixed, no_network):
    rc, out = run_cli("up", "--inventory", str(mixed), "--dry-run", "--arch", "pi-3=aarch64")
    assert rc == 0
    assert "[desk/0] 192.168.1.5  arch=amd64  image=runner-trainer:latest" in out
    for rank, (node, host) in enumerate((("pi-1", "192.168.1.11"), ("pi-2", "192.168.1.12"),
                                          ("pi-3", "192.168.1.13")), start=1):
        assert f"[{node}/{rank}] {host}  arch=arm64  image=runner-trainer:arm64" in out
    # One world across architectures: the same rendezvous on every node.
    assert out.count("--nnodes 4") == 4 and out.count("--master-addr 192.168.1.5 --master-port 29500") == 4
    assert out.count("MASTER_ADDR=192.168.1.5") == 4


def test_dry_run_unknown_arch_is_left_to_the_probe(mixed, no_network):
    rc, out = run_cli("up", "--inventory", str(mixed), "--dry-run")
    assert rc == 0
    assert "[pi-3/3] 192.168.1.13  arch=<probed at launch>  image=<probed at launch>" in out


def test_plan_with_probed_arches(mixed, no_network):
    inv = load_inventory(mixed, check_files=False)
    facts = {"desk": Facts(ifname="enp3s0", home="/home/me"), "pi-1": Facts(ifname="eth0", home="/home/pi"),
             "pi-2": Facts(ifname="wlan0", home="/home/pi"), "pi-3": Facts(arch="arm64", ifname="eth0", home="/home/pi")}
    plan = make_plan(inv, "r1", facts, master_port=29500, strict=True)
    assert [(n.node, n.rank, n.arch, n.image) for n in plan.nodes] == [
        ("desk", 0, "amd64", "runner-trainer:latest"), ("pi-1", 1, "arm64", "runner-trainer:arm64"),
        ("pi-2", 2, "arm64", "runner-trainer:arm64"), ("pi-3", 3, "arm64", "runner-trainer:arm64")]
    # Everything but the node rank and the per-node interface is identical across architectures.
    cmds = [n.command for n in plan.nodes]
    assert all(c[c.index("--node-rank") + 1] == str(i) for i, c in enumerate(cmds))
    strip = [[a for j, a in enumerate(c) if j != c.index("--node-rank") + 1] for c in cmds]
    assert all(s == strip[0] for s in strip)
    assert [n.env["GLOO_SOCKET_IFNAME"] for n in plan.nodes] == ["enp3s0", "eth0", "wlan0", "eth0"]
    assert plan.node("desk").run_dir == "/home/me/runner/runs/r1"


def test_missing_image_for_an_arch_is_one_line(mixed, no_network):
    mixed.write_text(mixed.read_text().replace("{amd64: runner-trainer:latest, arm64: runner-trainer:arm64}",
                                               "{amd64: runner-trainer:latest}"))
    # Known at load time from the inventory's own arch fields: file, line, field, node.
    with pytest.raises(UserError) as e:
        load_inventory(mixed, check_files=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{mixed}:8: job.image: no image for arch arm64 (node pi-1)")
    # Only probed (arch absent from the inventory): the strict plan refuses at launch.
    mixed.write_text(mixed.read_text().replace("arch: aarch64", "role: worker").replace("arch: arm64}", "role: worker}"))
    inv = load_inventory(mixed, check_files=False)
    facts = {n.name: Facts(arch="amd64" if n.name == "desk" else "arm64", ifname="eth0", home="/h") for n in inv.nodes}
    with pytest.raises(UserError) as e:
        make_plan(inv, "r1", facts, master_port=29500, strict=True)
    msg = str(e.value)
    assert "\n" not in msg and "no image for arch arm64 (node pi-1)" in msg and "add `arm64: <tag>`" in msg


def _steps(dockerfile: str) -> list[str]:
    """Instruction keywords + first word, in order: the layer layout of a Dockerfile."""
    text = (REPO / dockerfile).read_text().replace("\\\n", " ")
    return [" ".join(line.split()[:2]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_arm64_dockerfile_layers_like_amd64():
    """Same order (base, torch, dependencies, code) so a code change re-pushes one small layer to a
    Pi; torch pinned to 2.13.0 from PyTorch's CPU index by default (PyPI's aarch64 wheel is a CUDA
    build with ~3 GB of dependencies)."""
    arm = (REPO / "Dockerfile.arm64").read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in arm
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0' in arm
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in arm
    order = [s for s in _steps("Dockerfile.arm64") if s.split()[0] in ("FROM", "COPY", "RUN")]
    assert order == [s for s in _steps("Dockerfile") if s.split()[0] in ("FROM", "COPY", "RUN")]
    torch_at = next(i for i, s in enumerate(arm.splitlines()) if "torch==2.13.0" in s and "pip install" in s)
    code_at = arm.splitlines().index("COPY trainer ./trainer")
    assert torch_at < arm.splitlines().index("COPY docker/requirements-trainer.txt /tmp/requirements-trainer.txt") < code_at
