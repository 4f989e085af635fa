"""job.registry against a real registry (Debian's docker-registry, on loopback, htpasswd auth) and
the sandbox nodes: they pull the job's tag instead of receiving a push, with the env_file's
credentials that never show in an argv, a log or the job's container; a registry that is down or
lacks the tag is one line naming the node, with nothing started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from runner.planning.plan import container_name
from tests import REPO
from tests.conftest import HOST_DOCKER, IN_CI, net_addr, require
from tests.support.runner_helpers import (
    build_scratch_image,
    containers_created,
    execs_of_sessions,
    finish_run,
    light_sessions,
    node_docker,
    node_workdir,
    parse_push,
    remotes,
    runner,
    runner_cmd,
    traced_cmd,
    up_detached,
    wait_for,
    write_job,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")
USER, PASSWORD = "trainer-bot", "pw-never-in-argv-5b1e"
REG_ADDR = net_addr(5, 1)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A registry server on REG_ADDR:5000 requiring USER/PASSWORD; its address."""
    binary, htpasswd = shutil.which("docker-registry"), shutil.which("htpasswd")
    if not (binary and htpasswd):
        if IN_CI:
            pytest.fail("docker-registry and htpasswd are required in CI (scripts/setup.sh installs them)")
        pytest.skip("docker-registry/apache2-utils missing (run scripts/setup.sh)")
    d = tmp_path_factory.mktemp("registry")
    pw = subprocess.run([htpasswd, "-niB", USER], input=PASSWORD, capture_output=True, text=True, check=True)
    (d / "htpasswd").write_text(pw.stdout)
    (d / "config.yml").write_text(
        "version: 0.1\nlog: {level: warn}\n"
        f"storage: {{filesystem: {{rootdirectory: {d / 'data'}}}}}\n"
        f"http: {{addr: '{REG_ADDR}:5000'}}\n"
        f"auth: {{htpasswd: {{realm: runner-test, path: {d / 'htpasswd'}}}}}\n")
    log = open(d / "registry.log", "wb")
    proc = subprocess.Popen([binary, "serve", str(d / "config.yml")], stdout=log, stderr=subprocess.STDOUT)
    try:
        import socket

        def up() -> bool:
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex((REG_ADDR, 5000)) == 0
        wait_for(up, 30)
        yield f"{REG_ADDR}:5000"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def host_push(registry: str, tag: str, tmp: Path) -> None:
    """docker login + push from this machine's engine, with a private DOCKER_CONFIG: the nodes'
    sessions (root's own ~/.docker here) must not find this login."""
    env = {**os.environ, "DOCKER_CONFIG": str(tmp / "docker-config")}
    subprocess.run(["docker", "-H", HOST_DOCKER, "login", "-u", USER, "--password-stdin", registry], input=PASSWORD,
                   text=True, capture_output=True, check=True, env=env)
    subprocess.run(["docker", "-H", HOST_DOCKER, "tag", tag, f"{registry}/{tag}"], check=True, capture_output=True)
    push = subprocess.run(["docker", "-H", HOST_DOCKER, "push", f"{registry}/{tag}"], capture_output=True, text=True,
                          env=env)
    assert push.returncode == 0, push.stderr


@pytest.fixture(scope="module")
def small_image(registry, tmp_path_factory):
    tag = f"runner-test-reg:{os.getpid()}"
    image_id = build_scratch_image(tag, [os.urandom(256 << 10), os.urandom(64 << 10)])
    host_push(registry, tag, tmp_path_factory.mktemp("login"))
    yield tag, image_id
    subprocess.run(["docker", "-H", HOST_DOCKER, "rmi", "-f", image_id], capture_output=True)


def env_file(tmp: Path, user: str = USER, password: str = PASSWORD) -> str:
    p = tmp / "secrets.env"
    p.write_text(f"RUNNER_REGISTRY_USER={user}\nRUNNER_REGISTRY_PASSWORD={password}\nHF_TOKEN=hf_x\n")
    return str(p)


def node_ids(sandbox: Path, tag: str) -> dict[str, str | None]:
    out = {}
    for name, r in remotes(sandbox).items():
        with r:
            res = r.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag])
            out[name] = res.out.strip() if res.rc == 0 else None
    return out


def test_nodes_pull_with_env_file_credentials_never_in_argv(sandbox, pushed, registry, small_image, tmp_path):
    tag, image_id = small_image
    job = write_job(tmp_path, image=tag, env_file=env_file(tmp_path), extra={"registry": registry})
    require("strace", bool(shutil.which("strace")), "strace is not installed")
    # Every process the push runs, here and in the nodes' SSH sessions, with its argv and
    # environment as it was exec'd (however short it lived); the nodes' sessions light meanwhile
    # (runner_helpers.light_sessions: traced, root's bashrc held one over 60 s under CI load).
    here, nodes = tmp_path / "execs-host.log", tmp_path / "execs-nodes.log"
    with light_sessions(sandbox), execs_of_sessions(sandbox, nodes):
        proc = subprocess.run(traced_cmd(here, runner_cmd("-v", "push", "-i", str(sandbox), "--job", str(job))),
                              capture_output=True, text=True, cwd=REPO, timeout=600)
    execs = [ln for f in (here, nodes) for ln in f.read_text().splitlines() if " execve(" in ln]
    assert any('"docker", "pull", "-q", ' in ln for ln in execs), "the nodes' pulls are not in the record"
    assert not [ln for ln in execs if "pyenv-rehash" in ln], "the traced sessions read root's bashrc"
    assert [ln for ln in execs if PASSWORD in ln or "dHJhaW5lci1ib3Q6" in ln] == []  # nor base64("trainer-bot:")
    assert proc.returncode == 0, proc.stderr
    rows = parse_push(proc.stdout)
    assert set(rows) == set(NODES) and all(r["action"] == "pulled" and r["tag"] == tag for r in rows.values()), rows
    assert node_ids(sandbox, tag) == dict.fromkeys(NODES, image_id)
    assert PASSWORD not in proc.stdout + proc.stderr
    for r in remotes(sandbox).values():  # the 0600 login was removed after the pull
        with r:
            assert r.run(["sh", "-c", "ls -d ~/.runner-registry-* 2>/dev/null | wc -l"]).out.strip() == "0"


def test_without_credentials_the_pull_is_refused_in_one_line(sandbox, pushed, registry, small_image, tmp_path):
    """The node has no docker login of its own: the registry's refusal, one line per node."""
    tag, _ = small_image
    job = write_job(tmp_path, image=tag, extra={"registry": registry})
    proc = runner("push", "-i", str(sandbox), "--job", str(job))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    for node in NODES:
        assert f"node {node}: job.registry {registry}: pulling {registry}/{tag} failed:" in line, line
    assert "no basic auth credentials" in line or "unauthorized" in line, line


@pytest.mark.parametrize("case", ["absent_tag", "registry_down", "wrong_password"])
def test_a_bad_registry_starts_nothing(sandbox, pushed, registry, small_image, tmp_path, case):
    tag, _ = small_image
    reg = registry if case != "registry_down" else f"{net_addr(5, 2)}:5000"  # nothing listens there
    image = f"runner-test-reg-absent:{os.getpid()}" if case == "absent_tag" else tag
    password = "wrong" if case == "wrong_password" else PASSWORD
    job = write_job(tmp_path, image=image, env_file=env_file(tmp_path, password=password), extra={"registry": reg})
    since = time.time()
    proc = runner("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(tmp_path / "logs"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errs = [ln for ln in proc.stderr.splitlines() if ln.startswith("runner: error:")]
    assert len(errs) == 1 and all(f"node {n}: job.registry {reg}: pulling {reg}/{image} failed:" in errs[0]
                                  for n in NODES), proc.stderr
    why = {"absent_tag": "not found", "registry_down": "connection refused", "wrong_password": "unauthorized"}[case]
    assert why in errs[0], errs[0]
    assert "started" not in proc.stdout
    assert containers_created(sandbox, since) == dict.fromkeys(NODES, [])  # none, not even a created one


# The job's view of its own container: its environment and the secrets file it was given.
CONTAINER_VIEW = r"""
import json, os, pathlib, time
out = pathlib.Path(os.environ['OUTPUT_DIR'])
f = pathlib.Path('/run/runner/secrets.env')
view = {'env': dict(os.environ), 'secrets_file': f.read_text() if f.exists() else None}
(out / f"view-{os.environ['NODE_NAME']}.json").write_text(json.dumps(view))
while not (out / 'finish').exists():  # until finish_run(): the test inspects the running container
    time.sleep(0.05)
"""


def test_registry_credentials_stay_out_of_the_jobs_container(sandbox, pushed, tmp_path):
    """RUNNER_REGISTRY_* are the runner's: a job whose env_file holds them gets HF_TOKEN, not them, in
    its environment and its secrets file, and neither shows in `docker inspect` of its container."""
    from runner.inventory import load_inventory

    job = write_job(tmp_path, env_file=env_file(tmp_path), extra={"command": ["python", "-c", CONTAINER_VIEW]})
    assert load_inventory(sandbox, job_path=str(job)).job.registry_auth() == (USER, PASSWORD)  # they are there
    run_id = up_detached(sandbox, job)
    try:
        views = {n: node_workdir(sandbox, n) / "runs" / run_id / f"view-{n}.json" for n in NODES}
        wait_for(lambda: all(v.is_file() for v in views.values()), 120)
        for n in NODES:
            view = json.loads(views[n].read_text())
            assert view["env"]["HF_TOKEN"] == "hf_x" and not [k for k in view["env"] if k.startswith("RUNNER_REGISTRY")]
            assert view["secrets_file"] == "HF_TOKEN=hf_x\n", view["secrets_file"]
            inspect = node_docker(sandbox, n, "inspect", container_name(run_id, n))
            assert inspect.returncode == 0, inspect.stderr
            assert json.loads(inspect.stdout)[0]["State"]["Running"]
            for secret in (PASSWORD, USER, "RUNNER_REGISTRY", "hf_x"):  # not even the job's own secret
                assert secret not in inspect.stdout, (n, secret)
        finish_run(sandbox, run_id)
    finally:
        down = runner("down", run_id, "-i", str(sandbox))
    assert down.returncode == 0, down.stdout + down.stderr
