"""Helpers for the runner's sandbox tests: run the CLI, write job files, look at nodes directly."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from runner.inventory import load_inventory
from runner.planning.plan import LABEL_RUN
from runner.transport.ssh import Remote
from tests import IMAGE, REPO

# Each rank records its env, its container's PID-1 start time (torchrun; host-kernel clock, so
# comparable across sandbox nodes) and a 1 MB file, then sleeps SLEEP seconds (a job that runs
# "long enough" to be stopped), or with HOLD=1 waits for the test's finish_run().
PROBE = r"""
import hashlib, json, os, time
def pid1_start():
    ticks = int(open('/proc/1/stat').read().rsplit(')', 1)[1].split()[19])
    btime = next(int(l.split()[1]) for l in open('/proc/stat') if l.startswith('btime'))
    return btime + ticks / os.sysconf('SC_CLK_TCK')
keys = ['RUN_ID','NODE_NAME','NODE_RANK','NNODES','MASTER_ADDR','MASTER_PORT','OUTPUT_DIR',
        'GLOO_SOCKET_IFNAME','NCCL_SOCKET_IFNAME','RANK','WORLD_SIZE','OMP_NUM_THREADS']
tok = os.environ.get('HF_TOKEN', '')
doc = {'env': {k: os.environ.get(k) for k in keys}, 'pid1_start': pid1_start(),
       'hf_token_sha256': hashlib.sha256(tok.encode()).hexdigest() if tok else None}
out = os.environ['OUTPUT_DIR']
json.dump(doc, open(f"{out}/probe-{os.environ['NODE_NAME']}.json", 'w'), indent=1)
open(f"{out}/blob-{os.environ['NODE_NAME']}.bin", 'wb').write(os.urandom(1 << 20))
print('probe', os.environ['NODE_NAME'], 'rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)
time.sleep(float(os.environ.get('SLEEP', '0')))
while os.environ.get('HOLD') == '1' and not os.path.exists(f"{out}/finish"):  # until finish_run()
    time.sleep(0.05)
print('done', os.environ['NODE_NAME'], flush=True)
"""


PUSH_RE = re.compile(r"^(\S+)\s+(\S+)\s+(skipped|layers|full|pulled|relay)\s+layers (\d+)/(\d+)\s+([\d.]+) MB of "
                     r"([\d.]+) MB\s+[\d.]+s\s+id \w+(?:\s+from (\S+))?$", re.M)


def parse_push(out: str) -> dict[str, dict]:
    """`runner push` table rows -> {node: {tag, action, sent, total, mb, image_mb, source}}; source:
    who sent it the layers ("host", or in a relay the node before it; "" when nothing moved)."""
    return {m[1]: {"tag": m[2], "action": m[3], "sent": int(m[4]), "total": int(m[5]), "mb": float(m[6]),
                   "image_mb": float(m[7]), "source": m[8] or ""} for m in PUSH_RE.finditer(out)}


# A measured runner process (runner_cmd while pytest --cov measures the tests): coverage started
# as its start-up hook would (process_startup: data saved at exit; pyproject.toml's parallel = true
# gives each process its own file beside the tests', which pytest-cov combines into the report),
# then its variables taken out of the runner's environment again, so that nothing the runner starts
# measures itself: `sbatch` hands the submitter's environment to the job, whose trainer ranks run
# this venv's Python (Slurm inventories without a login node), and ranks measured cost +40% CPU.
_MEASURED = """import os, runpy, coverage
saved = {{k: os.environ.get(k) for k in ('COVERAGE_PROCESS_START', 'COVERAGE_FILE')}}
os.environ.update(COVERAGE_PROCESS_START={config!r}, COVERAGE_FILE={data!r})
coverage.process_startup()
for k, v in saved.items():
    os.environ.pop(k) if v is None else os.environ.update({{k: v}})
runpy.run_module('runner', run_name='__main__', alter_sys=True)
"""


def _measured_start() -> list[str]:
    """The interpreter options that start `runner`: `-m runner`, or under measurement the same
    through _MEASURED. Not when every Python subprocess is measured already (COVER_SUBPROCESSES=1
    scripts/test.sh exports COVERAGE_PROCESS_START), nor without coverage running here, nor
    with COVER_RUNNER=0 (to time the runner, or see it as `ps` shows it unmeasured)."""
    if os.environ.get("COVER_RUNNER") == "0":
        return ["-m", "runner"]
    try:
        import coverage
    except ImportError:
        return ["-m", "runner"]
    cov = coverage.Coverage.current()
    if cov is None or os.environ.get("COVERAGE_PROCESS_START"):
        return ["-m", "runner"]
    # Absolute: the runner may run in another directory; coverage made its own path absolute
    # when it started, in pytest's start directory, which is where the data file resolves.
    data = os.path.join(_START_DIR, cov.config.data_file)
    return ["-c", _MEASURED.format(config=str(REPO / "pyproject.toml"), data=data)]


_START_DIR = os.getcwd()  # pytest's start directory (this module is imported while collecting)


def runner_cmd(*args: str) -> list[str]:
    """`python -m runner ARGS`, measured where the tests are (_measured_start): the runner's own
    code (runner/backends/ above all) is what these subprocesses run."""
    return [sys.executable, *_measured_start(), *args]


def runner(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(runner_cmd(*args), capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, **(env or {})})


def write_job(tmp: Path, name: str = "job.yaml", sleep: float = 0, image: str = IMAGE,
              env_file: str | None = None, grace: float = 5, extra: dict | None = None, hold: bool = False) -> Path:
    job = {"image": image, "command": ["python", "-c", PROBE], "master_port": "auto",
           "env": {"SLEEP": str(sleep), "OMP_NUM_THREADS": "1", "HOLD": "1" if hold else "0"}, "grace_period": grace}
    if env_file:
        job["env_file"] = env_file
    job.update(extra or {})
    p = tmp / name
    p.write_text(yaml.safe_dump({"job": job}))
    return p


def remotes(inventory: Path) -> dict[str, Remote]:
    inv = load_inventory(inventory, with_job=False)
    return {n.name: Remote(n).connect() for n in inv.nodes}


def run_containers(inventory: Path, run_id: str | None = None, running_only: bool = False) -> dict[str, list[str]]:
    """{node: [container names of the run]} straight from each node's engine (over SSH)."""
    flt = f"label={LABEL_RUN}={run_id}" if run_id else f"label={LABEL_RUN}"
    out = {}
    for name, r in remotes(inventory).items():
        with r:
            res = r.run(["docker", "ps", "--format", "{{.Names}}", "--filter", flt] + ([] if running_only else ["-a"]))
            out[name] = res.out.split()
    return out


# torchrun's own log lines after a job's output: a worker's agent whose exit barrier finds the
# master's store gone (the master's agent left first, a race under load) says so on stderr.
TORCHRUN_LOG = re.compile(r"\[?[WEI]\d{4} ")


def job_part(lines: list[str]) -> list[str]:
    """A job's own lines, up to the `end` it prints last; what follows may only be torchrun's log
    (checked)."""
    cut = lines.index("end") + 1 if "end" in lines else len(lines)
    assert not lines[cut:] or TORCHRUN_LOG.match(lines[cut]), lines[cut:cut + 3]
    return lines[:cut]


def wait_for(pred, timeout: float, interval: float = 0.25):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def node_workdir(inventory: Path, node: str) -> Path:
    inv = load_inventory(inventory, with_job=False)
    return Path(inv.node(node).workdir)


def finish_run(inventory: Path, run_id: str) -> None:
    """Let the ranks of a write_job(hold=True) run end: a finish file in every node's run dir."""
    for node in load_inventory(inventory, with_job=False).nodes:
        (Path(node.workdir) / "runs" / run_id / "finish").write_text("")


# --- the sandbox's processes, for failure tests (a node made unreachable, then brought back) ----

def sandbox_node(inventory: Path, node: str):
    """runner.sandbox.node.SandboxNode of an inventory written by `runner sandbox up` (its state dir holds the
    identity file the inventory names)."""
    from runner.sandbox.cluster import Sandbox

    inv = load_inventory(inventory, with_job=False)
    state = Path(inv.nodes[0].identity_file).parent
    return next(nd for nd in Sandbox(state).existing_nodes() if nd.name == node)


def sshd_procs(inventory: Path, node: str) -> list:
    """The node's sshd listener and every session process it forked: stopping them all is a
    network partition as the runner sees it (the node's dockerd and containers keep running)."""
    import psutil

    pid = int(sandbox_node(inventory, node).sshd_pid.read_text())
    top = psutil.Process(pid)
    return [top] + [p for p in top.children(recursive=True) if process_name(p).startswith("sshd")]


def process_name(p) -> str:
    """A process's name, or "" when it ended since it was listed (a session closing: seen under load)."""
    import psutil

    try:
        return p.name()
    except psutil.NoSuchProcess:
        return ""


def signal_sshd(inventory: Path, node: str, sig: int) -> int:
    """Signal the node's sshd and its sessions; returns how many were signalled. A session that
    ends between listing and signalling (the listener, continued first, reaps it) is skipped."""
    import psutil

    sent = 0
    for p in sshd_procs(inventory, node):
        try:
            p.send_signal(sig)
            sent += 1
        except psutil.NoSuchProcess:
            pass
    return sent


# strace options that record every execve, argv and environment in full, of a process and all it
# starts: the exact record of what ran, which a poll of /proc (missing short-lived processes) is not.
EXECVE_TRACE = ["-f", "-e", "trace=execve", "-e", "signal=none", "-s", "65536", "-v"]


def traced_cmd(log: Path, argv: list[str]) -> list[str]:
    """argv run under strace, every execve of it and its descendants written to `log`."""
    return ["strace", "--seccomp-bpf", *EXECVE_TRACE, "-o", str(log), "--", *argv]


@contextlib.contextmanager
def light_sessions(inventory: Path):
    """The sandbox's nodes, full ones included, start their SSH sessions light while in this block
    (runner.sandbox.cluster.LIGHT_ENV: bash does not read root's ~/.bashrc), put back on leaving.
    For execs_of_sessions: ptrace multiplies the bashrc's cost (here `pyenv init`, ~200 execs) about
    five times, and every sandbox node, both CI workers' included, shares its one rehash lock, so
    under CI load one traced session spent over 60 s in the bashrc (the API call's read timeout).
    What a session execs for the runner, and the environment it execs it with, are the same."""
    from runner.sandbox.cluster import LIGHT_ENV

    nodes = [sandbox_node(inventory, n.name) for n in load_inventory(inventory, with_job=False).nodes]
    configs = {nd.name: nd.sshd_config.read_text() for nd in nodes}

    def reload(text_of) -> None:
        """Each node's sshd re-reads its config (SIGHUP: it re-executes itself under the same pid);
        returns once each logged a listen after the signal."""
        def listens(nd) -> int:
            return (nd.root / "sshd.log").read_text().count("Server listening on")

        marks = {}
        for nd in nodes:
            text = text_of(configs[nd.name])
            if text == nd.sshd_config.read_text():
                continue
            nd.sshd_config.write_text(text)
            marks[nd.name] = listens(nd)
            os.kill(int(nd.sshd_pid.read_text()), signal.SIGHUP)
        for nd in nodes:
            if nd.name in marks:
                wait_for(lambda nd=nd: listens(nd) > marks[nd.name], 30, 0.05)

    def light(text: str) -> str:
        return re.sub(r"(?m)^(SetEnv .*)$", lambda m: m[1] if m[1].endswith(LIGHT_ENV) else m[1] + LIGHT_ENV, text)

    try:
        reload(light)
        yield
    finally:
        reload(lambda text: text)


@contextlib.contextmanager
def execs_of_sessions(inventory: Path, log: Path):
    """Every execve of every SSH session the sandbox's nodes accept while in this block (strace
    attached to each node's sshd listener, following what it forks), written to `log`. Entered once
    strace has attached to every listener; on leaving, strace detaches and the nodes go on."""
    pids = [sshd_procs(inventory, n.name)[0].pid for n in load_inventory(inventory, with_job=False).nodes]
    argv = ["strace", *EXECVE_TRACE, "-o", str(log)] + [a for pid in pids for a in ("-p", str(pid))]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        attached: set[str] = set()
        for line in proc.stderr:  # "strace: Process N attached", once per listener
            m = re.match(r"strace: Process (\d+) attached", line)
            if m:
                attached.add(m[1])
            if attached >= {str(p) for p in pids}:
                break
        assert attached >= {str(p) for p in pids}, f"strace did not attach: {proc.stderr.read()}"
        yield log
    finally:
        proc.send_signal(signal.SIGINT)  # detach: the listeners and their sessions go on
        proc.communicate(timeout=60)


def node_docker(inventory: Path, node: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The docker CLI against a sandbox node's own engine, through its socket on this machine (not
    over SSH: works while the node's sshd is stopped)."""
    nd = sandbox_node(inventory, node)
    return subprocess.run(["docker", "-H", nd.docker_host, *args], capture_output=True, text=True, timeout=timeout)


def container_events(inventory: Path, node: str, container: str, since: float) -> list[tuple[int, str, dict]]:
    """[(engine time in ns, action, attributes)] of one container on the node's engine since `since`
    (time.time()), in order: what happened to it (create, start, kill with its signal, die with its
    exit code, destroy), as the engine recorded it."""
    import json

    res = node_docker(inventory, node, "events", "--since", f"{since:.6f}", "--until", f"{time.time():.6f}",
                      "--filter", "type=container", "--filter", f"container={container}", "--format", "{{json .}}")
    assert res.returncode == 0, res.stderr
    evs = [json.loads(ln) for ln in res.stdout.splitlines() if ln.strip()]
    return [(e["timeNano"], e["Action"], e["Actor"]["Attributes"]) for e in evs]


def assert_others_stopped_then_lost_reclaimed(inventory: Path, run_id: str, since: float, lost: str,
                                              others: tuple[str, ...]) -> None:
    """From the engines' event logs: each of `others` was started, then stopped by the watcher's
    SIGTERM, died and was removed; the lost node's container was touched (killed, removed) only
    after all of that, once it answered again."""
    events = {n: container_events(inventory, n, f"runner-{run_id}-{n}", since) for n in (*others, lost)}
    gone = []
    for n in others:
        acts = [(a, attrs.get("signal")) for _, a, attrs in events[n] if a in ("start", "kill", "die", "destroy")]
        assert acts[:2] == [("start", None), ("kill", "15")], (n, acts)  # started, then the watcher's SIGTERM
        assert acts[-2:] == [("die", None), ("destroy", None)], (n, acts)
        gone.append(events[n][-1][0])
    reclaim = [t for t, a, _ in events[lost] if a in ("kill", "destroy")]
    assert reclaim and min(reclaim) > max(gone), events[lost]


def containers_created(inventory: Path, since: float) -> dict[str, list[str]]:
    """{node: names of the runner containers its engine created after `since` (time.time()), in
    order}, from the engine's event log: a container created and removed again counts, one that
    another test left behind does not. What "starts nothing" asserts on."""
    until = f"{time.time():.6f}"  # now: the command under test has returned
    out = {}
    for node in [n.name for n in load_inventory(inventory, with_job=False).nodes]:
        res = node_docker(inventory, node, "events", "--since", f"{since:.6f}", "--until", until, "--filter",
                          "type=container", "--filter", "event=create", "--filter", f"label={LABEL_RUN}",
                          "--format", "{{.Actor.Attributes.name}}")
        assert res.returncode == 0, res.stderr
        out[node] = res.stdout.split()
    return out


def node_engine_containers(inventory: Path, node: str, run_id: str) -> list[str]:
    """Container names of the run on the node's engine."""
    res = node_docker(inventory, node, "ps", "-a", "--format", "{{.Names}}", "--filter", f"label={LABEL_RUN}={run_id}")
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def up_detached(inventory: Path, job: Path, *extra: str) -> str:
    """`runner up --detach`; the run id."""
    up = runner("up", "-i", str(inventory), "--job", str(job), "--detach", *extra)
    assert up.returncode == 0, up.stdout + up.stderr
    return re.search(r"run (\S+) started", up.stdout)[1]


def unique_tag(name: str) -> str:
    """An image tag of this pytest session only: a second run of the suite beside this one (another
    checkout, CI next to a developer) shares the host engine and must not build over our tags."""
    return f"runner-test-{name}:{os.getpid()}"


def build_image(tag: str, files: dict[str, bytes | tuple[bytes, int]]) -> str:
    """Build an image on the host engine from an in-memory context ({name: data or (data, mode)},
    a "Dockerfile" among them); its id. The one in-memory build of the suite."""
    import io
    import tarfile

    import docker
    from tests.conftest import HOST_DOCKER

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, spec in files.items():
            data, mode = spec if isinstance(spec, tuple) else (spec, 0o644)
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tf.addfile(info, io.BytesIO(data))
    buf.seek(0)
    client = docker.DockerClient(base_url=HOST_DOCKER, version="auto", timeout=600)
    img, _ = client.images.build(fileobj=buf, custom_context=True, tag=tag, network_mode="host", rm=True)
    return img.id


def build_scratch_image(tag: str, layers: list[bytes]) -> str:
    """A FROM-scratch image on the host engine with one COPY (= one layer) per blob; its id.
    Random blobs make layers no node can have yet."""
    dockerfile = "FROM scratch\n" + "".join(f"COPY l{i} /l{i}\n" for i in range(len(layers)))
    return build_image(tag, {"Dockerfile": dockerfile.encode(), **{f"l{i}": blob for i, blob in enumerate(layers)}})


def torchrun_image(tag: str, torchrun: bytes, gate: bool = True) -> str:
    """This session's trainer image with `torchrun` replaced by the given script (a master that
    never listens, one held at a file, one deaf to signals, one that exits 2). Labelled gate "2"
    (runner.agents.gate, and the master under the `torchrun` on PATH: this script, not
    runner.agents.torchrun); gate=False labels it as an image without runner.agents.gate. Its id."""
    label = "LABEL io.runner.gate=2\n" if gate else "LABEL io.runner.gate=0\n"
    return build_image(tag, {"Dockerfile": f"FROM {IMAGE}\n{label}COPY torchrun /opt/venv/bin/torchrun\n".encode(),
                             "torchrun": (torchrun, 0o755)})


def remove_host_image(tag: str) -> None:
    """Remove a test image from the host engine (tests leave no images of theirs behind)."""
    import docker
    from tests.conftest import HOST_DOCKER

    try:
        docker.DockerClient(base_url=HOST_DOCKER, version="auto").images.remove(tag, force=True)
    except docker.errors.ImageNotFound:
        pass


def node_env(inventory: Path, node: str, var: str) -> str:
    """An environment variable as the node's sshd sets it for sessions (e.g. DOCKER_HOST)."""
    with remotes(inventory)[node] as r:
        return r.run(f"echo ${var}").out.strip()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_attached(sandbox: Path, job: Path, logs_dir: Path, *extra: str,
                   background: bool = False) -> tuple[subprocess.Popen, str]:
    """`runner up` in the foreground (as a user runs it), returned once it has printed its run id
    and every node's container of that run is running. background=True starts it as a shell
    script's `runner up ... &` does: with SIGINT ignored."""
    proc = subprocess.Popen(runner_cmd("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(logs_dir),
                                       *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=_ignore_sigint if background else None)
    run_id = None
    for line in proc.stdout:
        m = re.search(r"run (\S+) started", line)
        if m:
            run_id = m[1]
            break
    assert run_id, proc.stderr.read() if proc.poll() is not None else "no run id"
    wait_for(lambda: all(len(v) == 1 for v in run_containers(sandbox, run_id, running_only=True).values()), 30)
    return proc, run_id



def listed_commands(help_text: str) -> list[str]:
    """The commands `runner --help` lists, in its order."""
    block = help_text.split("positional arguments:", 1)[1].split("options:", 1)[0]
    return [m[1] for m in re.finditer(r"^    (\w+)\s+\S", block, re.M)]


def run_cli(*argv: str) -> tuple[int, str]:
    """`runner ARGV` in this process (no subprocess): (exit code, stdout)."""
    import io
    from contextlib import redirect_stdout

    from runner.cli.main import main as cli_main

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli_main(list(argv))
    return rc, buf.getvalue()


def shipped(name: str, tmp_path: Path) -> Path:
    """A copy of a shipped inventory (hosts/NAME), its job config swapped for a stub if that config
    does not exist in this checkout."""
    text = (REPO / "hosts" / name).read_text()
    m = re.search(r"config: (\S+)", text)
    if m and not (REPO / m.group(1)).exists():
        stub = tmp_path / "stub-config.yaml"
        stub.write_text("{}\n")
        text = text.replace(m.group(0), f"config: {stub}")
    p = tmp_path / name
    p.write_text(text)
    return p


def no_socket_env(tmp_path: Path) -> dict[str, str]:
    """Env for a child process in which creating any socket is fatal ('SOCKET OPENED'): a
    sitecustomize on its PYTHONPATH."""
    guard = tmp_path / "guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(
        "import socket\n"
        "class _NoSocket(socket.socket):\n"
        "    def __init__(self, *a, **k):\n"
        "        raise SystemExit('SOCKET OPENED')\n"
        "socket.socket = _NoSocket\n")
    return {**os.environ, "PYTHONPATH": f"{guard}{os.pathsep}{REPO}"}


def down_while_held(inventory: Path, run_id: str, out: dict[str, Path], point: str,
                    release_fn=None) -> subprocess.CompletedProcess:
    """`runner down RUN` of a run whose ranks (one per node, rank = the node's place in `out`) are
    held at `point` ("step-2", tests/support/trainer_run.py): once down's SIGTERM has reached every held
    rank, they are released (release_fn, default release) to write their preempt checkpoint.
    down's result, finished."""
    from tests.support.trainer_run import held, release

    down = subprocess.Popen(runner_cmd("down", run_id, "-i", str(inventory)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    wait_for(lambda: all(held(d, point, [i], "signalled") for i, d in enumerate(out.values())), 120)
    for d in out.values():
        (release_fn or release)(d, point)
    stdout, stderr = down.communicate(timeout=300)
    return subprocess.CompletedProcess(down.args, down.returncode, stdout, stderr)


def subcommands(parser) -> dict:
    """{name: parser} of the subcommands registered on an argparse parser."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs[0].choices) if subs else {}


_OPENED: list[list[str]] = []  # the lists of the opened_files() blocks now active


def _audit_open(event: str, args: tuple) -> None:
    if event == "open" and _OPENED and isinstance(args[0], (str, bytes, os.PathLike)):
        for seen in _OPENED:
            seen.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def opened_files():
    """Every path this process opens (or tries to: the audit event precedes the open) inside the
    block, from Python's `open` audit event. The hook is installed once; it records only inside
    such a block."""
    if not getattr(_audit_open, "installed", False):
        sys.addaudithook(_audit_open)
        _audit_open.installed = True
    seen: list[str] = []
    _OPENED.append(seen)
    try:
        yield seen
    finally:
        _OPENED.remove(seen)
