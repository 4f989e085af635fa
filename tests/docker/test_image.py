"""The amd64 trainer image builds here from the local debootstrap base and the CPU torch wheel,
and holds the trainer package with its entry point."""

from __future__ import annotations

import os
import subprocess

import pytest

from runner.planning.plan import GATE_MODULES
from tests.conftest import REPO

pytestmark = pytest.mark.docker


def docker(host, *args, **kw):
    return subprocess.run(["docker", "-H", host, *args], capture_output=True, text=True, timeout=600, **kw)


def test_image_has_cpu_torch_and_trainer(host_docker, trainer_image):
    r = docker(host_docker, "run", "--rm", "--network", "host", trainer_image, "python", "-c",
               "import torch, trainer, transformers; print(torch.__version__, torch.cuda.is_available())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2.13.0+cpu", "False"]


def test_image_entry_points_and_architecture(host_docker, trainer_image):
    r = docker(host_docker, "image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", trainer_image)
    assert r.stdout.strip() == "linux/amd64", r.stdout + r.stderr
    r = docker(host_docker, "image", "inspect", "--format", '{{index .Config.Labels "io.runner.gate"}}', trainer_image)
    gate = GATE_MODULES[r.stdout.strip()]  # the label names the gate `runner up` runs in the workers
    assert gate == "runner.agents.gate", r.stdout
    r = docker(host_docker, "run", "--rm", "--network", "host", trainer_image, "sh", "-c",
               "uname -m; trainer --help | head -n 1; torchrun --help | head -n 1; "
               f"python -c 'import {gate}, torch.distributed.run as r; print(r.__file__)'")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "x86_64", "usage: trainer [train] [--config X.yaml | X.yaml] [--section.key VALUE ...] [seed flags]",
        "usage: torchrun [-h] [--nnodes NNODES] [--nproc-per-node NPROC_PER_NODE]",
        "/opt/venv/lib/python3.11/site-packages/torch/distributed/run.py"]


def test_image_leaves_out_test_suites_and_keeps_what_runs(host_docker, trainer_image):
    """docker/slim.sh: no torch C++ test binaries and no package's own tests in the layers every
    node is pushed (208 MB of 1.72 GB); torch_shm_manager stays, and what the trainer imports (the
    data path's pyarrow and datasets included) still imports."""
    script = ("import os, sysconfig; sp = sysconfig.get_paths()['purelib']; "
              "print(sorted(os.listdir(os.path.join(sp, 'torch', 'bin')))); "
              "print(os.path.exists(os.path.join(sp, 'torch', 'test'))); "
              "print(sorted(os.path.relpath(d, sp) for d, subs, _ in os.walk(sp) if os.path.basename(d) == 'tests' "
              "and not os.path.relpath(d, sp).startswith('torch'))); "
              "import torch, transformers, datasets, pyarrow.fs, pandas, matplotlib, trainer.cli; print('ok')")
    r = docker(host_docker, "run", "--rm", "--network", "host", trainer_image, "python", "-c", script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["['torch_shm_manager']", "False", "[]", "ok"], r.stdout


def test_image_layers_put_code_last(host_docker, trainer_image):
    """A code-only change must re-push one small layer: the last layers hold only the project."""
    r = docker(host_docker, "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", trainer_image)
    assert r.returncode == 0, r.stderr
    rows = [line.split("\t", 1) for line in r.stdout.splitlines() if "#(nop)  CMD" not in line]
    # newest first: the pip install of the project, then the COPYs of the sources
    assert "pip install --no-deps ." in rows[0][1]
    assert any("torch==2.13.0" in cmd for _, cmd in rows[5:]), "torch layer must come before the code layers"
    # The torch wheel is served during the build, not copied into a layer of its own.
    assert not any("wheels" in cmd and "COPY" in cmd for _, cmd in rows)


def test_base_image_is_local_bookworm(host_docker, trainer_image):
    r = docker(host_docker, "run", "--rm", "--network", "host", "runner-base:bookworm", "sh", "-c",
               ". /etc/os-release; echo $VERSION_CODENAME; python3 -c 'import sys; print(sys.version_info[:2])'")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["bookworm", "(3, 11)"]


@pytest.mark.slow
@pytest.mark.timeout(7200)  # qemu emulation of an arm64 image build and a torch import
def test_arm64_image_builds_and_runs_under_emulation(host_docker):
    # Only PyPI is reachable here: TORCH_INDEX_URL= (empty) instead of the script's CPU-index default.
    r = subprocess.run([str(REPO / "scripts/build-image-arm64.sh")], capture_output=True, text=True, cwd=REPO,
                       timeout=3600, env={**os.environ, "TORCH_INDEX_URL": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    # OMP_NUM_THREADS=1: under qemu-user torch's OpenMP pool start-up deadlocks (scripts/build-image-arm64.sh).
    r = docker(host_docker, "image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", "runner-trainer:arm64")
    assert r.stdout.strip() == "linux/arm64", r.stdout + r.stderr
    r = docker(host_docker, "run", "--rm", "--platform", "linux/arm64", "--network", "host", "-e", "OMP_NUM_THREADS=1",
               "runner-trainer:arm64", "sh", "-c",
               "uname -m; trainer --help | head -n 1; python -c 'import torch; print(torch.__version__)'")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:2] == ["aarch64", "usage: trainer [train] [--config X.yaml | X.yaml] [--section.key VALUE ...] [seed flags]"]
    assert lines[2].startswith("2.13.0"), lines
