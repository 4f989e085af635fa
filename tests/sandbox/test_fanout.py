"""Fan-out that holds (issue 15): one bounded pool for per-node work, a raised file-descriptor
limit, known_hosts read once, the Docker API on the verified SSH connection with no threads or
sockets of its own, and light sandbox nodes for measuring many nodes."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from runner.inventory import load_inventory
from tests.conftest import REPO, net_addr
from tests.support.runner_helpers import listed_commands, runner, runner_cmd


def test_per_node_work_is_bounded_by_default():
    from runner.core.fanout import parallel

    lock, active, peak = threading.Lock(), [0], [0]

    def one(_):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.5)  # long enough for every thread of an unbounded pool to be in here at once
        with lock:
            active[0] -= 1

    res = parallel(list(range(100)), one)
    assert len(res) == 100 and all(err is None for _, _, err in res)
    assert peak[0] <= 64, peak[0]
    peak[0] = 0
    parallel(list(range(20)), one, 3)
    assert peak[0] <= 3


def test_open_file_limit_is_raised_to_the_hard_limit():
    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); import runner.cli.main; "
            "runner.cli.main.main(['sandbox', '--dir', '/nonexistent/runner-test', 'status', '--json']); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    soft, hard = r.stdout.split()[-2:]
    assert soft == hard, r.stdout


def test_parallel_flag_is_accepted_everywhere(tmp_path, capsys):
    """Every command that works on an inventory's nodes (all that `runner --help` lists but
    `sandbox`) parses --parallel as the one bounded count: 0 is refused by that option's own check."""
    from runner.cli.main import main

    r = subprocess.run(runner_cmd("--help"), capture_output=True, text=True, cwd=REPO, timeout=60)
    commands = [c for c in listed_commands(r.stdout) if c != "sandbox"]
    assert {"check", "push", "sync", "up", "status", "ls", "logs", "down", "collect", "export", "profile"} <= set(commands)
    for cmd in commands:
        with pytest.raises(SystemExit) as exit_:
            main([cmd, "--parallel", "0", "-i", str(tmp_path / "none.yaml")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"runner {cmd}: error: argument --parallel: must be at least 1, got 0" in err, (cmd, err)


@pytest.mark.sandbox
def test_known_hosts_is_read_once_for_every_node(sandbox, monkeypatch):
    from runner.transport.ssh import connect_each

    inv = load_inventory(sandbox, with_job=False)
    kh = inv.nodes[0].known_hosts
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file, *a, **k):
        if str(file) == kh:
            opened.append(str(file))
        return real_open(file, *a, **k)

    try:  # parsed known_hosts files are kept per process: start from none
        from runner.inventory import hostkeys

        hostkeys._cache.clear()
    except ImportError:
        pass
    real_os_open = os.open

    def counting_os_open(file, *a, **k):  # known_hosts is read with os.open (non-blocking: a FIFO never hangs it)
        if str(file) == kh:
            opened.append(str(file))
        return real_os_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(os, "open", counting_os_open)
    remotes, failed = connect_each(inv.nodes)
    try:
        assert not failed and len(remotes) == 3
        assert len(opened) == 1, opened
    finally:
        for r in remotes.values():
            r.close()


@pytest.mark.sandbox
@pytest.mark.docker
def test_docker_api_rides_the_verified_ssh_connection(sandbox):
    from runner.transport.ssh import Remote

    inv = load_inventory(sandbox, with_job=False)
    with Remote(inv.nodes[1]).connect() as r:
        before = set(threading.enumerate())
        d = r.docker()
        assert d.version()["Version"]
        d.containers.list(all=True)
        d.images.list()
        # No thread started (one left over from an earlier test may end meanwhile: CI saw 3 -> 2).
        assert [t.name for t in set(threading.enumerate()) - before] == []
        assert not [t.name for t in threading.enumerate() if t.name.startswith("docker-fwd")]
        assert not hasattr(r, "_forward") or r._forward is None


@pytest.mark.sandbox
def test_light_sandbox_nodes_have_sshd_only(tmp_path, have_sshd, host_docker):
    state, inv = tmp_path / "light", tmp_path / "light.yaml"
    up = subprocess.run(runner_cmd("sandbox", "--dir", str(state), "up", "--nodes", "2", "--light", "--base-addr",
                                   net_addr(5, 11), "--inventory", str(inv)), capture_output=True, text=True,
                        cwd=REPO, timeout=120)
    try:
        assert up.returncode == 0, up.stderr
        st = subprocess.run(runner_cmd("sandbox", "--dir", str(state), "status", "--json"), capture_output=True,
                            text=True, cwd=REPO, timeout=60)
        import json

        rows = json.loads(st.stdout)
        assert [r["node"] for r in rows] == ["node-0", "node-1"] and all(r["sshd"] for r in rows)
        assert not list(state.glob("node-*/docker"))  # no engine data root: no engine of its own
        for cfg in state.glob("node-*/sshd_config"):
            assert "MaxSessions" not in cfg.read_text()  # a real sshd's default (10)
        ls = runner("ls", "-i", str(inv), "--json")
        assert ls.returncode == 0, ls.stderr
        doc = yaml.safe_load(Path(inv).read_text())
        assert [n["name"] for n in doc["nodes"]] == ["node-0", "node-1"]

        # `down` while a client still holds a session: the session's sshd processes ("sshd: root",
        # init's once the listener is gone) outlived the sandbox, six after every suite run.
        import psutil

        from runner.transport.ssh import Remote

        with Remote(load_inventory(inv, with_job=False).nodes[0]).connect() as r:
            assert r.run("echo held").out.strip() == "held"
            listener = int((state / "node-0" / "sshd.pid").read_text())
            sessions = psutil.Process(listener).children(recursive=True)
            assert sessions, "no session process to watch"
            down = subprocess.run(runner_cmd("sandbox", "--dir", str(state), "down"), capture_output=True, text=True,
                                  cwd=REPO, timeout=120)
            assert down.returncode == 0, down.stderr
            left = [p.pid for p in sessions if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            assert left == [], left
    finally:
        subprocess.run(runner_cmd("sandbox", "--dir", str(state), "down"), capture_output=True, cwd=REPO, timeout=120)
