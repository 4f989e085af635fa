"""Test gating: real components or a stated skip, and never a skip in CI.

With CI=true a missing Docker engine or sshd is a failure, so CI cannot go green by skipping
the real parts.
"""

from __future__ import annotations

import os
import shutil

import pytest

from runner.delivery.host_engine import host_engine
from tests import IMAGE, REPO
from tests.support.worker_share import (
    groups,
    groups_file,
    machine_share,
    make_scheduler,
    record_time,
    remove_files,
    serialized,
)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# First two octets of every loopback address the tests give sandbox nodes. Two pytest sessions on
# one machine (two checkouts, or a developer beside CI) each set their own, e.g. RUNNER_TEST_NET=127.1.
TEST_NET = os.environ.get("RUNNER_TEST_NET", "127.0")
# The suite's `runner up`s run from the checkout: none may become its default inventory
# (runner/inventory/choice.py; the tests of that default set it themselves).
os.environ["RUNNER_LAST_UP"] = ""


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist") and not os.environ.get("PYTEST_XDIST_WORKER"):
        groups_file()  # the controller, before its workers start


def pytest_unconfigure(config):
    if config.pluginmanager.hasplugin("xdist") and not os.environ.get("PYTEST_XDIST_WORKER"):
        remove_files()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return make_scheduler(config, log)
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with machine_share(alone=item.get_closest_marker("alone") is not None), record_time(item):
        yield


def net_addr(third: int, fourth: int) -> str:
    """A loopback address in this session's test net: net_addr(2, 11) -> 127.0.2.11 by default."""
    return f"{TEST_NET}.{third}.{fourth}"


def require(what: str, ok: bool, reason: str) -> None:
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI but missing: {reason}")
    pytest.skip(f"{what} missing: {reason} (run scripts/setup.sh)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    groups(items)  # which worker runs what (tests/support/worker_share.py)
    if os.environ.get("RUN_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow tier (qemu emulation, benchmark smoke runs, layouts beyond one per "
                                         "claim); set RUN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def have_sshd() -> None:
    require("sshd", bool(shutil.which("sshd") or os.path.exists("/usr/sbin/sshd")),
            "openssh-server is not installed")


# This machine's engine as the runner finds it (DOCKER_HOST, the docker context, the default
# socket: runner/delivery/host_engine.py); the suite's images are built there.
HOST_DOCKER = host_engine().url


def _docker_ok() -> bool:
    import subprocess
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "-H", HOST_DOCKER, "version", "--format", "{{.Server.Version}}"],
        capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def host_docker() -> str:
    """The host engine (started by scripts/setup.sh); its socket URL."""
    require("Docker engine", _docker_ok(), f"no engine answers on {HOST_DOCKER}")
    return HOST_DOCKER


@pytest.fixture(scope="session")
def trainer_image(host_docker) -> str:
    """This session's trainer image (tests/__init__.py IMAGE) on the host engine, built by the
    project's script from the checkout (cached layers); its tag is removed at the end."""
    import subprocess
    with serialized("image-build"):  # one wheel-server port per machine (scripts/build-image.sh)
        proc = subprocess.run([str(REPO / "scripts/build-image.sh"), IMAGE], capture_output=True, text=True,
                              cwd=REPO, env={**os.environ, "DOCKER_HOST": host_docker})
    assert proc.returncode == 0, f"image build failed:\n{proc.stderr[-3000:]}"
    yield IMAGE
    if not os.environ.get("RUNNER_TEST_IMAGE"):
        subprocess.run(["docker", "-H", host_docker, "rmi", IMAGE], capture_output=True)


def _sandbox_cmd(*args: str) -> list[str]:
    import sys
    return [sys.executable, "-m", "runner", "sandbox", *args]


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory, host_docker, have_sshd):
    """A 3-node sandbox cluster of its own (own state dir, own addresses <TEST_NET>.2.11-13), torn down
    at the end of the session. Yields the path of its inventory (hosts/local.yaml format)."""
    yield from _sandbox_cluster(tmp_path_factory.mktemp("sandbox"), "--nodes", "3", "--base-addr", net_addr(2, 11))


def _sandbox_cluster(state, *up_args: str):
    """`runner sandbox up` in state/s, its inventory (state/local.yaml, this session's image) yielded,
    `runner sandbox down` after: the body of every session sandbox fixture."""
    import subprocess
    inv = state / "local.yaml"
    up = subprocess.run(_sandbox_cmd("--dir", str(state / "s"), "up", *up_args, "--inventory", str(inv)),
                        capture_output=True, text=True, cwd=REPO, timeout=900)
    assert up.returncode == 0, up.stderr
    inv.write_text(inv.read_text().replace("image: runner-trainer:latest", f"image: {IMAGE}"))
    written = inv.read_text()
    try:
        yield inv
        # Shared by every test of the session: one that rewrites it (a `sandbox up --inventory` onto
        # it put `runner-trainer:latest` back) breaks the tests after it, in some orders only.
        assert inv.read_text() == written, f"a test rewrote the session's inventory {inv}"
    finally:
        # --purge: each node keeps a copy of the image (GBs); a suite must not leave them behind.
        subprocess.run(_sandbox_cmd("--dir", str(state / "s"), "down", "--purge"), capture_output=True, cwd=REPO,
                       timeout=900)  # bounded here: pytest-timeout times tests' calls only


@pytest.fixture(scope="session")
def netns_sandbox(tmp_path_factory, host_docker, have_sshd, trainer_image):
    """Three nodes in their own network namespaces with the trainer image (tests/support/netns_sandbox.py):
    the links tests and the elastic runs share it."""
    from tests.support.netns_sandbox import netns_cluster

    yield from netns_cluster(tmp_path_factory)


@pytest.fixture(scope="session")
def pushed(sandbox, trainer_image, tmp_path_factory):
    """The first push of the trainer image onto the session sandbox's empty nodes. Every test that
    pushes to (or runs `up` on) the session sandbox asks for this first, so the push recorded
    here is always onto empty nodes, whatever order the tests run in."""
    import time

    from tests.support.runner_helpers import parse_push, runner, write_job

    tmp = tmp_path_factory.mktemp("push")
    job = write_job(tmp)
    t0 = time.time()
    proc = runner("push", "-i", str(sandbox), "--job", str(job), timeout=1200)
    assert proc.returncode == 0, proc.stderr
    return {"first": parse_push(proc.stdout), "seconds": time.time() - t0, "job": job}


# The non-root account of the `nonroot_sandbox` nodes: one fixed name, so suites on one machine
# reuse one account (`runner sandbox down` keeps it; every sandbox has its own dir in its home).
NONROOT_USER = "runnerpi"
NONROOT_NODES = 3  # node-0 (master), node-1, ...: its tests take the count from here


@pytest.fixture(scope="session")
def nonroot_sandbox(tmp_path_factory, host_docker, have_sshd):
    """A second, small sandbox (NONROOT_NODES nodes from <TEST_NET>.12.11) logging in as NONROOT_USER,
    as a Raspberry Pi's `pi`: no root, no sudo, its group allowed on each node's engine. Torn down
    at the end of the session. Yields the path of its inventory."""
    yield from _sandbox_cluster(tmp_path_factory.mktemp("sandbox-nonroot"), "--nodes", str(NONROOT_NODES),
                                "--base-addr", net_addr(12, 11), "--user", NONROOT_USER)


@pytest.fixture(scope="session")
def nonroot_pushed(nonroot_sandbox, trainer_image, tmp_path_factory):
    """The trainer image pushed onto the non-root sandbox (as its user: `docker load` through the
    engine's group); the push table's rows."""
    from tests.support.runner_helpers import parse_push, runner, write_job

    job = write_job(tmp_path_factory.mktemp("push-nonroot"))
    proc = runner("push", "-i", str(nonroot_sandbox), "--job", str(job), timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return parse_push(proc.stdout)


@pytest.fixture
def no_network(monkeypatch):
    """Any socket, name lookup, SSH client or docker client creation fails the test (the Pi and EC2
    addresses in hosts/ must never be contacted; a DNS query is contact too)."""
    import socket

    import paramiko

    import docker

    def boom(*a, **k):
        raise AssertionError("a network connection was attempted")

    class NoSocket(socket.socket):
        def __init__(self, *a, **k):
            raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", NoSocket)
    monkeypatch.setattr(socket, "create_connection", boom)
    for lookup in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getfqdn"):
        monkeypatch.setattr(socket, lookup, boom)
    monkeypatch.setattr(paramiko.SSHClient, "connect", boom)
    monkeypatch.setattr(paramiko.Transport, "__init__", boom)
    monkeypatch.setattr(docker, "DockerClient", boom)
    monkeypatch.setattr(docker, "from_env", boom)


SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory, have_sshd):
    """A Slurm cluster (slurmctld + 3 slurmd + munge + a login sshd: `runner sandbox up --slurm`),
    started once for the session and shared by the Slurm tests (test_slurm_cluster.py through the
    CLI, test_api_slurm.py through runner.api), stopped at its end, asserting nothing of it is
    left running. `inv` submits on the login node over SSH, `local` from this machine (env: SLURM_CONF)."""
    from pathlib import Path
    from types import SimpleNamespace

    import psutil
    import yaml

    from tests.support.runner_helpers import runner

    require("Slurm", all(shutil.which(t) for t in SLURM_TOOLS), "slurm-wlm / munge are not installed")
    state = tmp_path_factory.mktemp("slurm")
    inv = state / "slurm.yaml"
    up = runner("sandbox", "--dir", str(state / "s"), "up", "--slurm", "--nodes", "3", "--base-addr", net_addr(9, 31),
                "--inventory", str(inv), timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    conf = state / "s" / "slurm" / "etc" / "slurm.conf"
    doc = yaml.safe_load(inv.read_text())
    local = state / "slurm-local.yaml"  # the same cluster without the login node: submitted from here
    local.write_text(yaml.safe_dump({**doc, "slurm": {k: v for k, v in doc["slurm"].items() if k != "login"}}))
    try:
        yield SimpleNamespace(inv=inv, local=local, conf=conf, env={"SLURM_CONF": str(conf)},
                              shared=Path(doc["slurm"]["workdir"]), state=state)
    finally:
        down = runner("sandbox", "--dir", str(state / "s"), "down", timeout=180)
        left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                if str(state) in " ".join(p.info["cmdline"] or [])]
        assert down.returncode == 0 and "slurm cluster" in down.stdout, down.stdout + down.stderr
        assert not left, left
