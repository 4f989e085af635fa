"""A hostile relay peer against a real relay agent and a real `docker load` (Go's archive/tar in
the host's engine): the agent runs here as it runs on a node (listen mode, its own `docker load`),
and the test is the upstream node, which knows the transfer's token and sends what it likes."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runner.delivery.images import export
from runner.delivery.relay import chain_stream, head_line, route_line
from tests.conftest import HOST_DOCKER
from tests.support.runner_helpers import build_scratch_image, remove_host_image, unique_tag
from tests.support.tar_blocks import header

pytestmark = pytest.mark.docker
AGENT = Path(__file__).resolve().parents[2] / "runner" / "agents" / "relay_agent.py"


def start_agent(head: dict, route: dict) -> tuple[subprocess.Popen, int]:
    """The agent in listen mode, as relay.py starts it on a node (its `docker load` is this host's
    engine); (the process, its port)."""
    agent = subprocess.Popen([sys.executable, "-u", str(AGENT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "DOCKER_HOST": HOST_DOCKER})
    agent.stdin.write(json.dumps(head).encode() + b"\n")
    agent.stdin.flush()
    port = int(agent.stdout.readline().split()[1])
    agent.stdin.write(json.dumps(route).encode() + b"\n")
    agent.stdin.flush()
    return agent, port


def report(agent: subprocess.Popen) -> list[str]:
    """The agent's report lines (without BYTES) up to its last, DONE or ERROR; then it is ended."""
    lines = []
    try:
        for raw in agent.stdout:
            line = raw.decode().strip()
            if not line.startswith("BYTES"):
                lines.append(line)
            if line.startswith(("DONE", "ERROR")):
                break
        return lines
    finally:
        agent.stdin.close()
        agent.wait(timeout=60)


def send(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the agent refused and closed: its report says why
    return s


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "-H", HOST_DOCKER, "image", "inspect", tag], capture_output=True).returncode == 0


@pytest.fixture
def pushed_and_evil(host_docker, tmp_path):
    """(the export of an image the host pushes, the `docker save` archive of another image an
    attacker wants on the nodes, its tag), the latter not on the engine."""
    tag, evil = unique_tag("relay-victim"), unique_tag("relay-evil")
    build_scratch_image(tag, [os.urandom(4096), os.urandom(4096)])
    build_scratch_image(evil, [b"an attacker's image\n"])
    try:
        exp = export(tag, cache=tmp_path / "cache")
        archive = subprocess.run(["docker", "-H", HOST_DOCKER, "save", evil], capture_output=True, check=True).stdout
        remove_host_image(evil)
        yield exp, archive, evil
    finally:
        remove_host_image(tag)
        remove_host_image(evil)


def test_an_upstream_node_cannot_hide_an_image_in_a_layer(pushed_and_evil):
    """The upstream node sends the host's manifest and config, then the first layer with a size
    field that starts with NUL (read as 0 by a parser that stops at the NUL, as 512 by Go's, which
    trims NULs first), then the second layer whose content is another image's `docker save`:
    Go's reader takes the second layer's header for the first layer's data and then reads the
    hidden archive's entries. Nothing of it may reach the engine."""
    exp, archive, evil = pushed_and_evil
    token = secrets.token_hex(32)
    entry = lambda name, data: header(name, len(data)) + data + bytes(-len(data) % 512)  # noqa: E731
    stream = (entry("manifest.json", exp.tag_manifest.read_bytes())
              + entry(exp.config, (exp.dir / exp.config).read_bytes())
              + header(exp.layers[0], 0, size=b"\0" + b"%010o" % 512 + b"\0")   # 0 to the old check, 512 to Go
              + entry(exp.layers[1], archive)
              + bytes(1024))
    assert len(archive) % 512 == 0
    agent, port = start_agent(head_line(exp, [0, 1], [0, 1], token), route_line(None, []))
    with send(port, token.encode() + b"\n" + stream):
        lines = report(agent)
    assert not image_exists(evil), lines
    assert lines[-1].startswith("ERROR refused: ") and "size field" in lines[-1], lines


def test_strangers_on_the_agents_port_hold_nothing_up_and_load_nothing(pushed_and_evil):
    """While the agent waits for its upstream, strangers on the network connect: forty that say
    nothing and hold on, one with another token and then a real image archive, one a character
    off the token, one that sends 10 kB without a newline. The upstream (with the token) still
    gets in at once, the node loads exactly the host's image, and every stranger is dropped."""
    exp, archive, evil = pushed_and_evil
    token = secrets.token_hex(32)
    agent, port = start_agent(head_line(exp, [0, 1], [0, 1], token), route_line(None, []))
    strangers = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(40)]
    strangers += [send(port, secrets.token_hex(32).encode() + b"\n" + archive),
                  send(port, token[:-1].encode() + b"x\n" + archive),
                  send(port, b"A" * 10_000)]
    with send(port, token.encode() + b"\n" + b"".join(bytes(c) for c in chain_stream(exp, [0, 1]))):
        lines = report(agent)
    assert lines == ["PEER 127.0.0.1", "LOADING", f"DONE 0 Loaded image: {exp.tag}"], lines
    assert not image_exists(evil)
    for s in strangers:
        try:
            assert s.recv(1) == b""  # closed by the agent
        except ConnectionResetError:
            pass
        s.close()
