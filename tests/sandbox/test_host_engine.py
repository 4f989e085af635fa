"""This machine's Docker engine is found as the docker CLI finds it: DOCKER_HOST, then the docker
context (DOCKER_CONTEXT, else config.json's currentContext -> contexts/meta/<sha256>/meta.json),
then the default socket. The files are real ones in tmp_path; the engine on a non-default socket
is a real dockerd: a session sandbox node's."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.delivery.host_engine import DEFAULT_SOCKET, host_engine
from runner.delivery.images import host_client
from tests.support.runner_helpers import node_env, remotes


def docker_config(root: Path, current: str | None, contexts: dict[str, str]) -> Path:
    """A DOCKER_CONFIG dir as `docker context create NAME --docker host=URL` + `docker context use` leave it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"auths": {}, **({"currentContext": current} if current else {})}))
    for name, url in contexts.items():
        meta = root / "contexts" / "meta" / hashlib.sha256(name.encode()).hexdigest()
        meta.mkdir(parents=True)
        (meta / "meta.json").write_text(json.dumps({"Name": name, "Metadata": {},
                                                    "Endpoints": {"docker": {"Host": url, "SkipTLSVerify": False}}}))
    return root


def test_the_order_docker_host_context_default(tmp_path):
    cfg = docker_config(tmp_path / "cfg", "colima", {"colima": "unix:///home/u/.colima/default/docker.sock",
                                                      "desktop-linux": "unix:///home/u/.docker/desktop/docker.sock"})
    env = {"DOCKER_CONFIG": str(cfg)}
    e = host_engine(env)
    assert (e.url, e.source, e.cli()) == ("unix:///home/u/.colima/default/docker.sock", "docker context colima",
                                          ["docker", "--context", "colima"])
    e = host_engine({**env, "DOCKER_CONTEXT": "desktop-linux"})
    assert e.url == "unix:///home/u/.docker/desktop/docker.sock"
    e = host_engine({**env, "DOCKER_HOST": "unix:///run/user/1000/docker.sock"})  # rootless Docker's
    assert (e.url, e.source, e.cli()) == ("unix:///run/user/1000/docker.sock", "DOCKER_HOST",
                                          ["docker", "-H", "unix:///run/user/1000/docker.sock"])
    assert host_engine({**env, "DOCKER_CONTEXT": "default"}).url == DEFAULT_SOCKET
    assert host_engine({"HOME": str(tmp_path / "nohome")}).url == DEFAULT_SOCKET  # no ~/.docker at all
    # ~/.docker is the default DOCKER_CONFIG
    docker_config(tmp_path / "home" / ".docker", "podman", {"podman": "unix:///run/podman/podman.sock"})
    assert host_engine({"HOME": str(tmp_path / "home")}).source == "docker context podman"


def test_a_context_with_tls_files_keeps_them(tmp_path):
    cfg = docker_config(tmp_path / "cfg", "remote", {"remote": "tcp://203.0.113.9:2376"})
    tls = cfg / "contexts" / "tls" / hashlib.sha256(b"remote").hexdigest() / "docker"
    tls.mkdir(parents=True)
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tls / name).write_text("x")
    e = host_engine({"DOCKER_CONFIG": str(cfg)})
    assert e.tls.cert == (str(tls / "cert.pem"), str(tls / "key.pem")) and e.tls.ca_cert == str(tls / "ca.pem")
    assert e.tls.verify is True


@pytest.mark.parametrize("broken,needle", [
    (lambda cfg: (cfg / "config.json").write_text("{not json"), "config.json: the docker CLI's config is not a JSON"),
    (lambda cfg: (cfg / "config.json").write_text('{"currentContext": "gone"}'),
     "docker context 'gone' (the current one) has no"),
])
def test_a_broken_docker_config_is_one_line(tmp_path, broken, needle):
    cfg = docker_config(tmp_path / "cfg", None, {})
    broken(cfg)
    with pytest.raises(UserError) as ei:
        host_engine({"DOCKER_CONFIG": str(cfg)})
    assert "\n" not in str(ei.value) and needle in str(ei.value)


@pytest.mark.sandbox
def test_the_runner_and_its_docker_cli_reach_an_engine_on_another_socket(sandbox, host_docker, tmp_path, monkeypatch):
    """A sandbox node's dockerd listens on a socket of its own: named by a docker context (the way
    Colima's or Docker Desktop's is), the runner's SDK client and its docker CLI calls both reach
    that engine; DOCKER_HOST, set, wins over the context."""
    sock = node_env(sandbox, "node-1", "DOCKER_HOST")
    assert sock.startswith("unix://") and sock != DEFAULT_SOCKET
    with remotes(sandbox)["node-1"] as r:
        root = r.run("docker info --format '{{.DockerRootDir}}'").out.strip()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.delenv("RUNNER_HOST_DOCKER", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config(tmp_path / "cfg", "laptop", {"laptop": sock})))
    assert host_client().info()["DockerRootDir"] == root
    cli = subprocess.run([*host_engine().cli(), "info", "--format", "{{.DockerRootDir}}"], capture_output=True,
                         text=True, timeout=60)
    assert (cli.returncode, cli.stdout.strip()) == (0, root), cli.stderr
    monkeypatch.setenv("DOCKER_HOST", host_docker)
    assert host_client().info()["DockerRootDir"] != root
