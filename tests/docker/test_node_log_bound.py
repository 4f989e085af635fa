"""The node's own copy of a job's output (runner/backends/ssh/node_runs.py create_container): Docker's json-file
log keeps every byte unless the daemon sets max-size, so a job printing without end filled the
node's disk. The runner bounds it (NODE_LOG_MAX x NODE_LOG_FILES) only where the daemon does not:
a daemon's own max-size, or another driver, stands. Real engines: this machine's (json-file, no
options, as Debian ships it) and one started here with `--log-opt max-size=10m --log-opt max-file=3`."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.backends.ssh.node_runs import NODE_LOG_FILES, NODE_LOG_MAX, create_container, unbounded_log
from runner.planning.plan import NodePlan
from tests.support.own_dockerd import own_dockerd

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


def _log_config(client, plan: NodePlan, port: int) -> dict:
    """The job container's merged LogConfig, created as `up` creates it; the engine's events show it
    created once and the settings' probe container removed."""
    since = time.time() - 1
    node = SimpleNamespace(name="node-0", host="127.0.0.1", port=port)
    c = create_container(SimpleNamespace(docker=lambda: client, node=node), plan)
    try:
        created = [e["Actor"]["Attributes"].get("name") for e in client.events(
            since=since, until=time.time() + 1, decode=True, filters={"type": "container", "event": "create", "image": plan.image})]
        assert created.count(plan.container) == 1 and len(created) == 2, created  # the probe, then the job's
        assert client.containers.list(all=True, filters={"label": "io.runner.probe"}) == []
        return c.attrs["HostConfig"]["LogConfig"]
    finally:
        c.remove(force=True)


def test_the_runner_bounds_a_json_file_log_the_daemon_leaves_unbounded(host_docker, tmp_path):
    import docker

    client = docker.DockerClient(base_url=host_docker, version="auto")
    tag = _empty_image(client, f"runner-test-empty:{os.getpid()}")
    try:
        got = _log_config(client, _plan(tag, f"runner-test-log-{os.getpid()}"), port=1)
    finally:
        client.images.remove(tag, force=True)
    assert got == {"Type": "json-file", "Config": {"max-size": NODE_LOG_MAX, "max-file": NODE_LOG_FILES}}, got


@pytest.fixture
def bounded_daemon():
    """A dockerd of its own whose json-file log has max-size 10m and max-file 3."""
    with own_dockerd(Path(f"/tmp/rt-logd-{os.getpid()}"), None, "--log-opt", "max-size=10m",
                     "--log-opt", "max-file=3") as (client, _):
        yield client


def test_a_daemons_own_log_bound_stands(bounded_daemon):
    tag = _empty_image(bounded_daemon, "runner-test-empty:1")
    got = _log_config(bounded_daemon, _plan(tag, "runner-test-log"), port=2)
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
