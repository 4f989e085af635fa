"""Perseus pieces without torch processes: the client against servers that are down or answer
garbage, the GPU clocks interface against a FAKE NVML (no GPU exists here), the config checks,
the plan files (`trainer perseus-plans`, the server's own reader)."""

from __future__ import annotations

import http.server
import signal
import socket
import threading
from pathlib import Path

import pytest

from runner.agents.perseus_server import read_plan
from trainer.config import ConfigError, resolve
from trainer.profiling import perseus_plans
from trainer.profiling.gpu_clocks import GpuClocks
from trainer.profiling.perseus_client import PerseusClient, PerseusError, ProfilingDone, server_detail
from trainer.profiling.perseus_rounds import plan_mismatch


@pytest.fixture
def answering():
    """A stdlib HTTP server on loopback that answers every request with (status, body) from `set`."""
    reply = {"status": 200, "body": b""}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(reply["status"])
            self.send_header("Content-Length", str(len(reply["body"])))
            self.end_headers()
            self.wfile.write(reply["body"])

        do_GET = do_POST = _answer

        def log_message(self, *a) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()

    def set_reply(status: int, body: bytes) -> str:
        reply.update(status=status, body=body)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield set_reply
    srv.shutdown()
    srv.server_close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_server_down_is_one_line_naming_the_url():
    port = closed_port()
    with pytest.raises(PerseusError) as e:
        PerseusClient(f"http://127.0.0.1:{port}").register_job(2, 1, 1, 2, None)
    msg = str(e.value)
    assert msg.startswith(f"Perseus server http://127.0.0.1:{port}: POST /register_job: cannot reach the server (")
    assert "\n" not in msg


@pytest.mark.parametrize("status,body,expect", [
    (200, b"<html>hello</html>", "POST /register_job: the answer is not JSON (starts b'<html>hello</html>')"),
    (200, b'{"job": 1}', "/register_job answered {'job': 1}, not a job id"),
    (500, b"Internal Server Error", "POST /register_job: HTTP 500: Internal Server Error"),
    (422, b'{"detail": [{"loc": ["body", "world_size"], "msg": "field required"}]}',
     "POST /register_job: HTTP 422: body.world_size: field required"),
])
def test_garbage_answers_are_one_line(answering, status, body, expect):
    url = answering(status, body)
    with pytest.raises(PerseusError) as e:
        PerseusClient(url).register_job(2, 1, 1, 2, None)
    assert str(e.value) == f"Perseus server {url}: {expect}"


def test_schedules_checked_and_profiling_done(answering):
    url = answering(200, b'{"rank": 1, "frequencies": [["forward", 1410], ["backward", 1410]]}')
    client = PerseusClient(url)
    assert client.schedule("2026+dp1+pp2", 1) == [("forward", 1410), ("backward", 1410)]
    with pytest.raises(PerseusError, match=r"/schedule answered .* not rank 0's schedule"):
        client.schedule("j", 0)
    answering(200, b'{"rank": 0, "frequencies": [["forward", "fast"]]}')
    with pytest.raises(PerseusError, match=r"item 0 of rank 0's schedule is \['forward', 'fast'\]"):
        client.schedule("j", 0)
    tb = (b'{"detail": "Traceback (most recent call last):\\n  File \\"x.py\\"\\nRuntimeError: [profiling-done] '
          b'all 3 plans ran\\n"}')
    answering(500, tb)
    with pytest.raises(ProfilingDone, match=r"^RuntimeError: \[profiling-done\] all 3 plans ran$"):
        client.schedule("j", 0)
    answering(400, b'{"detail": "Traceback ...\\nValueError: plan p.py holds 3 ranks\' plans but the job has 2 ranks"}')
    with pytest.raises(PerseusError, match=r"HTTP 400: ValueError: plan p.py holds 3 ranks' plans but the job has 2"):
        client.schedule("j", 0)


def test_server_detail_is_bounded_and_single_line():
    assert server_detail(b'{"detail": "a\\n\\nlast line\\u001b[31m"}') == "last line [31m"
    assert len(server_detail(b"x" * 5000)) == 303


def test_bad_urls_refused_at_config_time():
    base = [("train.steps", "3")]
    with pytest.raises(ConfigError, match=r"profile.perseus_url: 'ftp://x' is not an http:// URL"):
        resolve(None, [*base, ("profile.perseus_url", "ftp://x"), ("profile.num_prof_steps", "2")])
    with pytest.raises(ConfigError, match=r"profile.perseus_url needs --num_prof_steps N"):
        resolve(None, [*base, ("profile.perseus_url", "http://10.0.0.1:7787")])
    with pytest.raises(ConfigError, match=r"profile.gpu_clocks: 'max' \(off, auto or on\)"):
        resolve(None, [*base, ("profile.gpu_clocks", "max")])
    with pytest.raises(ConfigError, match=r"zbv splits the backward"):
        resolve(None, [*base, ("profile.perseus_url", "http://h:1"), ("profile.num_prof_steps", "1"),
                       ("parallel.pp", "2"), ("parallel.pp_schedule", "zbv"), ("parallel.virtual_stages", "2")])
    cfg = resolve(None, [*base, ("profile.num_prof_steps", "2")], environ={"PERSEUS_URL": "http://10.0.0.1:7787"})
    assert cfg.profile.perseus_url == "http://10.0.0.1:7787" and cfg.profile.gpu_clocks == "off"


def test_plan_mismatch_messages():
    order = [("forward", 0, 0), ("backward", 0, 0)]
    assert plan_mismatch([("forward", 1), ("backward", 2)], order) is None
    assert plan_mismatch([("backward", 1), ("forward", 2)], order) == \
        "instruction 0 is 'backward' where this rank runs 'forward'"
    assert plan_mismatch([("forward", 1)], order) == \
        "it lists 1 instructions (1 forward, 0 backward) but this rank runs 2 per step (1 forward, 1 backward)"


class FakeClockNVML:
    """FAKE pynvml for clocks (no NVIDIA GPU here): supported memory/graphics clocks, and locked
    clocks that need `allowed` (as NVML's NoPermission without root)."""

    class NVMLError(Exception):
        pass

    def __init__(self, allowed: bool):
        self.allowed, self.calls = allowed, []

    def nvmlDeviceGetSupportedMemoryClocks(self, h):
        return [5001, 810]

    def nvmlDeviceGetSupportedGraphicsClocks(self, h, mem):
        return [1005, 1410, 1200] if mem == 5001 else [300]

    def nvmlDeviceSetGpuLockedClocks(self, h, lo, hi):
        if not self.allowed:
            raise self.NVMLError("Insufficient Permissions")
        self.calls.append(("lock", lo, hi))

    def nvmlDeviceResetGpuLockedClocks(self, h):
        self.calls.append(("reset",))


def clocks(mode: str, nvml: FakeClockNVML) -> GpuClocks:
    return GpuClocks(mode, 0, open_device=lambda i: (nvml, f"gpu{i}", "FAKE"))


def test_clocks_off_reads_the_list_and_sets_nothing():
    nvml = FakeClockNVML(allowed=True)
    c = clocks("off", nvml)
    assert c.supported == [1410, 1200, 1005] and not c.active and c.why == "profile.gpu_clocks off"
    assert c.apply(1200) is False
    c.reset()
    assert nvml.calls == []
    assert GpuClocks("off", None).supported == []  # no GPU: an empty list is registered


def test_clocks_auto_falls_back_and_on_fails_without_permission():
    nvml = FakeClockNVML(allowed=False)
    c = clocks("auto", nvml)
    assert not c.active and "NVML refused to set clocks (Insufficient Permissions" in c.why
    with pytest.raises(ConfigError, match=r"profile.gpu_clocks on: cannot set this rank's GPU clocks: NVML refused"):
        clocks("on", nvml)
    with pytest.raises(ConfigError, match=r"profile.gpu_clocks on: cannot set this rank's GPU clocks: no CUDA GPU"):
        GpuClocks("on", None)
    assert not GpuClocks("auto", None).active


def test_clocks_set_are_reset_on_signal_then_the_previous_handler_runs():
    seen = []
    before = signal.signal(signal.SIGHUP, lambda s, f: seen.append(s))
    try:
        nvml = FakeClockNVML(allowed=True)
        c = clocks("on", nvml)
        assert c.active and nvml.calls == [("lock", 1410, 1410)]  # the permission probe: the highest clock
        assert c.apply(1005) is True
        signal.raise_signal(signal.SIGHUP)
        assert nvml.calls[-2:] == [("lock", 1005, 1005), ("reset",)] and seen == [signal.SIGHUP]
        c.reset()  # nothing locked any more: no second reset
        assert nvml.calls.count(("reset",)) == 1
    finally:
        for sig, prev in c._previous.items():
            signal.signal(sig, prev)
        signal.signal(signal.SIGHUP, before)


def write_instructions(path: Path, rows: list[tuple[str, int, int]]) -> None:
    lines = ["instruction,start,end,stage,microbatch"]
    lines += [f"{name},{i}.0,{i}.5,{stage},{mb}" for i, (name, stage, mb) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")


def test_perseus_plans_from_instruction_csvs(tmp_path, capsys):
    step0 = [("batch_input", 0, 0), ("forward_microstep", 0, 0), ("forward_microstep", 0, 1),
             ("backward_microstep", 0, 0), ("send_activation", 0, 1), ("backward_microstep", 0, 1)]
    step1 = [("forward_microstep", 1, 0), ("backward_microstep", 1, 0), ("forward_microstep", 1, 1),
             ("backward_microstep", 1, 1)]
    write_instructions(tmp_path / "instructions-0.csv", step0 * 2)
    write_instructions(tmp_path / "instructions-1.csv", step1 * 2)
    assert perseus_plans.main([str(tmp_path), "--frequency", "1410", "--stage-frequencies", "1200,900"]) == 0
    plan = read_plan(str(tmp_path / "plans" / "plan-1410.py"), 2)
    assert plan == [[("forward", 1410), ("forward", 1410), ("backward", 1410), ("backward", 1410)],
                    [("forward", 1410), ("backward", 1410), ("forward", 1410), ("backward", 1410)]]
    assert [mhz for _, mhz in read_plan(str(tmp_path / "plans" / "plan-stages.py"))[1]] == [900] * 4
    write_instructions(tmp_path / "instructions-1.csv", step1 + step1[::-1])
    with pytest.raises(ConfigError, match=r"instructions-1.csv: recorded steps differ in instruction order"):
        perseus_plans.main([str(tmp_path), "--frequency", "1410"])
    (tmp_path / "instructions-1.csv").rename(tmp_path / "instructions-2.csv")
    with pytest.raises(ConfigError, match=r"instructions CSVs of ranks \[0, 2\]"):
        perseus_plans.main([str(tmp_path), "--frequency", "1410"])


@pytest.mark.parametrize("text,why", [
    ("__import__('os').system('true')", "not a Python literal"),
    ("[[('forward', 1410)], 3]", "rank 1's entry is a int, not a list of pairs"),
    ("[[('forward', -5)]]", "rank 0 item 0 is ('forward', -5), not an (instruction, frequency) pair"),
    ("[]", "must be a list with one list"),
])
def test_server_reads_plans_as_literals_only(tmp_path, text, why):
    p = tmp_path / "plan.py"
    p.write_text(text)
    with pytest.raises(ValueError, match=f"plan {p}: (.*: )?" + why.replace("(", r"\(").replace(")", r"\)")):
        read_plan(str(p))
