"""Master first, shown by cause and effect rather than by start order: the master's torchrun is
held (a test image whose torchrun waits for a release file on node rank 0), so its rendezvous
port provably does not listen before the release. No worker's torchrun may start before then:

- with the gate (this project's image, labelled io.runner.gate=2 here): the workers' containers run at
  once, but no go-file exists while the master is held, and each is written after the release;
- without it (an image of the user's own): the workers' containers are created but do not run
  while the master is held, and their PID 1 starts after the release.
The ranks then wait for a finish file, so the test reads the go-files before `up` tidies them.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from runner.planning.plan import LABEL_RUN
from tests.support.runner_helpers import (
    REPO,
    node_docker,
    node_workdir,
    remove_host_image,
    runner_cmd,
    torchrun_image,
    unique_tag,
    wait_for,
    write_job,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]

HOLD = b"""#!/bin/sh
# test image only: node rank 0's torchrun waits for /out/release, so its port cannot listen before
case " $* " in *" --node-rank 0 "*) while [ ! -e /out/release ]; do sleep 0.05; done;; esac
exec /opt/venv/bin/python -m torch.distributed.run "$@"
"""

# Each rank notes its container's PID-1 start (host-kernel clock) and waits for /out/finish.
WAIT = r"""
import json, os, time
ticks = int(open('/proc/1/stat').read().rsplit(')', 1)[1].split()[19])
btime = next(int(l.split()[1]) for l in open('/proc/stat') if l.startswith('btime'))
out = os.environ['OUTPUT_DIR']
json.dump({'pid1_start': btime + ticks / os.sysconf('SC_CLK_TCK')}, open(f"{out}/pid1-{os.environ['NODE_NAME']}.json", 'w'))
while not os.path.exists(f"{out}/finish"):
    time.sleep(0.05)
print('finished', os.environ['NODE_NAME'], flush=True)
"""

WORKERS = ("node-1", "node-2")


def _go_files(sandbox, run_id: str) -> dict[str, list[os.DirEntry]]:
    out = {}
    for node in WORKERS:
        d = node_workdir(sandbox, node) / "gates" / run_id
        out[node] = [e for e in os.scandir(d) if e.name.startswith("go-")] if d.is_dir() else []
    return out


def _containers(sandbox, node: str, *flts: str) -> list[tuple[str, str]]:
    """[(run id label, state)] of the containers on a node's engine matching every docker ps filter."""
    args = [x for f in flts for x in ("--filter", f)]
    res = node_docker(sandbox, node, "ps", "-a", *args, "--format", f'{{{{.Label "{LABEL_RUN}"}}}} {{{{.State}}}}')
    assert res.returncode == 0, res.stderr
    return [tuple(line.split()) for line in res.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("gated", [True, False], ids=["gate", "no-gate"])
def test_no_worker_torchrun_before_the_master_listens(sandbox, pushed, tmp_path, gated):
    tag = unique_tag("held-master-gate" if gated else "held-master")
    torchrun_image(tag, HOLD, gate=gated)
    job = write_job(tmp_path, image=tag, extra={"command": ["python", "-c", WAIT]})
    out_f, err_f = tmp_path / "up.out", tmp_path / "up.err"
    with out_f.open("w") as o, err_f.open("w") as e:
        proc = subprocess.Popen(runner_cmd("up", "-i", str(sandbox), "--job", str(job), "--logs-dir",
                                           str(tmp_path / "logs")), stdout=o, stderr=e, text=True, cwd=REPO)
    try:
        # `up` says "started" only once the master listens: find the run by its held master instead.
        # (a run's container: `up` also creates and removes one of the image to read the engine's log settings)
        run_id = wait_for(lambda: (_containers(sandbox, "node-0", f"ancestor={tag}", f"label={LABEL_RUN}")
                                   or [[None]])[0][0], 600)
        want = "running" if gated else "created"
        wait_for(lambda: all(_containers(sandbox, n, f"label={LABEL_RUN}={run_id}") == [(run_id, want)]
                             for n in WORKERS), 120)
        master_dir = node_workdir(sandbox, "node-0") / "runs" / run_id
        # The master is held: nothing may have told a worker to go, and without the gate no worker runs.
        assert _go_files(sandbox, run_id) == {n: [] for n in WORKERS}
        if not gated:
            assert all(_containers(sandbox, n, f"label={LABEL_RUN}={run_id}") == [(run_id, "created")]
                       for n in WORKERS)
        (master_dir / "release").write_text("")
        released = (master_dir / "release").stat().st_mtime
        if gated:
            go = wait_for(lambda: (lambda g: g if all(g.values()) else None)(_go_files(sandbox, run_id)), 300)
            for n in WORKERS:
                assert len(go[n]) == 1 and go[n][0].stat().st_mtime >= released, (n, go[n][0].stat(), released)
        for n in ("node-0", *WORKERS):
            pid1 = node_workdir(sandbox, n) / "runs" / run_id / f"pid1-{n}.json"
            wait_for(pid1.exists, 300)
            if n in WORKERS and not gated:
                # PID 1's start is counted in clock ticks (10 ms)
                assert json.loads(pid1.read_text())["pid1_start"] >= released - 0.011, n
        for n in ("node-0", *WORKERS):
            (node_workdir(sandbox, n) / "runs" / run_id / "finish").write_text("")
        proc.wait(timeout=300)
        out = out_f.read_text()
        assert proc.returncode == 0, out[-2000:] + err_f.read_text()[-2000:]
        for rank, n in enumerate(("node-0", *WORKERS)):
            assert f"[{n}/{rank}] finished {n}" in out
    finally:
        if proc.poll() is None:
            proc.terminate()  # an attached `up` stops its run on every node on SIGTERM
            proc.wait(timeout=120)
        remove_host_image(tag)
