"""A node's Docker engine that answers what no engine sends, through the runner's real SSH path
(tests/support/hostile_node.py, a real SSH server) to a FAKE engine (tests/support/fake_engine.py) in place of
`docker system dial-stdio`: the runner bounds every answer and checks what its models read
(runner/transport/docker_answers.py). Before, docker-py read any answer whole and indexed into it
as it came: tracebacks from `runner status`, memory as large as the node liked."""

from __future__ import annotations

import json
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from runner.backends.ssh.node_runs import run_containers
from runner.transport import docker_answers
from runner.transport.ssh import Remote
from tests.support.hostile_node import HostileNode

FAKE = (Path(__file__).resolve().parents[1] / "support" / "fake_engine.py")
CONTAINER = {"Id": "c0" * 32, "Name": "/runner-x", "Config": {"Labels": {"runner.run": "r1", "runner.rank": "0"}},
             "State": {"Status": "exited", "ExitCode": 3}}


def _engine(tmp_path: Path, answers: dict, fourth: int) -> HostileNode:
    spec = tmp_path / "answers.json"
    spec.write_text(json.dumps(answers))
    node = HostileNode(tmp_path / "node", fourth=fourth)
    node.rewrite = lambda c: f"{sys.executable} {FAKE} {spec}" if c == "docker system dial-stdio" else c
    return node


def _bounded(fn, seconds: float = 120):
    """fn()'s result or exception, or a TimeoutError once `seconds` passed: a limit far past the
    bounds tested (a few seconds) that fails a test only when a bound never fires."""
    box: list = []

    def run():
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else TimeoutError(f"still running after {seconds}s")


@pytest.mark.parametrize("change, labels, status, name, code", [
    ({"Config": "x"}, {}, "exited", "runner-x", 3),
    ({"Config": {"Labels": ["runner.run=r1"]}}, {}, "exited", "runner-x", 3),
    ({"Config": {"Labels": {"runner.run": 5, "runner.rank": "0", "7": None}}}, {"runner.rank": "0"}, "exited",
     "runner-x", 3),
    ({"State": [1]}, {"runner.run": "r1", "runner.rank": "0"}, "unknown", "runner-x", None),
    ({"State": {"Status": {"x": 1}, "ExitCode": "3"}}, {"runner.run": "r1", "runner.rank": "0"}, "unknown",
     "runner-x", None),
    ({"State": {"Status": "running\x1b]0;owned\x07", "ExitCode": 1e300}}, {"runner.run": "r1", "runner.rank": "0"},
     "unknown", "runner-x", None),
    ({"Name": 7}, {"runner.run": "r1", "runner.rank": "0"}, "exited", None, 3),
])
def test_container_fields_of_any_shape_read_as_nothing(tmp_path, change, labels, status, name, code):
    """docker-py: AttributeError ('str' has no .get), TypeError, a dict or escape sequence as the status."""
    c_attrs = {**CONTAINER, **change}
    with _engine(tmp_path, {"/containers/[^/]+/json": {"body": c_attrs}}, 51) as node, \
            Remote(node.node()).connect() as r:
        (c,) = run_containers(r, None)
        assert (c.labels, c.status, c.name, c.exit_code) == (labels, status, name, code)


@pytest.mark.parametrize("answer", [{"a": 1}, [1, 2], [{"Id": 5}], [{"Id": "../../images/x"}], "text"])
def test_a_malformed_container_list_is_one_engine_error(tmp_path, answer):
    """docker-py: TypeError, KeyError, or the node's id put into the next request's URL. Now one
    error naming the node: a DockerException where engine errors are caught, a UserError (one line,
    exit 2) where nothing catches it (`runner exec`), the node named once by `down`'s per-node list."""
    from runner.backends.ssh.node_exec import running_container
    from runner.backends.ssh.node_runs import stop_run
    from runner.core.errors import UserError

    with _engine(tmp_path, {"/containers/json": {"body": answer}}, 52) as node, Remote(node.node()).connect() as r:
        with pytest.raises(docker_answers.EngineAnswerError) as err:
            run_containers(r, None)
        with pytest.raises(UserError) as exec_err:
            running_container(r, None)
        stopped, errors = stop_run({"evil": r}, "20260101-000000-abcd")
    assert str(err.value).startswith("node evil: the engine's"), str(err.value)
    assert str(exec_err.value) == str(err.value)
    assert stopped == [] and errors == [str(err.value).replace("node evil: ", "evil: ", 1)], errors


@pytest.mark.parametrize("answer", [{"raw": "<html>502</html>"}, {"nest": 200_000}])
def test_an_answer_that_is_not_json_is_one_engine_error(tmp_path, answer):
    """docker-py: requests' JSONDecodeError; JSON nested past the recursion limit: RecursionError."""
    with _engine(tmp_path, {"/containers/json": answer}, 53) as node, Remote(node.node()).connect() as r:
        with pytest.raises(docker_answers.EngineAnswerError) as err:
            run_containers(r, None)
    assert "is not JSON" in str(err.value), str(err.value)


@pytest.mark.parametrize("chunked", [False, True])
def test_an_answer_past_the_bound_is_not_held(tmp_path, monkeypatch, chunked):
    """A 24 MiB listing against a 2 MiB bound (64 MiB in use), its length said first or not:
    docker-py held all of it, then its parsed copy."""
    monkeypatch.setattr(docker_answers, "MAX_ANSWER", 2 << 20)
    monkeypatch.setattr(docker_answers, "CHUNK", 64 << 10)
    answer = {"big_mb": 24, "chunked": chunked}
    with _engine(tmp_path, {"/containers/json": answer}, 54) as node, Remote(node.node()).connect() as r:
        r.docker()
        tracemalloc.start()
        try:
            with pytest.raises(docker_answers.EngineAnswerError) as err:
                run_containers(r, None)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    said = "node evil: the engine's answer to GET /v1.41/containers/json " + ("went past 2 MiB" if chunked else
                                                                              "is 24 MiB, over")
    assert str(err.value).startswith(said), str(err.value)
    assert peak < 8 << 20, peak


def test_an_answer_trickled_a_byte_at_a_time_is_given_up(tmp_path, monkeypatch):
    """Each read waited alone for the client's timeout (60 s): a byte every 59 s never ended. Here 3000 bytes
    0.2 s apart (10 minutes, past the test's wait) against a 2 s client timeout and ANSWER_S 1: given up
    after 3 s, with the real CHUNK (a read of 64 KiB waits for all of them: the time is checked by each
    read of the channel). That the call returned at all, with that bound's error, is the check."""
    monkeypatch.setattr(docker_answers, "ANSWER_S", 1.0)
    with _engine(tmp_path, {"/containers/json": {"raw": "x", "repeat": 3000, "trickle": 0.2}}, 55) as node, \
            Remote(node.node()).connect() as r:
        r.docker(timeout=2.0)
        got = _bounded(lambda: run_containers(r, None))
    assert isinstance(got, docker_answers.EngineAnswerError) and "took over 3s" in str(got), got
    assert str(got).startswith("node evil: the engine's answer to GET /v1.41/containers/json took over 3s"), got


def test_a_real_answer_reads_as_before(tmp_path):
    """...and costs no thread: the bounds are checked as the answer is read (tests/sandbox/test_fanout.py)."""
    with _engine(tmp_path, {}, 56) as node, Remote(node.node()).connect() as r:
        r.docker()
        threads = threading.active_count()
        (c,) = run_containers(r, None)
        assert threading.active_count() <= threads  # (an earlier test's thread may end meanwhile)
        assert c.labels == {"runner.run": "20260101-000000-abcd", "runner.rank": "0"}
        assert (c.status, c.name, c.exit_code, c.id) == ("exited", "runner-x", 3, "c0" * 32)


@pytest.mark.parametrize("label, grace", [("20", 20.0), ("0", 0.0), ("nan", 30.0), ("inf", 30.0), ("1e308", 30.0),
                                          ("-5", 30.0), ("thirty", 30.0), (None, 30.0)])
def test_a_grace_period_label_is_read_within_a_day(label, grace):
    """`down` read the container's grace label with float(): text raised ValueError, NaN and inf
    ended in round() (ValueError, OverflowError), 1e308 asked the engine to wait for ever."""
    from runner.backends.ssh.node_runs import _grace_label

    assert _grace_label(label) == grace


@pytest.mark.parametrize("answer, ok", [({"StatusCode": 0}, True), ({"StatusCode": "0"}, False), ([0], False),
                                        ({"StatusCode": True}, False)])
def test_a_wait_answer_without_an_exit_status_is_one_engine_error(tmp_path, answer, ok):
    """`containers.run` (the throwaway root container of run_owner) read wait()['StatusCode'] as it came."""
    with _engine(tmp_path, {"/containers/[^/]+/wait": {"body": answer}}, 57) as node, \
            Remote(node.node()).connect() as r:
        if ok:
            assert r.docker().api.wait("c0" * 32) == answer
        else:
            with pytest.raises(docker_answers.EngineAnswerError):
                r.docker().api.wait("c0" * 32)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def _peak_rss_during(fn):
    """(fn's result or exception, the most this process's resident memory grew while it ran), sampled
    every 5 ms: what the runner's process holds, whoever allocates it (tracemalloc sees Python's only)."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss() - base)
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        got = _bounded(fn, 120)
    finally:
        done.set()
        t.join()
    return got, max(peak[0], _rss() - base)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_200_mib_answer_costs_at_most_the_bound(tmp_path, chunked):
    """The real bound (64 MiB) against a 200 MiB listing sent as fast as the channel takes it, its
    length said first or not. docker-py held all of it (requests' chunks and their join, then the
    parsed string: the runner grew by more than the answer)."""
    answer = {"big_mb": 200, "chunked": chunked}
    with _engine(tmp_path, {"/containers/json": answer}, 58) as node, Remote(node.node()).connect() as r:
        r.docker()
        got, grew = _peak_rss_during(lambda: run_containers(r, None))
    assert isinstance(got, docker_answers.EngineAnswerError), repr(got)
    said = "went past 64 MiB" if chunked else "is 200 MiB, over the 64 MiB"
    assert str(got).startswith("node evil: the engine's answer to GET /v1.41/containers/json " + said), str(got)
    # Chunked: the bound is read before the answer is refused. 65-67 MiB here; one CI run measured
    # 102 MiB (the process's whole RSS, whatever else its threads held), so the bound is twice the
    # limit: unbounded, the runner held all 200 MiB and more (601 MiB before the fix).
    assert grew < (2 * docker_answers.MAX_ANSWER if chunked else 16 << 20), grew >> 20


@pytest.mark.parametrize("change, labels", [({"Config": "x"}, {}), ({"Config": {"Labels": [1, 2]}}, {}),
                                            ({"Config": {"Labels": {"io.runner.gate": 3, "a": "b"}}}, {"a": "b"})])
def test_image_fields_of_any_shape_read_as_nothing(tmp_path, change, labels):
    """delivery/images.py reads an image's labels (`.labels or {}`): docker-py's Image.labels did
    attrs['Config'].get('Labels') (AttributeError on a string Config, a list went on as labels)."""
    from runner.delivery.images import node_image_labels

    image = {"Id": "sha256:" + "ab" * 32, "RepoTags": ["t:1", 5], **change}
    with _engine(tmp_path, {"/images/.+/json": {"body": image}}, 59) as node, Remote(node.node()).connect() as r:
        assert node_image_labels(r, "t:1") == labels
        img = r.docker().images.get("t:1")
        assert (img.id, img.tags) == ("sha256:" + "ab" * 32, ["t:1"])


@pytest.mark.parametrize("answer", [{"Id": 5}, ["x"], {"Id": "sha256:../../x"}])
def test_a_malformed_image_inspection_is_one_engine_error(tmp_path, answer):
    with _engine(tmp_path, {"/images/.+/json": {"body": answer}}, 60) as node, Remote(node.node()).connect() as r:
        with pytest.raises(docker_answers.EngineAnswerError) as err:
            r.docker().images.get("t:1")
    assert str(err.value).startswith("node evil: the engine's answer for image 't:1' is not an object"), \
        str(err.value)


def _status(tmp_path, answers: dict, fourth: int, capsys) -> tuple[int | str, str, str]:
    """`runner status --json` against one hostile node, as main() runs it: (exit code, stdout, stderr)."""
    from types import SimpleNamespace

    from runner.backends.ssh.backend import SshBackend
    from runner.cli import runs
    from runner.core.errors import UserError
    from runner.inventory import Inventory, Job

    with _engine(tmp_path, answers, fourth) as node:
        inv = Inventory(str(tmp_path / "inv.yaml"), [node.node(role="master")], Job())
        args = SimpleNamespace(run=None, json=True)
        orig = runs.open_backend
        runs.open_backend = lambda a, **kw: SshBackend(inv)
        try:
            rc: int | str = runs.cmd_status(args)
        except UserError as exc:
            rc = f"UserError: {exc}"
        finally:
            runs.open_backend = orig
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("change", [{"State": [1]}, {"State": {"Status": {"x": 1}, "ExitCode": "3"}}, {"Name": 7},
                                    {"Config": {"Labels": {"io.runner.run-id": "20260101-000000-abcd", "io.runner.rank": 0}}}])
def test_runner_status_on_a_hostile_engine_shows_a_row(tmp_path, capsys, change):
    """`runner status`: AttributeError / TypeError from docker-py's models before; now the row, the
    node's malformed fields shown as unknown."""
    c_attrs = {**CONTAINER, "Config": {"Labels": {"io.runner.run-id": "20260101-000000-abcd", "io.runner.rank": "0"}},
               **change}
    rc, out, err = _status(tmp_path, {"/containers/[^/]+/json": {"body": c_attrs}}, 61, capsys)
    assert rc == 0 and "Traceback" not in err, (rc, err)
    (row,) = json.loads(out)["nodes"]
    assert row["node"] == "evil" and row["state"] in ("exited", "unknown"), row
    assert row["rank"] in (0, None) and row["exit_code"] in (3, None), row


@pytest.mark.parametrize("answer", [{"body": {"a": 1}}, {"body": [{"Id": 5}]}, {"big_mb": 100, "chunked": True}])
def test_runner_status_on_a_malformed_listing_is_one_line(tmp_path, capsys, answer):
    """The node is named on one line and left out (its only node: no run found, one error)."""
    rc, out, err = _status(tmp_path, {"/containers/json": answer}, 62, capsys)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runner: warning: node evil: the engine's "), err
    assert lines[0].endswith("(left out)") and str(rc).startswith("UserError: "), (rc, err)
    assert "node evil: node evil" not in err, err


@pytest.mark.parametrize("config", ["x", [1], None, {"Tty": False}])
def test_logs_of_a_container_whose_config_is_not_a_mapping(tmp_path, config):
    """`runner logs` / `up` read Config.Tty to choose how to read the stream: a string Config was an
    AttributeError ('str' object has no attribute 'get')."""
    from runner.transport.container_logs import log_chunks

    frame = "\x01\x00\x00\x00\x00\x00\x00\x03hi\n"
    answers = {"/containers/[^/]+/json": {"body": {**CONTAINER, "Config": config}},
               "/containers/[^/]+/logs": {"raw": frame, "repeat": 2}}
    with _engine(tmp_path, answers, 64) as node, Remote(node.node()).connect() as r:
        c = r.docker().containers.get("c0" * 32)
        assert b"".join(log_chunks(c, follow=False)) == b"hi\nhi\n"


@pytest.mark.parametrize("item", ["{}", "[]", '"ab"'])
def test_an_answer_of_millions_of_tiny_values_is_refused_before_it_is_parsed(tmp_path, item):
    """Within the byte bound, JSON grows when parsed: 64 MiB of `{},` are 22 million dicts, 1.5 GiB
    (docker-py parsed any answer: a 20 MiB listing grew the runner by ~500 MiB). An answer holding
    more values than any engine's (MAX_JSON_VALUES) is one error, not parsed."""
    answer = {"many": item, "n": (20 << 20) // (len(item) + 1)}
    with _engine(tmp_path, {"/containers/json": answer}, 65) as node, Remote(node.node()).connect() as r:
        r.docker()
        got, grew = _peak_rss_during(lambda: run_containers(r, None))
    assert isinstance(got, docker_answers.EngineAnswerError), repr(got)
    assert str(got).startswith("node evil: the engine's answer to GET /v1.41/containers/json holds over "), str(got)
    assert grew < 100 << 20, grew >> 20


def test_a_listing_of_many_containers_still_reads(tmp_path):
    """20,000 containers of a real engine's listing shape: well within the bounds."""
    one = {"Id": "c0" * 32, "Names": ["/runner-x"], "Labels": {"io.runner.run-id": "20260101-000000-abcd"},
           "State": "exited", "Status": "Exited (0)", "Ports": [], "Mounts": [{"Type": "bind", "Source": "/x"}],
           "NetworkSettings": {"Networks": {"host": {"NetworkID": "ab" * 32}}}, "HostConfig": {"NetworkMode": "host"}}
    with _engine(tmp_path, {"/containers/json": {"many": json.dumps(one), "n": 20_000}}, 66) as node, \
            Remote(node.node()).connect() as r:
        assert len(r.docker().api.containers(all=True)) == 20_000


@pytest.mark.parametrize("status, body, kind", [(404, [1], "NotFound"), (404, {"message": {"x": 1}}, "NotFound"),
                                                (500, "x" * (1 << 20), "APIError"),
                                                (404, {"message": "No such image: t:1"}, "ImageNotFound")])
def test_an_error_answer_of_any_shape_is_the_engine_error_it_says(tmp_path, status, body, kind):
    """docker-py built its error from response.json()['message']: a list was a TypeError, a dict
    message an AttributeError (`.lower()`), a 1 MiB message went whole into `runner: error:` lines."""
    import docker

    with _engine(tmp_path, {"/containers/[^/]+/json": {"status": status, "body": body}}, 67) as node, \
            Remote(node.node()).connect() as r:
        with pytest.raises(docker.errors.APIError) as err:
            r.docker().containers.get("c0" * 32)
    assert type(err.value).__name__ == kind, repr(err.value)
    assert len(str(err.value)) < 3000, len(str(err.value))


def test_a_stream_is_read_past_the_bound(tmp_path, monkeypatch):
    """Logs (and pulls, saves, loads) are streams: read as they come, never held whole, so never
    bounded by MAX_ANSWER (here 1 MiB against 3 MiB of log frames)."""
    from runner.transport.container_logs import log_chunks

    monkeypatch.setattr(docker_answers, "MAX_ANSWER", 1 << 20)
    line = "x" * 1023 + "\n"
    frame = "\x01\x00\x00\x00\x00\x00\x04\x00" + line
    answers = {"/containers/[^/]+/logs": {"raw": frame, "repeat": 3 << 10}}
    with _engine(tmp_path, answers, 69) as node, Remote(node.node()).connect() as r:
        c = r.docker().containers.get("c0" * 32)
        assert sum(len(b) for b in log_chunks(c, follow=False)) == 3 << 20


@pytest.mark.parametrize("answer", [{"interim": 0.2}, {"head_trickle": 0.2, "body": []}])
def test_an_engine_that_sends_only_interim_answers_is_given_up(tmp_path, monkeypatch, answer):
    """http.client skips `100 Continue` answers for as long as they come, and reads a status line
    and headers of 64 KiB each, each read within the timeout: the call never ended. Here one
    answer or byte every 0.2 s against a 2 s timeout and HEADERS_S 1. No thread per call."""
    from runner.transport import docker_api

    monkeypatch.setattr(docker_api, "HEADERS_S", 1.0, raising=False)
    with _engine(tmp_path, {"/containers/json": answer}, 70) as node, Remote(node.node()).connect() as r:
        r.docker(timeout=2.0)
        # (a head read whole, however slowly, would end in the empty list: not this error)
        got = _bounded(lambda: run_containers(r, None))
        assert isinstance(got, docker_answers.EngineAnswerError), repr(got)
        assert str(got) == "node evil: the engine sent no answer within 3s (interim answers only, or a trickle)", got
        assert r.docker().ping()  # the next call: a fresh channel
