"""A node that answers slowly on purpose: one byte at a time, each just inside the wait between
reads. Every bound on what a node sends is also a bound on how long it takes: the runner gives up
at the command's timeout, not at the 8 MiB output cap (at one byte a second, three months).

What the node does here never ends by itself, or only long after the limit the test waits for, so
a call that returns at all was ended by the bound under test, and the error it ends with names that bound. Each call
runs in a thread with a generous limit (HANG_S) that fails the test only when the bound never
fires: no test compares how long a call took with a constant, which a busy machine would fail."""

from __future__ import annotations

import threading

import pytest

from runner.core.errors import UserError
from runner.transport import sftp
from runner.transport.ssh import Remote
from tests.support.hostile_node import HostileNode

TRICKLE = "while :; do printf .; sleep 0.3; done"  # a byte every 0.3 s, forever
HANG_S = 120  # far past every bound tested here (2-3 s), far short of what the node would take


def _bounded(fn, limit: float = HANG_S):
    """fn() in a thread: its result or exception, or a failure once limit passed (the defect this
    file tests is a hang: it must fail the test, not hang the suite)."""
    out: list = []

    def go() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        pytest.fail(f"still blocked after {limit:.0f} s")
    return out[0]


def test_a_command_that_trickles_output_times_out_at_its_timeout(tmp_path):
    with HostileNode(tmp_path / "node", fourth=31) as node, Remote(node.node()).connect() as r:
        got = _bounded(lambda: r.run(TRICKLE, timeout=2))
        assert isinstance(got, UserError), got
        assert "command timed out after 2s" in str(got), got
        assert r.run("echo ok", timeout=10).out == "ok\n"  # the connection still serves the next command


def test_a_command_that_trickles_stderr_times_out_too(tmp_path):
    with HostileNode(tmp_path / "node", fourth=32) as node, Remote(node.node()).connect() as r:
        got = _bounded(lambda: r.run(f"({TRICKLE}) >&2", timeout=2))
        assert isinstance(got, UserError) and "timed out after 2s" in str(got), got


def test_a_command_that_never_reads_its_stdin_times_out_at_its_timeout(tmp_path):
    """Sending stdin was outside the deadline: a node that takes none of it (or takes it a byte at
    a time) held the runner until paramiko's wait between sends ended, in a raw socket.timeout."""
    with HostileNode(tmp_path / "node", fourth=39) as node, Remote(node.node()).connect() as r:
        # The limit is under the sleep's 60 s: waiting the node out is a failure, not a pass.
        got = _bounded(lambda: r.run("sleep 60", stdin=b"x" * (16 << 20), timeout=2), 45)
        assert isinstance(got, UserError) and "command timed out after 2s: sleep 60" in str(got), repr(got)
        assert r.run("echo ok", timeout=10).out == "ok\n"


def test_an_sftp_answer_trickled_byte_by_byte_fails_at_the_limit_and_the_next_read_works(tmp_path, monkeypatch):
    monkeypatch.setattr(sftp, "SFTP_SILENCE_S", 1.5)  # each trickled byte (0.2 s apart) is well inside it
    node = HostileNode(tmp_path / "node", fourth=33)
    (tmp_path / "node" / "home" / "big").write_bytes(b"x" * 4096)  # its answer: 20 min at 0.2 s a byte
    (tmp_path / "node" / "home" / "small").write_text("ok")
    with node, Remote(node.node()).connect() as r:
        node.trickle_over = 1000
        got = _bounded(lambda: r.read_text(str(tmp_path / "node" / "home" / "big")))
        assert isinstance(got, UserError), got
        assert "an SFTP answer took over 2s" in str(got) and str(got).startswith("node "), got
        assert r.read_text(str(tmp_path / "node" / "home" / "small")) == "ok"  # a fresh session


def test_a_stream_that_moves_a_byte_at_a_time_is_stalled(tmp_path):
    """The stall was 'no byte for stall_s': a node sending one byte inside it kept a collect open for ever."""
    from runner.transport import stream

    out = tmp_path / "out.bin"
    with HostileNode(tmp_path / "node", fourth=34) as node, Remote(node.node()).connect() as r:
        got = _bounded(lambda: stream.ssh_stream(r, "while :; do printf .; sleep 0.1; done",
                                                 [["sh", "-c", f"cat > {out}"]], upload=False, stall_s=1.5))
    assert not isinstance(got, BaseException), got
    assert got.stalled and 0 < got.moved < stream.STALL_BYTES, got  # ended by the stall watch, by its own count


def test_collect_stops_a_tar_stream_past_what_was_listed(tmp_path):
    """The node adds a 100 MiB member nobody asked for; the local tar unpacked all of it. Now the stream
    stops at the listed bytes plus the bound's slack, and the node is named."""
    from runner.delivery.collect_files import GROWTH, stream_tar, tar_bound

    rd = tmp_path / "node" / "home" / "rd"
    rd.mkdir(parents=True)
    (rd / "a.txt").write_text("hello")
    with open(rd / "junk.bin", "wb") as fh:
        fh.truncate(GROWTH + (36 << 20))  # sparse on the node; 100 MiB in the stream
    node = HostileNode(tmp_path / "node", fourth=35)
    node.rewrite = lambda c: c.replace("-cf -", "-cf - --add-file=junk.bin") if "tar --null" in c else c
    staging = tmp_path / "staging"
    batch = [("a.txt", type("St", (), {"st_size": 5})())]
    with node, Remote(node.node()).connect() as r:
        with pytest.raises(UserError) as err:
            stream_tar(r, str(rd), ["a.txt"], staging, max_bytes=tar_bound(batch))
    assert str(err.value).startswith(f"node evil: the stream of files from {rd} went past 64 MiB, the 1 listed files'")
    written = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    assert written <= tar_bound(batch), written
    assert tar_bound(batch) == 5 + 1024 + 512 + 511 + 1024 + 10240 + GROWTH



def _node_tree(tmp_path, files: dict[str, bytes]):
    rd = tmp_path / "node" / "home" / "rd"
    for rel, data in files.items():
        (rd / rel).parent.mkdir(parents=True, exist_ok=True)
        (rd / rel).write_bytes(data)
    return rd


@pytest.mark.parametrize("sends", ["junk", "dir"])
def test_collect_unpacks_only_the_files_it_asked_for(tmp_path, sends, monkeypatch):
    """Within the bound (the listed bytes + 64 MiB for growing logs) the local tar unpacked every
    member the node sent: here a 1 MiB junk.bin and a link nobody asked for, or the one name asked
    for sent as a directory with a file inside. Only the requested names are unpacked now, and only
    as regular files (verification reports the directory as 'not transferred as a regular file')."""
    from runner.delivery.collect_files import stream_tar, tar_bound

    rd = _node_tree(tmp_path, {"a.txt": b"hello", "junk.bin": b"j" * (1 << 20), "other/a.txt/inner": b"i" * 1000})
    (rd / "lnk").symlink_to("/etc")
    node = HostileNode(tmp_path / "node", fourth=37)
    node.rewrite = (lambda c: c.replace("-cf -", "-cf - --add-file=junk.bin --add-file=lnk")) if sends == "junk" else \
        (lambda c: c.replace(f"cd {rd} ", f"cd {rd}/other "))
    staging, cwd = tmp_path / "staging", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a tar told -C after its names unpacks them here
    with node, Remote(node.node()).connect() as r:
        stream_tar(r, str(rd), ["a.txt"], staging, max_bytes=tar_bound([("a.txt", type("St", (), {"st_size": 5})())]))
    assert any("tar --null" in c for c in node.commands), node.commands
    got = sorted(str(p.relative_to(staging)) for p in staging.rglob("*"))
    assert got == (["a.txt"] if sends == "junk" else []) and not any(cwd.iterdir()), got
    if sends == "junk":
        assert (staging / "a.txt").read_bytes() == b"hello"


def test_collect_a_listed_file_gone_from_the_node_is_left_to_verification(tmp_path, monkeypatch):
    """A file deleted on the node since the listing (a rotated checkpoint) is not in the stream (GNU
    tar told the names to unpack said 'Not found in archive', exit 2): not a failed batch, the file
    is absent from staging and verification counts it as vanished; the others arrive."""
    from runner.delivery.collect_files import stream_tar

    rd = _node_tree(tmp_path, {"a.txt": b"hello", "sub/b.txt": b"bee"})
    staging, cwd = tmp_path / "staging", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with HostileNode(tmp_path / "node", fourth=38) as node, Remote(node.node()).connect() as r:
        stream_tar(r, str(rd), ["a.txt", "gone.bin", "sub/b.txt"], staging)
    assert sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file()) == ["a.txt", "sub/b.txt"]
    assert not any(cwd.iterdir())
    assert (staging / "sub" / "b.txt").read_bytes() == b"bee"


def test_collect_summary_shows_a_jobs_terminal_controls_as_text(tmp_path, capsys):
    """collect's summary printed lines made from the job's metrics.jsonl as they were: a `step` could
    carry a clipboard write (OSC 52), a title change and a line erase."""
    import json

    from runner.delivery.collect_files import report

    (tmp_path / "node-0").mkdir()
    (tmp_path / "node-0" / "metrics.jsonl").write_text(json.dumps(
        {"loss": 1.0, "step": "\u001b]52;c;cm0gLXJmIH4K\u0007\u001b]0;owned\u0007\r\u001b[2K"}) + "\n")
    report([], tmp_path, no_plots=True)
    out = capsys.readouterr().out
    assert "final loss 1.0000" in out, out
    assert not any(c in out for c in "\x1b\x07\r"), repr(out)
    assert "final loss 1.0000 at step ?  (" in out, repr(out)  # a step that is not an integer is not shown


@pytest.mark.parametrize("record", [
    '{"step": 3, "loss": 1.0, "step_time_s": NaN}', '{"step": 3, "loss": 1.0, "step_time_s": 1e308}',
    '{"step": 3, "loss": 1.0, "step_time_s": -1e308}', '{"step": 3, "loss": 1.0, "tokens_per_s": Infinity}',
    '{"step": 3, "loss": ' + "9" * 400 + '}', '{"step": 3, "loss": NaN}', '{"step": true, "loss": 1.0}',
])
def test_status_progress_survives_what_a_job_writes_in_its_metrics(record):
    """runner status ended in a traceback (ValueError, OverflowError) on these lines of metrics.jsonl."""
    from contract import metrics

    good = '{"step": 2, "loss": 2.5, "step_time_s": 0.5, "tokens_per_s": 100}'
    prog = metrics.progress(metrics.parse(good + "\n" + record), total=10)
    text = str(prog)
    assert text.startswith("step 3/10") or text.startswith("step 2/10  loss 2.5000"), text
    assert "ETA 0:00:0" in text or "ETA" not in text, text
    assert metrics.summary(metrics.parse(good + "\n" + record)).startswith("final loss "), record


@pytest.mark.parametrize("layout", ['"x"', '{"nodes": 3, "pp": 2}', '[1, 2]', 'null'])
def test_status_elastic_history_survives_any_layout_shape(layout):
    from runner.planning.elastic import parse_events, render_events

    lines = render_events(parse_events('{"event": "layout", "time": "t", "layout": ' + layout + '}'))
    assert len(lines) == 1 and "layout pp " in lines[0], lines


# --- up --resume's copy of a checkpoint file through this machine (runner/delivery/resume_sync.py) ---

def _fetched(tmp_path, content: bytes, listed: int, window: int | None = None, monkeypatch=None):
    from runner.delivery import resume_sync
    from tests.docker.test_node_output import traced_peak

    if window is not None:
        monkeypatch.setattr(resume_sync, "FETCH_WINDOW", window)
    src = tmp_path / "node" / "home" / "shard.distcp"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(content)
    local = tmp_path / "local.bin"
    with HostileNode(tmp_path / "node", fourth=36) as node, Remote(node.node()).connect() as r:
        got, peak = traced_peak(lambda: _bounded(lambda: resume_sync._fetch(r, str(src), str(local), listed)))
        for t in threading.enumerate():  # a short file: paramiko's thread may still be sending the window's reads
            if "_prefetch_thread" in t.name:
                t.join(10)
    return got, peak, local


def test_resume_fetch_memory_does_not_follow_the_size_a_node_lists(tmp_path):
    """A 10-byte file listed as 16 GiB: paramiko's prefetch(size) built 524,288 requests (50 MiB)
    before reading a byte; at the 16 TiB the listing allows, ~50 GiB."""
    got, peak, local = _fetched(tmp_path, b"0123456789", 1 << 34)
    assert got is None and local.read_bytes() == b"0123456789"  # short: the size check after names it
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB"


def test_resume_fetch_in_windows_copies_exactly_and_names_a_longer_file(tmp_path, monkeypatch):
    body = bytes(range(256)) * 4100 + b"tail"  # 1,049,604 bytes: four windows and a piece
    got, _, local = _fetched(tmp_path, body, len(body), window=256 << 10, monkeypatch=monkeypatch)
    assert got is None and local.read_bytes() == body
    got, _, _ = _fetched(tmp_path / "b", body, len(body) - 1, window=256 << 10, monkeypatch=monkeypatch)
    assert isinstance(got, UserError) and f"more than the {len(body) - 1} bytes listed" in str(got), got


# --- runner profile: a node's probe answer and a run dir's partition.json (runner/profile/doc_check.py) ---

def _probe_doc() -> dict:
    per = {"embed": 0.001, "block": 0.01, "head": 0.004}
    return {"time_s": per, "optim_s": per, "act_bytes": per, "train_bytes": per, "memory_available": 8e9,
            "boundary_bytes": 131072, "model_bytes": 1e6, "runtime_bytes": 2e8,
            "model": {"family": "qwen3", "num_layers": 5, "hidden_size": 64, "seq_len": 128, "microbatch": 4,
                      "microbatches": 4, "pp": 3, "dtype": "float32", "pp_schedule": "1f1b", "virtual_stages": 1},
            "link": {"latency_s": 1e-4, "bandwidth_Bps": 1e9}}


@pytest.mark.parametrize("path, value, why", [
    (("model", "family"), "\x1b]52;c;cm0K\x07[link=https://evil.example]click[/link]", "model.family is not a plain name"),
    (("time_s", "block"), float("nan"), "time_s needs a number >= 0"),
    (("time_s",), [1, 2], "time_s needs a number >= 0"),
    (("memory_available",), "8G", "memory_available is not a number >= 0"),
    (("model", "num_layers"), 10 ** 400, "model.num_layers is not a positive integer"),
    (("model",), "qwen3", "model is not a mapping"),
    (("link", "bandwidth_Bps"), 0, "link needs latency_s >= 0 and bandwidth_Bps > 0"),
])
def test_a_probe_answer_of_the_wrong_shape_is_refused_naming_node_and_field(path, value, why):
    from runner.profile.doc_check import node_doc, problem

    doc = _probe_doc()
    assert problem(doc, compute=True, link=True) is None
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(UserError) as err:
        node_doc(doc, "node-1", "/wd/profiles/ab12/profile.json", compute=True, link=True)
    msg = str(err.value)
    assert msg.startswith(f"profile: node node-1: /wd/profiles/ab12/profile.json: {why}"), msg
    assert "\x1b" not in msg


def test_a_cached_profile_of_the_wrong_shape_is_measured_again(tmp_path, monkeypatch):
    """The cache holds what a node once answered: a poisoned entry is not planned with again."""
    from runner.planning import profile_cache as cache
    from runner.profile import doc_check

    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path))
    bad = {**_probe_doc(), "model": {**_probe_doc()["model"], "family": "[bold]x"}}
    cache.save("node", "node-1", "k", bad)
    assert cache.load("node", "node-1", "k") == bad
    assert doc_check.problem(cache.load("node", "node-1", "k"), compute=True, link=False) == \
        "model.family is not a plain name (letters, digits, _ . + -)"


def test_profile_table_title_is_text_not_markup(capsys):
    from types import SimpleNamespace

    from runner.cli.profile import print_table

    doc = {**_probe_doc(), "node": "node-0"}
    doc["model"] = {**doc["model"], "family": "fam[link=https://evil.example]x[/link]"}  # had it got past the check
    print_table(SimpleNamespace(model=doc["model"], nodes=[doc], links=[], cached={}), None)
    assert "fam[link=https://evil.example]x[/link] 5 layers" in capsys.readouterr().out


@pytest.mark.parametrize("text", ['{"spec": "\\u001b]0;owned\\u0007\\u001b[2Kcustom:1,2"}', '{"spec": 7}', '"custom:0,2"',
                                  '{"spec": "custom:0,2 --train_steps 1"}', 'not json'])
def test_resume_refuses_a_recorded_split_that_is_not_one(text):
    from types import SimpleNamespace

    from runner.inventory import Inventory, Job, Node
    from runner.profile.auto import pin_auto_partition

    master = Node("node-0", "127.0.0.1", role="master")  # no connection: the reader below answers
    inv = Inventory("inv.yaml", [master], Job(args=["--parallel.partition", "auto"]))
    reader = SimpleNamespace(read_text=lambda path: text)
    cl = type("Cl", (), {"inv": inv, "__getitem__": lambda self, k: reader})()
    with pytest.raises(UserError) as err:
        pin_auto_partition(cl, {}, lambda n: "/wd/runs/r1", resume=True)
    assert str(err.value).startswith("node node-0: /wd/runs/r1/partition.json: spec "), err.value
    assert "\x1b" not in str(err.value) and inv.job.args == ["--parallel.partition", "auto"]
