"""`push` into a node engine without room for the image (runner/delivery/disk_room.py): docker load
unpacks the whole stream into its data root before registering the layers, twice the layers' bytes
at the peak. Before, the stream was sent, load failed with `no space left on device`, and push fell
back to sending the whole image again, compressed, to fail the same way. Now the node's data root
is measured first (`docker info`'s DockerRootDir, `df -Pk`): one line naming the node, nothing
sent; with room, the same push loads. A real node (tests/support/hostile_node.py, honest here: real sh,
real OpenSSH streams) whose engine is a dockerd of the test's own with its data root on a tmpfs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from runner.backends.ssh.check import check_node
from runner.delivery import push as push_mod
from runner.delivery.disk_room import NoRoom, engine_shortage
from runner.delivery.images import export, host_client
from runner.delivery.layer_sizes import host_layers
from runner.delivery.registry import pull_one
from runner.inventory import load_inventory
from runner.transport.ssh import Remote
from tests.support.hostile_node import HostileNode
from tests.support.own_dockerd import own_dockerd
from tests.support.runner_helpers import build_scratch_image, remove_host_image
from tests.support.small_fs import small_fs

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]
MiB = 1 << 20


@pytest.fixture
def image(host_docker):
    tag = f"runner-test-room:{os.getpid()}"
    build_scratch_image(tag, [os.urandom(20 * MiB)])  # one 20 MiB layer no engine has
    yield tag
    remove_host_image(tag)


def test_push_into_an_engine_without_room_sends_nothing_and_with_room_loads(image, tmp_path, monkeypatch):
    exp = export(image, cache=tmp_path / "cache")  # from this machine's engine, before DOCKER_HOST moves
    root = Path(f"/tmp/rt-room-{os.getpid()}")
    try:
        with small_fs(root / "data", 32 * MiB) as data, own_dockerd(root, data) as (client, url):
            monkeypatch.setenv("DOCKER_HOST", url)  # the node's commands (run here by its sh) reach that engine
            with HostileNode(tmp_path / "node") as node, Remote(node.node(name="pi-1")).connect() as r:
                with pytest.raises(NoRoom) as err:
                    push_mod.push_one(r, exp)
                assert re.fullmatch(rf"node pi-1: {re.escape(image)} \(1 of 1 layers\) needs 40\.0 MiB while docker "
                                    r"load unpacks it \(2 x 20\.0 MiB of layers\), and its engine's data root \(docker "
                                    r"info's DockerRootDir\) has \d\d\.\d MiB free \(1\.6 MiB of it kept free\); nothing "
                                    r"was sent: free space there \(docker image prune, docker system df\), then push "
                                    r"again", str(err.value)), err.value
                assert not any("docker load" in c for c in node.commands), node.commands
                assert client.images.list() == []

                subprocess.run(["mount", "-o", "remount,size=96m", str(data)], check=True)
                res = push_mod.push_one(r, exp)
                assert (res.action, res.layers_sent) == ("layers", 1)
                assert client.images.get(image).id == exp.image_id
    finally:
        exp.release()


def test_check_and_a_registry_pull_see_an_engine_without_room_before_any_byte(image, tmp_path, monkeypatch):
    """`runner check` reports what push would refuse (the same rule, the layers' sizes from this
    host's engine: exactly the 20 MiB file here), and a registry pull of a tag this host has is
    refused before `docker pull` runs; with room, check has no problem with the node."""
    client = host_client()
    hl = host_layers(client, image, cache=tmp_path / "no-cache")  # before DOCKER_HOST moves
    client.close()
    assert (hl.sizes, hl.exact) == ([20 * MiB], False)
    root = Path(f"/tmp/rt-room-{os.getpid()}")
    with small_fs(root / "data", 32 * MiB) as data, own_dockerd(root, data) as (_, url):
        monkeypatch.setenv("DOCKER_HOST", url)
        with HostileNode(tmp_path / "node") as node:
            n = node.node(name="pi-1")
            inv_file = tmp_path / "inv.yaml"
            inv_file.write_text(yaml.safe_dump({"nodes": [{"name": "pi-1", "host": n.host, "port": n.port, "user": n.user,
                                                           "identity_file": n.identity_file,
                                                           "known_hosts": n.known_hosts, "workdir": n.workdir}],
                                                "job": {"image": image}}))
            inv = load_inventory(inv_file)
            nc = check_node(inv, inv.nodes[0], False, None, {image: hl})
            assert (nc.image_state, nc.image_lacking) == ("absent", 20 * MiB)
            assert 25 * MiB < nc.engine_free < 32 * MiB
            assert len(nc.problems) == 1 and re.fullmatch(
                rf"{re.escape(image)} \(1 of 1 layers\) needs about 40\.0 MiB while docker load unpacks it \(2 x "
                r"20\.0 MiB of layers\), and its engine's data root \(docker info's DockerRootDir\) has \d\d\.\d MiB "
                r"free \(1\.6 MiB of it kept free\); push would stop there before sending: free space there "
                r"\(docker image prune, docker system df\)", nc.problems[0]), nc.problems

            with Remote(n).connect() as r, pytest.raises(NoRoom) as err:
                pull_one(r, "127.0.0.1:1", image, None, str(tmp_path), host=hl)
            assert str(err.value).startswith(f"node pi-1: job.registry 127.0.0.1:1: 127.0.0.1:1/{image} (1 of 1 "
                                             "layers) needs about 40.0 MiB while docker pull unpacks it"), err.value
            assert str(err.value).endswith("nothing was pulled: free space there (docker image prune, docker system "
                                           "df), then run again")
            assert not any("docker pull" in c for c in node.commands), node.commands

            inv.job.registry = "127.0.0.1:1"  # check for a job that pulls: the pull's verb and what it spares
            (line,) = check_node(inv, inv.nodes[0], False, None, {image: hl}).problems
            assert "needs about 40.0 MiB while docker pull unpacks it (2 x 20.0 MiB of layers)" in line, line
            assert line.endswith("; the pull would stop there before docker pull runs: free space there (docker "
                                 "image prune, docker system df)"), line
            inv.job.registry = None

            subprocess.run(["mount", "-o", "remount,size=96m", str(data)], check=True)
            nc = check_node(inv, inv.nodes[0], False, None, {image: hl})
            assert (nc.image_state, nc.image_lacking, nc.problems) == ("absent", 20 * MiB, [])
            assert nc.engine_free > 80 * MiB


@pytest.mark.parametrize("room, layer_bytes, short", [
    (None, 10 << 30, False),                   # an engine whose data root is not seen: not refused
    ((50 << 30, 100 << 30), 24 << 30, False),  # 48 GiB + 1 GiB kept free <= 50 GiB
    ((50 << 30, 100 << 30), 25 << 30, True),
    ((100 * MiB, 200 * MiB), 45 * MiB, False),  # 90 MiB + 5% of 200 MiB
    ((100 * MiB, 200 * MiB), 46 * MiB, True),
])
def test_a_load_needs_twice_its_layers_and_what_is_kept_free(room, layer_bytes, short):
    assert (engine_shortage("n", room, layer_bytes, "x") is not None) is short
