"""What a node reports back about a run, read as hostile: a job's metrics.jsonl, config.yaml and
elastic.jsonl (`runner status`, `runner collect`), the docker engine's description of a container,
a probe's profile.json and a run's partition.json (`runner profile`, `up --resume`). Each one below
ended in a traceback: JSON nested past Python's recursion limit (RecursionError is not a
ValueError), a step count past what a float holds, a container State that is not a mapping."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from runner.core.errors import UserError

DEEP = "[" * 5000  # 5 KB: within every read bound, 5x Python's default recursion limit
GOOD = '{"step": 2, "loss": 2.5, "step_time_s": 0.5, "tokens_per_s": 100}'


# --- runner status / collect: metrics.jsonl and config.yaml (contract/metrics.py) ---

def test_metrics_skip_a_line_nested_past_the_recursion_limit():
    from contract import metrics

    recs = metrics.parse(GOOD + "\n" + DEEP + "\n" + '{"step": 3, "loss": 1.5, "step_time_s": 0.5}')
    assert [r["step"] for r in recs] == [2, 3]
    assert str(metrics.progress(recs, 10)) == "step 3/10  loss 1.5000  ETA 0:00:04"
    assert metrics.summary(recs) == "final loss 1.5000 at step 3, tokens/s mean 100.0"


@pytest.mark.parametrize("config", [
    "train: {steps: " + "9" * 400 + "}",           # an int no float holds: total - step * mean time overflowed
    "train: {steps: " + str(1 << 62) + "}",
    "train:\n  steps: 10\nx: " + DEEP,              # YAML nested past the recursion limit
    "train: " + "{a: " * 5000,
])
def test_status_total_steps_from_a_hostile_config_yaml(config):
    from contract import metrics

    total = metrics.total_steps(config)
    assert total is None
    prog = metrics.progress(metrics.parse(GOOD), total)
    assert str(prog) == "step 2  loss 2.5000  100 tok/s"


def test_status_progress_takes_no_total_past_a_step():
    from contract import metrics

    assert metrics.total_steps("train: {steps: 12}") == 12
    prog = metrics.progress(metrics.parse(GOOD), 10 ** 400)  # a caller's total that no float holds
    assert prog is not None and prog.total is None and prog.eta_s is None


# --- runner status: elastic.jsonl (runner/planning/elastic.py) ---

def test_elastic_events_skip_a_line_nested_past_the_recursion_limit():
    from runner.planning.elastic import parse_events, render_events

    events = parse_events(DEEP + '\n{"event": "layout", "time": "t", "layout": {"pp": 2, "dp": 1, "tp": 1, '
                          '"nodes": ["a", "b"]}}')
    assert len(events) == 1
    assert render_events(events) == ["t  layout pp 2 x dp 1 x tp 1 on a, b"]


# --- runner status: the engine's description of a container (runner/backends/ssh/status.py) ---

@pytest.mark.parametrize("state", ["exited", ["exited"], None, 7])
def test_status_row_survives_a_container_state_that_is_not_a_mapping(state):
    from runner.backends.ssh.status import status_rows
    from runner.inventory import Inventory, Job, Node
    from runner.planning.plan import LABEL_RANK, LABEL_RUN

    node = Node("node-0", "127.0.0.1", role="master")
    inv = Inventory("inv.yaml", [node], Job())
    from runner.transport.docker_answers import NodeContainer

    c = NodeContainer(attrs={"Id": "c0" * 32, "Config": {"Labels": {LABEL_RUN: "r1", LABEL_RANK: "0"}}, "State": state})

    def no_file(*a, **k):
        raise OSError("no such file")

    remote = SimpleNamespace(home="/home/u", sftp=SimpleNamespace(open=no_file), read_text=lambda *a, **k: None)
    cl = type("Cl", (), {"inv": inv, "unreachable": {}, "__getitem__": lambda self, k: remote})()
    rows = status_rows(cl, {"node-0": ([c], {})}, "r1")
    assert [(r["node"], r["rank"], r["state"], r["exit_code"], r["uptime"]) for r in rows] == \
        [("node-0", 0, "exited" if state == "exited" else "unknown", None, "-")]  # an old engine's State: a word


# --- runner profile: a probe's profile.json, the local cache, a run's partition.json (runner/profile/) ---

def _probe_doc() -> dict:
    per = {"embed": 0.001, "block": 0.01, "head": 0.004}
    return {"time_s": per, "optim_s": per, "act_bytes": per, "train_bytes": per, "memory_available": 8e9,
            "boundary_bytes": 131072, "model_bytes": 1e6, "runtime_bytes": 2e8,
            "model": {"family": "qwen3", "num_layers": 5, "hidden_size": 64, "seq_len": 128, "microbatch": 4,
                      "microbatches": 4, "pp": 3, "dtype": "float32", "pp_schedule": "1f1b", "virtual_stages": 1}}


def _run_probes(tmp_path, monkeypatch, answer: str) -> dict:
    """measure.run_probes against one node whose probe wrote `answer` as its profile.json: the
    engine and the node are stand-ins, the reading and checking are the real code's."""
    from runner.inventory import Inventory, Job, Node
    from runner.profile import measure
    from runner.transport.probe import Probe

    node = Node("node-0", "127.0.0.1", role="master")
    inv = Inventory(str(tmp_path / "inv.yaml"), [node], Job())
    container = SimpleNamespace(start=lambda: None, remove=lambda force: None)
    remote = SimpleNamespace(
        node=node, listening_ports=set, makedirs=lambda p: None, put_bytes=lambda p, b: None, run=lambda cmd: None,
        docker=lambda: SimpleNamespace(containers=SimpleNamespace(create=lambda *a, **k: container)),
        read_text=lambda path: answer if path.endswith("/profile.json") else None)

    class Cl:
        def __init__(self):
            self.inv = inv

        def __getitem__(self, name):
            return remote

        def each(self, fn):
            return {node.name: fn(remote)}

        def map(self, items, fn):
            return [(i, fn(i), None) for i in items]

    monkeypatch.setattr(measure, "_wait", lambda containers, timeout: None)
    probes = {node.name: Probe(arch="amd64", home="/home/u")}
    return measure.run_probes(Cl(), [node], probes, {node.name: "img"}, {node.name}, set(), 0.1, 10)


def test_profile_probe_answer_in_shape_is_read(tmp_path, monkeypatch):
    docs = _run_probes(tmp_path, monkeypatch, json.dumps(_probe_doc()))
    assert docs["node-0"]["model"]["num_layers"] == 5


@pytest.mark.parametrize("answer", [DEEP, '{"model": ' + DEEP])
def test_profile_probe_answer_nested_past_the_recursion_limit_is_one_line(tmp_path, monkeypatch, answer):
    with pytest.raises(UserError) as err:
        _run_probes(tmp_path, monkeypatch, answer)
    assert str(err.value).startswith("profile: node node-0: /home/u/"), err.value
    assert "/profile.json: not a JSON object; not using it" in str(err.value), err.value


def test_profile_cache_entry_nested_past_the_recursion_limit_is_measured_again(tmp_path, monkeypatch):
    from runner.planning import profile_cache as cache

    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path))
    cache.save("node", "node-1", "k", _probe_doc())
    assert cache.load("node", "node-1", "k") == _probe_doc()
    (tmp_path / "node-node-1-k.json").write_text(DEEP)
    assert cache.load("node", "node-1", "k") is None


def test_resume_partition_json_nested_past_the_recursion_limit_is_one_line():
    from runner.inventory import Inventory, Job, Node
    from runner.profile.auto import pin_auto_partition

    master = Node("node-0", "127.0.0.1", role="master")
    inv = Inventory("inv.yaml", [master], Job(args=["--parallel.partition", "auto"]))
    reader = SimpleNamespace(read_text=lambda path: '{"spec": ' + DEEP)
    cl = type("Cl", (), {"inv": inv, "__getitem__": lambda self, k: reader})()
    with pytest.raises(UserError) as err:
        pin_auto_partition(cl, {}, lambda n: "/wd/runs/r1", resume=True)
    assert str(err.value).startswith("node node-0: /wd/runs/r1/partition.json: spec None is not custom:"), err.value
    assert inv.job.args == ["--parallel.partition", "auto"]


@pytest.mark.parametrize("kept", ['[1, 2]', '"rank"', DEEP, '{"rank": "0\\u001b[2J"}'])
def test_logs_of_a_finished_run_survive_a_kept_status_file_of_any_shape(tmp_path, capsys, kept):
    """runner logs of a gone container reads the kept runner-status.json: the run dir's copy, which
    the job could write (a list ended in AttributeError, deep nesting in RecursionError)."""
    from runner.backends.ssh.status import kept_logs

    d = tmp_path / "r1" / "node-0"
    d.mkdir(parents=True)
    (d / "container.log").write_bytes(b"hello\n")
    (d / "runner-status.json").write_text(kept)
    out = "".join(f"{ln}\n" for ln in kept_logs("r1", str(tmp_path), None, {}))
    assert out == "[node-0/?] hello\n"


@pytest.mark.parametrize("text", ["[" * 100_000, '{"rank": 0', "[1, 2]", ""])
def test_status_run_doc_of_any_shape_is_empty(text):
    """run_doc read runner-status.json, which the job can overwrite: nested past the recursion limit
    it ended `runner status`, `ls` and `logs` in a RecursionError."""
    from runner.backends.ssh.node_runs import run_doc
    from runner.inventory import Node

    remote = SimpleNamespace(node=Node("node-0", "127.0.0.1", workdir="/wd"), home="/home/u",
                             read_text=lambda path: text)
    assert run_doc(remote, "r1") == {}


# --- runner collect's report: the nodes' timeline pieces and metrics.jsonl (contract/bounded_json.py) ---

SEED = [{"rank": 0, "stage_idx": 0, "mb_idx": 0, "action": "FORWARD", "start_ns": 1, "end_ns": 2}]


@pytest.mark.parametrize("piece, why", [
    ("[" * 200_000, "nested deeper than Python reads"),                      # a traceback ended collect
    ("[" + "{}," * 2_500_000 + "{}]", "holds over 2,000,000 JSON values"),    # 7.5 MB: 3.5M dicts, ~250 MB parsed
    (None, "over the 64.0 MiB such a file may be"),                           # 100 MiB (sparse)
])
def test_collect_report_passes_over_a_hostile_timeline_piece_and_merges_the_rest(tmp_path, caplog, piece, why):
    from runner.delivery.collect_report import merge_timelines, render_plots

    run = tmp_path / "run"
    for node, rank in (("n0", 0), ("n1", 1)):
        (run / node).mkdir(parents=True)
        (run / node / f"timeline_batch2_rank{rank}.json").write_text(json.dumps([{**SEED[0], "rank": rank}]))
    bad = run / "n0" / "timeline_batch1_rank0.json"
    if piece is None:
        with open(bad, "wb") as fh:
            fh.truncate(100 << 20)
    else:
        bad.write_text(piece)
    (run / "n1" / "timeline_batch1_rank1.json").write_text(json.dumps([{**SEED[0], "rank": 1}]))
    merged = merge_timelines(run)
    assert [p.name for p in merged] == ["timeline_batch2_all.json", "timeline_batch2_all.trace.json"]
    assert any(why in r.getMessage() and "timeline_batch1_rank0.json" in r.getMessage() for r in caplog.records)
    caplog.clear()
    made = render_plots(run)  # the bad piece's own Gantt: a warning naming it, not an exception
    assert run / "timeline_batch2_gantt.png" in made and not (run / "n0" / "timeline_batch1_gantt.png").exists()
    assert any("not rendered from" in r.getMessage() and "timeline_batch1_rank0.json" in r.getMessage()
               and why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_metrics_of_any_size_are_read_from_their_newest_64_mib_a_piece_at_a_time(tmp_path):
    """100 MiB of zeros without a newline, then a 5 MiB line, then records: the records are read,
    the rest left out, and reading holds about the 64 MiB it reads, never the file or the line whole."""
    import tracemalloc

    from contract import metrics

    p = tmp_path / "metrics.jsonl"
    with open(p, "wb") as fh:
        fh.truncate(100 << 20)
        fh.seek(0, 2)
        fh.write(b"\n" + GOOD.encode() + b"\n" + b"x" * (5 << 20) + b"\n" + b'{"step": 3, "loss": 1.5}\n')
    tracemalloc.start()
    try:
        recs = metrics.read(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r["step"] for r in recs] == [2, 3]
    assert peak < 80 << 20, f"{peak / 2**20:.0f} MiB held reading a 105 MiB file"
    small = tmp_path / "small.jsonl"
    small.write_text(GOOD + "\n" + DEEP + "\n" + '{"step": 3, "loss": 1.5}')  # the last line still being written
    assert [r["step"] for r in metrics.read(small)] == [2, 3]
    assert [r["step"] for r in metrics.read(small, max_bytes=30)] == [3]  # a tail starts inside a line: skipped


def test_tail_lines_equals_splitting_the_tail_whole_for_any_pieces(tmp_path, monkeypatch):
    """tail_lines reads a piece at a time; what it returns must equal the tail split at once (the
    first, cut line and lines over max_line left out), whatever the piece size: 3,000 random files."""
    import random

    from contract import bounded_json

    def whole(data: bytes, max_bytes: int, max_line: int) -> list[bytes]:
        start = max(0, len(data) - max_bytes)
        seg = data[start:]
        parts = seg.split(b"\n") if seg else []
        parts = parts[1:] if start > 0 else parts
        parts = parts[:-1] if seg.endswith(b"\n") else parts
        return [p for p in parts if len(p) <= max_line]

    rng = random.Random(1)
    p = tmp_path / "f"
    for _ in range(3000):
        data = bytes(rng.choice(b"ab\n") for _ in range(rng.randint(0, 60)))
        p.write_bytes(data)
        max_bytes, max_line = rng.randint(1, 70), rng.randint(1, 10)
        monkeypatch.setattr(bounded_json, "PIECE", rng.randint(1, 8))
        assert bounded_json.tail_lines(p, max_bytes, max_line)[0] == whole(data, max_bytes, max_line), \
            (data, max_bytes, max_line, bounded_json.PIECE)
