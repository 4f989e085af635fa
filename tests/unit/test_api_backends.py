"""The backends' I/O modules run in this process against stand-ins for what they talk to (an
engine, a node, a cluster), for the paths the sandbox tests reach only through `runner`
subprocesses or not at all: the OCI bundle export, an elastic run's decisions between launches, a
root-owned run handed back, `--resume`'s choice of run, the Perseus server's port. Nothing here
opens a socket."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from runner.planning.paths import node_paths
from runner.transport.ssh import Result
from tests.unit.test_elastic_plan import inventory as elastic_inventory

# ---- container: oci: the image exported as a bundle ------------------------------------------

class _Image:
    id = "sha256:" + "ab" * 32
    attrs = {"Config": {"Env": ["PATH=/opt/venv/bin:/usr/bin"], "WorkingDir": "/workspace"}}


def _rootfs_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"#!/bin/sh\n"
        info = tarfile.TarInfo("opt/venv/bin/torchrun")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Engine:
    """This machine's engine as host_engine() gives it: one image, a container to export."""

    def __init__(self):
        self.exports = 0
        tar = _rootfs_tar()

        class Containers:
            def create(inner, image, command):  # noqa: N805 - a stand-in's own self is the engine's
                self.exports += 1
                return SimpleNamespace(export=lambda chunk_size: iter([tar[:100], tar[100:]]), remove=lambda force: None)

        self.containers = Containers()
        self.images = SimpleNamespace(get=lambda tag: _Image() if tag == "runner-trainer:oci" else None)

    def client(self):
        return self

    def unreachable(self):
        return "no engine"


def test_an_oci_bundle_is_exported_once_per_image_id(tmp_path, monkeypatch, capsys):
    from runner.backends.slurm import oci
    from runner.backends.slurm.shell import LocalShell
    from runner.delivery import host_engine
    from runner.inventory.slurm import load_slurm_inventory

    engine = _Engine()
    monkeypatch.setattr(host_engine, "host_engine", lambda: engine)
    p = tmp_path / "s.yaml"
    p.write_text(f"slurm: {{nodes: 1, partition: debug, container: oci, workdir: {tmp_path / 'w'}}}\n"
                 "job: {image: 'runner-trainer:oci'}\n")
    inv = load_slurm_inventory(str(p))
    bundle, env, workdir = oci.ensure_bundle(LocalShell(), inv, str(tmp_path / "w"))
    assert bundle == str(tmp_path / "w" / "bundles" / ("ab" * 8)) and engine.exports == 1
    assert (env, workdir) == (["PATH=/opt/venv/bin:/usr/bin"], "/workspace")
    assert (Path(bundle) / "rootfs" / "opt" / "venv" / "bin" / "torchrun").read_bytes() == b"#!/bin/sh\n"
    assert json.loads((Path(bundle) / "image.json").read_text())["id"] == _Image.id
    assert "oci: exporting runner-trainer:oci" in capsys.readouterr().out
    assert oci.ensure_bundle(LocalShell(), inv, str(tmp_path / "w"))[0] == bundle and engine.exports == 1
    p.write_text(p.read_text().replace("runner-trainer:oci", "runner-trainer:gone"))
    with pytest.raises(UserError, match=r"oci: image runner-trainer:gone is not on this machine's engine"):
        engine.images.get = lambda tag: (_ for _ in ()).throw(__import__("docker").errors.ImageNotFound("gone"))
        oci.ensure_bundle(LocalShell(), load_slurm_inventory(str(p)), str(tmp_path / "w"))


# ---- an elastic run between launches ----------------------------------------------------------

class _Node:
    def __init__(self, node, files: dict):
        self.node, self.files, self.abandoned = node, files, False

    def abandon(self):
        self.abandoned = True

    def makedirs(self, path, mode=0o755):
        pass

    def put_bytes(self, path, data, mode=0o644):
        self.files[path] = data

    def read_text(self, path, limit=None):
        return self.files.get(path, b"").decode() or None


class _Cluster:
    def __init__(self, inv):
        self.files: dict[str, bytes] = {}
        self.remotes = {n.name: _Node(n, self.files) for n in inv.nodes}

    def __getitem__(self, name):
        return self.remotes[name]

    def reconnected(self, name, remote):  # as runner.transport.cluster.Cluster's (a view of none)
        self.remotes[name] = remote

    def map(self, items, fn):
        out = []
        for it in items:
            try:
                out.append((it, fn(it), None))
            except Exception as exc:  # noqa: BLE001 - as runner.core.fanout.parallel reports it
                out.append((it, None, exc))
        return out


def test_an_elastic_run_shrinks_regrows_and_writes_its_history(tmp_path, monkeypatch, capsys):
    from runner.backends.ssh import elastic_loop
    from runner.planning.elastic import spec_of

    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "no-profiles"))
    monkeypatch.setattr(elastic_loop, "RETRY_S", 0.01)
    answers = {"node-2": False}

    class Remote:  # a lost node answers once the test says so
        def __init__(self, node, accept_new):
            self.node = node

        def connect(self):
            if not answers.get(self.node.name, True):
                raise UserError(f"node {self.node.name}: unreachable")
            return self

        def abandon(self):
            pass

    monkeypatch.setattr(elastic_loop, "Remote", Remote)
    monkeypatch.setattr(elastic_loop, "answers", lambda node, timeout: True)  # the knock: no socket here; connect() decides
    monkeypatch.setattr(elastic_loop, "stop_node", lambda r, run_id, grace: ["node-2"])
    inv = load_inventory(str(elastic_inventory(tmp_path)))
    el = elastic_loop.ElasticRun(inv, spec_of(inv, False), False, tmp_path / "logs")
    cl = _Cluster(inv)
    assert [n.name for n in el.inventory().nodes] == ["node-0", "node-1", "node-2"]
    assert "--checkpoint.replicas" in el.inventory().job.args
    homes = {n: "/home/u" for n in cl.remotes}
    el.started(cl, "r1", homes, None, elastic_loop.layout_split(el.inventory()))
    failed = SimpleNamespace(node="node-2", error="heartbeat lost", since=1.0, detected=2.0)
    gone = el.gone("node-2", failed, {})
    assert gone == {"node-2": "heartbeat lost"}
    assert el.gone(None, None, {}) == {} and not el.after_failure(cl, "r1", {}, None)
    assert el.after_failure(cl, "r1", gone, 4, failed, stopped=3.0)
    assert el.layout.nodes == ("node-0", "node-1") and el.layout.pp == 2 and cl["node-2"].abandoned
    assert [n.name for n in el.inventory().nodes] == ["node-0", "node-1"]
    el.started(cl, "r1", homes, "step-4", None, synced=5.0)
    answers["node-2"] = True  # back: the retry thread takes it, and with rejoin the layout is stopped
    assert el.back.wait(10) and el.returned == ["node-2"] and not el.lost
    el.regrow("r1", 6)
    assert el.layout.nodes == ("node-0", "node-1", "node-2")
    assert [e["event"] for e in el.events] == ["layout", "lost", "layout", "back"]
    history = [json.loads(x) for x in (tmp_path / "logs" / "elastic.jsonl").read_text().splitlines()]
    assert history == el.events[:3]  # the file: as of the last note (the next layout writes the rest)
    assert history[2]["from_step"] == 4 and history[2]["steps_lost"] == 0 and history[1]["last_step"] == 4
    run_dir = node_paths(inv.node("node-0"), "/home/u").run("r1")
    assert [json.loads(x) for x in cl.files[f"{run_dir}/elastic.jsonl"].decode().splitlines()] == history
    again = elastic_loop.ElasticRun(inv, spec_of(inv, False), False, tmp_path / "logs2")
    again.load_history(cl["node-0"], run_dir)
    assert [e["event"] for e in again.events] == ["layout", "lost", "layout"]
    # fewer nodes than min_nodes: the run stops, in one line, with its last event written
    answers.update({"node-1": False, "node-2": False})
    with pytest.raises(UserError, match=r"^run r1: lost node-1, node-2: 1 node\(s\) left \(node-0\), fewer than "):
        el.after_failure(cl, "r1", {"node-1": "gone", "node-2": "gone"}, 7)
    assert el.events[-1]["event"] == "stop"
    el.stop_retrying()
    el.close()
    assert "still unreachable: node-1 (gone), node-2 (gone)" in capsys.readouterr().err


# ---- a run made by an earlier runner's root containers ----------------------------------------

class _Engine2:
    def __init__(self, images: dict[str, dict]):
        self.ran: list[tuple] = []
        self.images = SimpleNamespace(
            get=lambda tag: SimpleNamespace(tags=[tag]) if tag in images else (_ for _ in ()).throw(
                __import__("docker").errors.ImageNotFound(tag)),
            list=lambda filters: [SimpleNamespace(tags=[t], labels=lb, attrs={"Created": "2026"}) for t, lb in images.items()])
        self.containers = SimpleNamespace(run=lambda image, argv, **kw: self.ran.append((image, argv, kw["volumes"])))


def test_a_root_owned_run_is_handed_back_and_removed_through_the_engine(tmp_path):
    from runner.backends.ssh import run_owner
    from runner.inventory import Node

    left = {"/w/runs/a": True}
    runs: list[list[str]] = []

    def run(argv, timeout=60):
        runs.append(argv)
        if argv[0] == "find":
            return Result(0, "/w/runs/r1/checkpoints/step-2/x\n", "")
        return Result(1, "", "rm: Permission denied")  # rm -rf as the user leaves root's files

    engine = _Engine2({"runner-trainer:latest": {"io.runner.gate": "3"}})
    remote = SimpleNamespace(node=Node("node-0", "127.0.0.1"), run=run, docker=lambda: engine,
                             stat=lambda p: object() if left.get(p) else None)
    first = run_owner.hand_back(remote, "/w/runs/r1", "gone:tag", 1000, 1000)
    assert first == "/w/runs/r1/checkpoints/step-2/x"
    assert engine.ran[-1] == ("runner-trainer:latest", ["-R", "1000:1000", "/runner-reclaim"],
                              {"/w/runs/r1": {"bind": "/runner-reclaim", "mode": "rw"}})
    run_owner.remove_dirs(remote, "/w/runs", ["a", "b"])
    assert engine.ran[-1][1] == ["-rf", "--", "/runner-reclaim/a"]  # only what the user's rm left
    nothing = SimpleNamespace(node=Node("node-1", "127.0.0.1"), run=run, docker=lambda: _Engine2({}), stat=lambda p: 1)
    with pytest.raises(UserError, match=r"^node node-1: cannot take back /w/runs/r1: .* no image to reach them with; "
                                        r"run `sudo chown -R 1000:1000 /w/runs/r1` on the node$"):
        run_owner.hand_back(nothing, "/w/runs/r1", None, 1000, 1000)


# ---- `up --resume`: which run -----------------------------------------------------------------

def test_resume_names_a_run_of_the_master_or_says_which_exist(monkeypatch):
    from runner.backends.ssh import node_runs, resume
    from runner.inventory import Node

    master = SimpleNamespace(node=Node("node-0", "127.0.0.1", workdir="/w"), home="/root")
    dirs = {"20260101-000000-aaaa": None, "20260102-000000-bbbb": None}
    monkeypatch.setattr(node_runs, "node_run_dirs", lambda r: dirs)
    assert resume.resume_run(master, "latest") == "20260102-000000-bbbb"
    assert resume.resume_run(master, "20260101") == "20260101-000000-aaaa"
    with pytest.raises(UserError, match=r"^--resume "):
        resume.resume_run(master, "2099")
    monkeypatch.setattr(node_runs, "node_run_dirs", lambda r: {})
    with pytest.raises(UserError, match=r"^--resume no previous run in /w/runs on node-0 \(the master\)$"):
        resume.resume_run(master, "latest")


# ---- job.perseus: the server's port on the master ----------------------------------------------

def test_the_perseus_port_is_free_and_never_the_masters():
    from runner.backends.ssh import perseus
    from runner.inventory import Node

    master = SimpleNamespace(node=Node("node-0", "127.0.0.1"), listening_ports=lambda: {29500, 29501})
    auto = SimpleNamespace(port="auto")
    port = perseus.choose_port(master, auto, "r1", 29502)
    assert port not in {29500, 29501, 29502}
    assert perseus.choose_port(master, SimpleNamespace(port=31000), "r1", 29502) == 31000
    with pytest.raises(UserError, match=r"^master node-0: job.perseus.port 29501 is in use"):
        perseus.choose_port(master, SimpleNamespace(port=29501), "r1", 29502)


# ---- push, sync, profile: what SshBackend hands to delivery and profile -----------------------

class _Nodes:
    """A connected Cluster as the verbs use it: each() over the nodes, closed on exit."""

    def __init__(self, inv, opened: list):
        self.inv = inv
        opened.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def each(self, fn):
        return {n.name: fn(SimpleNamespace(node=n, home="/home/u")) for n in self.inv.nodes}


def test_push_sync_and_profile_go_to_delivery_and_profile_with_the_backends_nodes(tmp_path, monkeypatch):
    from runner.backends.ssh import nodes_setup
    from runner.backends.ssh.backend import SshBackend
    from runner.delivery import push, sync
    from runner.profile import auto, measure

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("x")
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text("nodes:\n  - {name: n0, host: 192.0.2.1, role: master}\n  - {name: n1, host: 192.0.2.2, arch: amd64}\n"
                        f"job: {{image: 'x:1', args: [--a, '1'], sync: [{{src: {data}, dst: /data}}]}}\n")
    backend = SshBackend(load_inventory(str(inv_path)))
    opened: list = []
    backend.cluster = lambda partial=True, inventory=None: _Nodes(inventory or backend.inventory, opened)
    monkeypatch.setattr(nodes_setup, "probe", lambda r, addr, clock=True: SimpleNamespace(arch="arm64", home="/home/u"))
    calls: list = []
    monkeypatch.setattr(push, "push_to_nodes", lambda cl, arches, **kw: calls.append(("push", arches, kw)) or ["pushed"])
    assert backend.push(full=True, direct=True) == ["pushed"]
    assert calls[-1] == ("push", {"n0": "arm64", "n1": "arm64"}, {"force_full": True, "build": False, "relay": False})
    monkeypatch.setattr(sync, "sync_to_nodes", lambda cl, homes, trees: [(homes, [t.spec.dst for t in trees])])
    assert backend.sync() == [({"n0": "/home/u", "n1": "/home/u"}, ["/data"])]
    monkeypatch.setattr(measure, "profile_cluster", lambda cl, probes, **kw: (cl.inv.job.args, sorted(probes), kw))
    monkeypatch.setattr(auto, "plan_from_profile", lambda prof, inv: ("split", "uniform", inv.job.args))
    prof, split, uniform, problem = backend.profile(no_push=False, trainer_args=["--b", "2"], quiet=True)
    assert prof == (["--a", "1", "--b", "2"], ["n0", "n1"], {"refresh": False, "min_seconds": 2.0, "timeout": 900.0})
    assert (split, uniform, problem) == ("split", "uniform", ["--a", "1", "--b", "2"])
    assert calls[-1][2] == {"quiet": True} and backend.inventory.job.args == ["--a", "1"]  # the loaded job left as it was
    backend.profile(no_push=True)
    assert len(calls) == 2  # no push asked: none made


def test_the_newest_metrics_record_of_a_run_is_the_largest_step_any_node_has(monkeypatch):
    from runner.backends.ssh import node_runs, run_end

    lines = {"/r/n0": '{"step": 4, "loss": 1.0}', "/r/n1": '{"step": 7, "loss": 0.5}', "/r/n2": "not json",
             "/r/n3": None}
    monkeypatch.setattr(node_runs, "node_progress", lambda r, run_dir: (lines[run_dir], None))
    nodes = [SimpleNamespace(node=n, run_dir=f"/r/{n}") for n in ("n0", "n1", "n2", "n3")]
    cl = type("Cl", (), {"__getitem__": lambda self, k: k, "map": lambda self, items, fn: [(i, fn(i), None) for i in items]})()
    assert run_end.last_metrics(cl, nodes) == '{"step": 7, "loss": 0.5}'
    assert run_end.last_metrics(cl, nodes[2:]) is None
