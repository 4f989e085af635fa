"""The runs on a node: a job container created from its NodePlan; runs found the way every verb
finds them (containers by label, run dirs over SFTP with each one's runner-status.json); a run's
containers stopped, old run dirs pruned.
`up`, `status`/`ls`/`logs`, `down`, `collect` and the watcher all go through here."""

from __future__ import annotations

import logging
import posixpath
import stat
import sys

from contract import bounded_json, metrics
from runner.backends.ssh.run_owner import remove_dirs
from runner.core import runs
from runner.core.errors import UserError
from runner.core.fanout import DEFAULT_PARALLEL, parallel
from runner.core.node_output import visible
from runner.planning.paths import node_paths
from runner.planning.plan import LABEL_GRACE, LABEL_NODE, LABEL_RUN, NodePlan, docker_limits, extra_hosts
from runner.transport.cluster import Cluster
from runner.transport.sftp import listdir_within
from runner.transport.ssh import Remote

# The node's own copy of the job's output: Docker's json-file log keeps every byte unless the daemon
# sets max-size (Debian's and Docker's defaults do not), so a job printing without end filled the
# node's disk (a Pi's SD card). Where the daemon bounds it, or logs elsewhere, its settings stand.
NODE_LOG_MAX, NODE_LOG_FILES = "256m", "2"
log = logging.getLogger("runner")
METRICS_TAIL = 16384  # bytes read from the end of metrics.jsonl: the last records, for progress and ETA
STATUS_FILE = "runner-status.json"
# Entries of one workdir's runs/ listed before it is refused: a run a day for 270 years. A node that
# lists without end (never EOF) is stopped here, not when the runner's memory is gone.
RUN_DIRS_MAX = 100_000
# What of a runner-status.json is parsed and kept. Ours (runner/backends/ssh/run_end.py) holds ten
# values, a few more for each ',' or ':' in its command line; the job can rewrite it with any
# number (20 files of `{"a":[{},{},...]}` held 3.9 GB parsed). Kept per run dir: only the fields
# `status`, `ls`, `logs` and `down` read, each a number, null or a short string.
STATUS_MAX_VALUES = 10_000
STATUS_FIELDS = ("rank", "exit_code", "result", "image")
STATUS_TEXT_MAX = 1024  # characters of a string field kept (an image reference: at most a few hundred)


def create_container(remote: Remote, np: NodePlan):
    import docker

    d = remote.docker()
    # Bind strings, not docker-py's {src: ...} dict: one node path may be mounted at two places.
    # Paths are plain (runner/inventory/job_data.py): no ':' or ',' to split on.
    volumes = [f"{src}:{dst}:{'rw' if dst in np.writable else 'ro'}" for dst, src in np.mounts.items()]
    kwargs = docker_limits(np.cpus, np.memory)  # the node's cpus/memory from the inventory
    if np.user:
        kwargs["user"] = np.user  # the SSH user's uid:gid: what the run writes on the node is the user's
    # py-spy reads a stopped rank's stacks on a hang (contract/stacks.py): ptrace within the container only
    kwargs["cap_add"] = ["SYS_PTRACE"]
    if np.hosts or np.own_host:
        kwargs["extra_hosts"] = extra_hosts(np.hosts, np.own_host)  # c10d's address lookups answered locally (plan.hosts_of)
    if np.gpus:
        count = -1 if np.gpus == "all" else int(np.gpus)
        kwargs["device_requests"] = [docker.types.DeviceRequest(count=count, capabilities=[["gpu"]])]
    try:
        bound = log_bound(d, np.image, remote)
        if bound is not None:
            kwargs["log_config"] = bound
        return d.containers.create(np.image, np.command, name=np.container, labels=np.labels, environment=np.env,
                                   network_mode="host", ipc_mode="host", volumes=volumes, **kwargs)
    except docker.errors.ImageNotFound:
        raise UserError(f"node {np.node}: image {np.image} not present; run `runner push`") from None
    except docker.errors.APIError as exc:
        raise UserError(f"node {np.node}: docker refused to start {np.container}: {exc.explanation}") from None


_LOG_BOUNDS: dict[tuple[str, int], object] = {}  # (host, port) -> the LogConfig its engine's job containers get


def log_bound(d, image: str, remote: Remote):
    """The LogConfig bounding the job container's log on this node's engine, or None where its
    daemon's settings bound it already (or log elsewhere). Asked once per engine and process: a
    container of the job's image is created (never started), its merged HostConfig.LogConfig read
    (the daemon's driver and options, which `docker info` does not show), and removed, so that the
    job's own container is created once, with or without the bound."""
    import docker

    key = (remote.node.host, remote.node.port)
    if key not in _LOG_BOUNDS:
        bound = None
        try:
            probe = d.containers.create(image, ["true"], network_mode="none", labels={"io.runner.probe": "log-config"})
            try:
                if unbounded_log(probe.attrs):
                    bound = docker.types.LogConfig(type="json-file",
                                                   config={"max-size": NODE_LOG_MAX, "max-file": NODE_LOG_FILES})
            finally:
                probe.remove(force=True)
        except docker.errors.DockerException as exc:  # the job's own create says what is wrong, if anything
            log.debug("node %s: log settings not asked (%s)", remote.node.name, exc)
        _LOG_BOUNDS[key] = bound
    return _LOG_BOUNDS[key]


def unbounded_log(attrs: object) -> bool:
    """Whether a created container's log, as its daemon merged it (HostConfig.LogConfig: the daemon's
    driver and options under the container's), is json-file without max-size: every byte kept."""
    host = attrs.get("HostConfig") if isinstance(attrs, dict) else None
    cfg = host.get("LogConfig") if isinstance(host, dict) else None
    opts = (cfg.get("Config") or {}) if isinstance(cfg, dict) else None
    return isinstance(opts, dict) and cfg.get("Type") == "json-file" and "max-size" not in opts


def run_containers(remote: Remote, run_id: str | None, all_: bool = True) -> list:
    """This node's containers of the run (of any run with run_id None). By node label too: an
    engine may serve more than one inventory node (light sandbox nodes share one)."""
    flt = {"label": [f"{LABEL_RUN}={run_id}" if run_id else LABEL_RUN, f"{LABEL_NODE}={remote.node.name}"]}
    return remote.docker().containers.list(all=all_, filters=flt)


def _grace_label(value: str | None) -> float:
    """The grace period `up` put on the container: seconds from 0 to a day, else the default 30 (the
    label is the node's word: NaN, 1e308, text)."""
    try:
        g = float(value) if value is not None else 30.0
    except ValueError:
        return 30.0
    return g if 0 <= g <= 86400 else 30.0


def stop_node(remote: Remote, run_id: str, grace: float | None, remove: bool = True) -> list[str]:
    """Stop (SIGTERM, then SIGKILL after grace) and remove this node's containers of the run."""
    gone = []
    containers = run_containers(remote, run_id)
    for c in containers:
        g = grace if grace is not None else _grace_label(c.labels.get(LABEL_GRACE))
        try:
            if c.status in ("running", "restarting", "paused"):
                # docker stop = SIGTERM, wait g seconds, SIGKILL: the trainer checkpoints on SIGTERM.
                c.stop(timeout=max(0, int(round(g))))
            if remove:
                c.remove(force=True)
            gone.append(c.labels.get(LABEL_NODE, c.name))
        except Exception as exc:  # noqa: BLE001 - already gone is fine (idempotent)
            if "No such container" not in str(exc) and "404" not in str(exc):
                raise
    if remove:
        remove_secrets(remote, run_id)
    return gone


def remove_secrets(remote: Remote, run_id: str) -> None:
    """The run's secrets file has no use once its containers are gone (or never came to be)."""
    try:
        remote.sftp.remove(node_paths(remote.node, remote.home).secrets(run_id))
    except OSError:
        pass


def stop_run(remotes: dict[str, Remote], run_id: str, grace: float | None = None,
             remove: bool = True, workers: int = DEFAULT_PARALLEL) -> tuple[list[str], list[str]]:
    """Every node, `workers` at a time. Returns (nodes where containers were stopped, errors)."""
    res = parallel(list(remotes.values()), lambda r: stop_node(r, run_id, grace, remove), workers)
    stopped, errors = [], []
    for r, val, err in res:
        if err is not None:
            lines = str(err).strip().removeprefix(f"node {r.node.name}: ").splitlines() or [type(err).__name__]
            errors.append(f"{r.node.name}: {lines[0]}")
        elif val:
            stopped.append(r.node.name)
    return stopped, errors


def latest_run(remotes: dict[str, Remote], workers: int = DEFAULT_PARALLEL) -> str | None:
    """The latest run (runner/core/runs.py) among the containers on any node."""
    ids: set[str] = set()
    for _, val, _ in parallel(list(remotes.values()), lambda r: run_containers(r, None), workers):
        for c in val or []:
            ids.add(c.labels.get(LABEL_RUN, ""))
    return runs.latest(ids)


def prune_runs(remote: Remote, keep: int) -> list[str]:
    """Remove this node's run dirs (with their secrets files and gate dirs) but the `keep` newest
    runner-made ones; the ids removed, oldest first."""
    made = sorted(i for i in node_run_dirs(remote) if runs.RUN_ID_RE.fullmatch(i))
    busy = {c.labels.get(LABEL_RUN) for c in run_containers(remote, None)}
    doomed = [i for i in made[:max(0, len(made) - keep)] if i not in busy]
    if not doomed:
        return []
    paths = node_paths(remote.node, remote.home)

    def image_of(left: list[str]) -> str | None:
        """A run's own image can reach files a root container of it wrote (else: the node's trainer image)."""
        images = (run_doc(remote, i).get("image") for i in reversed(left))
        return next((i for i in images if isinstance(i, str)), None)

    remove_dirs(remote, paths.runs, doomed, image_of)
    remote.run(["rm", "-rf", "--", *(paths.secrets(i) for i in doomed), *(paths.gates(i) for i in doomed)])
    return doomed


def node_runs(remote: Remote, docs: bool = False) -> tuple[list, dict[str, dict | None]]:
    """(containers of any run, run dirs) on one node."""
    return run_containers(remote, None), node_run_dirs(remote, docs)


def node_run_dirs(remote: Remote, docs: bool = False) -> dict[str, dict | None]:
    """{run id: None} for the run dirs on one node, over SFTP (no shell: an exec costs the node a
    login); docs=True reads each one's runner-status.json ({} when it has none). A runs/ of more
    than RUN_DIRS_MAX entries is the node's error, named in one UserError."""
    runs_dir = node_paths(remote.node, remote.home).runs
    try:
        entries = listdir_within(remote.sftp, runs_dir, RUN_DIRS_MAX)
    except OSError:
        return {}
    if entries is None:
        raise UserError(f"node {remote.node.name}: {runs_dir}: more than {RUN_DIRS_MAX:,} entries listed; "
                        "nothing taken from it")
    ids = sorted(e.filename for e in entries if stat.S_ISDIR(e.st_mode or 0) and runs.is_run_name(e.filename))
    return {rid: run_doc(remote, rid) if docs else None for rid in ids}


def run_doc(remote: Remote, run_id: str) -> dict:
    """The fields (STATUS_FIELDS) of the run's runner-status.json on the node that the verbs read
    ({} when it has none, or it does not parse within STATUS_MAX_VALUES values)."""
    text = remote.read_text(posixpath.join(node_paths(remote.node, remote.home).run(run_id), STATUS_FILE))
    try:
        doc = bounded_json.loads(text, STATUS_FILE, STATUS_MAX_VALUES) if text else {}
    except ValueError:  # the job's file: too many values, nested too deep, not JSON
        return {}
    return {k: doc[k] for k in STATUS_FIELDS if k in doc and _kept(doc[k])} if isinstance(doc, dict) else {}


def _kept(value: object) -> bool:
    """Whether a status field's value is kept: a number, null or a short string (the job's word:
    a field of megabytes, times every run dir, is not)."""
    if isinstance(value, str):
        return len(value) <= STATUS_TEXT_MAX
    return value is None or isinstance(value, (bool, int, float))


def gather(cl: Cluster, containers: bool = True, docs: bool = False) -> dict[str, tuple[list, dict[str, dict | None]]]:
    """{node: (containers, run dirs)} for every node that answered; the others are named on
    stderr, one line each, and left out (a dead node must not hide the live ones).
    containers=False lists run dirs only (collect: a run with files has a dir; the Docker API
    connection per node cost it a second)."""
    cl.warn_unreachable("left out")
    res = cl.map([cl[n.name] for n in cl.reachable()],
                 (lambda r: node_runs(r, docs)) if containers else (lambda r: ([], node_run_dirs(r, docs))))
    out = {}
    for r, val, err in res:
        out[r.node.name] = val if err is None else ([], {})
        if err is not None:
            said = str(err).strip().removeprefix(f"node {r.node.name}: ")  # an error that names the node itself
            first = visible((said.splitlines() or [type(err).__name__])[0])[:300]
            print(f"runner: warning: node {r.node.name}: {first} (left out)", file=sys.stderr)
    return out


def resolve_run(data: dict[str, tuple[list, dict]], run: str | None) -> str:
    """The run `run` names, or the latest (runner/core/runs.py), among every container and run dir found."""
    ids = {c.labels.get(LABEL_RUN) for cs, _ in data.values() for c in cs} | {r for _, ds in data.values() for r in ds}
    return runs.resolve({i for i in ids if i}, run, "the nodes' run dirs and containers")


def node_progress(remote: Remote, run_dir: str) -> tuple[str | None, metrics.Progress | None]:
    """(last metrics.jsonl line, progress) of a run dir, over SFTP: no shell, nothing to quote."""
    try:
        with remote.sftp.open(posixpath.join(run_dir, metrics.FILE), "rb") as fh:
            size = fh.stat().st_size or 0
            fh.seek(max(0, size - METRICS_TAIL))
            text = fh.read(METRICS_TAIL).decode(errors="replace")  # however much the node says is there
    except OSError:
        return None, None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if size > METRICS_TAIL:
        lines = lines[1:]  # the first may be cut
    total = metrics.total_steps(plain_yaml(remote.read_text(posixpath.join(run_dir, "config.yaml"))))
    return (lines[-1] if lines else None), metrics.progress(metrics.parse("\n".join(lines)), total)


def plain_yaml(text: str | None) -> str | None:
    """text, unless it holds YAML aliases: a node's file is parsed only without them (a 1 KB alias
    bomb expands to gigabytes in yaml.safe_load). The trainer's own config.yaml has none."""
    import yaml

    if text is None or ("*" not in text and "&" not in text):  # no alias can be written without them
        return text
    try:
        return None if any(isinstance(t, yaml.AliasToken) for t in yaml.scan(text, yaml.SafeLoader)) else text
    except yaml.YAMLError:
        return None
