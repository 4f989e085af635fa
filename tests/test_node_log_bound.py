"""The node's own copy of a job's output (runner/node_runs.py create_container): Docker's json-file
log keeps every byte unless the daemon sets max-size, so a job printing without end filled the
node's disk. The runner bounds it (NODE_LOG_MAX x NODE_LOG_FILES) only where the daemon does not:
a daemon's own max-size, or another driver, stands. Real engines: this machine's (json-file, no
options, as Debian ships it) and one started here with `--log-opt max-size=10m --log-opt max-file=3`."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.node_runs import NODE_LOG_FILES, NODE_LOG_MAX, create_container, unbounded_log
from runner.plan import NodePlan
from tests.conftest import require

pytestmark = [pytest.mark.docker]


def _empty_image(client, tag: str) -> str:
    """An image of no files (docker import of an empty tar): a container of it is created, never started."""
    buf = io.BytesIO()
    tarfile.open(fileobj=buf, mode="w").close()
    client.api.import_image_from_data(buf.getvalue(), repository=tag.split(":")[0], tag=tag.split(":")[1])
    return tag


def _plan(image: str, name: str) -> NodePlan:
    return NodePlan(node="node-0", host="127.0.0.1", rank=0, arch=None, image=image, container=name,
                    labels={"runner.test": "log-bound"}, command=["/never-run"], env={}, secret_keys=[],
                    workdir="/tmp", run_dir="/tmp", secrets_file=None, config_file=None, writable=frozenset())


def _log_config(client, plan: NodePlan) -> dict:
    c = create_container(SimpleNamespace(docker=lambda: client), plan)
    try:
        assert client.containers.list(all=True, filters={"name": plan.container}) != [], plan.container
        return c.attrs["HostConfig"]["LogConfig"]
    finally:
        c.remove(force=True)


def test_the_runner_bounds_a_json_file_log_the_daemon_leaves_unbounded(host_docker, tmp_path):
    import docker

    client = docker.DockerClient(base_url=host_docker, version="auto")
    tag = _empty_image(client, f"runner-test-empty:{os.getpid()}")
    try:
        got = _log_config(client, _plan(tag, f"runner-test-log-{os.getpid()}"))
    finally:
        client.images.remove(tag, force=True)
    assert got == {"Type": "json-file", "Config": {"max-size": NODE_LOG_MAX, "max-file": NODE_LOG_FILES}}, got


@pytest.fixture
def bounded_daemon(tmp_path_factory):
    """A dockerd of its own (data root, exec root, socket; no bridge, no iptables) whose json-file
    log has max-size 10m and max-file 3."""
    import docker

    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    require("root and dockerd", os.geteuid() == 0 and os.path.exists(dockerd), "a dockerd of the test's own")
    root = Path(f"/tmp/rt-logd-{os.getpid()}")  # short: the socket path must fit sun_path
    root.mkdir(exist_ok=True)
    sock = root / "sock"
    logf = open(root / "dockerd.log", "wb")
    proc = subprocess.Popen([dockerd, "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
                             "--pidfile", str(root / "pid"), "-H", f"unix://{sock}", "--bridge", "none",
                             "--iptables=false", "--ip6tables=false", "--log-opt", "max-size=10m",
                             "--log-opt", "max-file=3"], stdout=logf, stderr=logf)
    try:
        end = time.time() + 60
        while True:
            try:
                client = docker.DockerClient(base_url=f"unix://{sock}", version="auto")  # asks the version
                break
            except Exception:  # noqa: BLE001 - not listening yet
                assert proc.poll() is None and time.time() < end, (root / "dockerd.log").read_text()[-2000:]
                time.sleep(0.2)
        yield client
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()
        subprocess.run(["umount", "-R", "-l", str(root / "data")], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_a_daemons_own_log_bound_stands(bounded_daemon):
    tag = _empty_image(bounded_daemon, "runner-test-empty:1")
    got = _log_config(bounded_daemon, _plan(tag, "runner-test-log"))
    assert got == {"Type": "json-file", "Config": {"max-size": "10m", "max-file": "3"}}, got


@pytest.mark.parametrize("attrs, want", [
    ({"HostConfig": {"LogConfig": {"Type": "json-file", "Config": {}}}}, True),
    ({"HostConfig": {"LogConfig": {"Type": "json-file", "Config": None}}}, True),
    ({"HostConfig": {"LogConfig": {"Type": "json-file", "Config": {"max-size": "10m"}}}}, False),
    ({"HostConfig": {"LogConfig": {"Type": "local", "Config": {}}}}, False),      # local rotates by default
    ({"HostConfig": {"LogConfig": {"Type": "journald", "Config": {}}}}, False),   # the system's journal
    ({"HostConfig": {"LogConfig": "json-file"}}, False),                          # a malformed answer: as it is
    ({"HostConfig": None}, False),
    ([], False),
])
def test_which_created_containers_keep_every_byte(attrs, want):
    assert unbounded_log(attrs) is want
