"""The trainer's client of a Perseus server (Zeus's pipeline frequency optimizer, zeus 0.16).

Zeus's own client (`PipelineFrequencyOptimizer`) needs NVML and locks the GPU clocks as soon as it
starts, so the trainer speaks the protocol itself (stdlib http.client; bounded reads, timeouts):

    POST /register_job               {pp_degree, dp_degree, tp_degree, world_size, job_metadata} -> "job id"
    POST /register_rank/{job_id}     {rank, dp_rank, pp_rank, tp_rank, available_frequencies: [MHz]}
    GET  /schedule/{job_id}?rank=r   -> {"rank": r, "frequencies": [["forward", MHz], ["backward", MHz], ...]}
    POST /result/{job_id}            {rank, iter_time: [s], iter_energy: [J],
                                      time_breakdown: {"forward": [[s per instruction] per iteration], ...},
                                      energy_breakdown: same in J}

The job id holds '+' and is percent-encoded in paths. A schedule request returns only once every
rank of the job has asked. A scheduler that is finished makes the server answer the next schedule
request with an error whose text holds `[profiling-done]` (a Perseus convention): ProfilingDone.
Every other failure is one PerseusError line naming the URL and what was wrong.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.parse
from typing import Any

from trainer.config import ConfigError

MAX_BODY = 4 << 20        # a schedule of 1024 microbatches x 2 instructions is ~40 kB
DONE_MARK = "[profiling-done]"
CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


class PerseusError(ConfigError):
    """One line: the server's URL and what was wrong (the CLI prints it and exits non-zero)."""


class ProfilingDone(Exception):
    """The server's scheduler is finished: training ends cleanly."""


def _one_line(text: str, limit: int = 300) -> str:
    text = CONTROL.sub(" ", text).strip()
    return text if len(text) <= limit else text[:limit] + "..."


def server_detail(body: bytes) -> str:
    """The useful line of an error body: FastAPI's {"detail": ...}; a traceback's last line."""
    text = body.decode("utf-8", "replace")
    try:
        detail = json.loads(text).get("detail", text)
    except (ValueError, AttributeError, RecursionError):
        detail = text
    if isinstance(detail, list):  # request validation errors
        detail = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg', '')}" if isinstance(d, dict)
                           else str(d) for d in detail)
    lines = [ln for ln in str(detail).splitlines() if ln.strip()]
    return _one_line(lines[-1] if lines else "(empty answer)")


class PerseusClient:
    def __init__(self, url: str, timeout: float = 60.0, schedule_timeout: float = 1800.0):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise PerseusError(f"profile.perseus_url: {url!r} is not an http:// URL (e.g. http://10.0.0.1:7787)")
        try:
            self.port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            raise PerseusError(f"profile.perseus_url: {url!r} has a bad port") from None
        self.scheme, self.host, self.base = u.scheme, u.hostname, u.path.rstrip("/")
        self.url = f"{u.scheme}://{u.hostname if ':' not in u.hostname else '[' + u.hostname + ']'}:{self.port}{self.base}"
        self.timeout, self.schedule_timeout = timeout, schedule_timeout

    def _request(self, method: str, path: str, payload: Any = None, timeout: float | None = None) -> Any:
        conn_cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(self.host, self.port, timeout=timeout or self.timeout)
        body = None if payload is None else json.dumps(payload).encode()
        where = f"Perseus server {self.url}: {method} {path.split('?')[0]}"
        try:
            conn.request(method, self.base + path, body=body,
                         headers={"Content-Type": "application/json"} if body is not None else {})
            resp = conn.getresponse()
            data = resp.read(MAX_BODY + 1)
        except TimeoutError:
            raise PerseusError(f"{where}: no answer within {timeout or self.timeout:.0f}s") from None
        except (OSError, http.client.HTTPException) as e:
            raise PerseusError(f"{where}: cannot reach the server ({_one_line(str(e) or type(e).__name__)}); "
                               f"is it running?") from None
        finally:
            conn.close()
        if len(data) > MAX_BODY:
            raise PerseusError(f"{where}: answer larger than {MAX_BODY} bytes")
        if resp.status != 200:
            detail = server_detail(data)
            if DONE_MARK in data.decode("utf-8", "replace"):
                raise ProfilingDone(detail)
            raise PerseusError(f"{where}: HTTP {resp.status}: {detail}")
        try:
            return json.loads(data) if data else None
        except (ValueError, RecursionError):
            raise PerseusError(f"{where}: the answer is not JSON (starts {_one_line(repr(data[:60]))})") from None

    def register_job(self, pp: int, dp: int, tp: int, world_size: int, metadata: str | None) -> str:
        job = self._request("POST", "/register_job", {"pp_degree": pp, "dp_degree": dp, "tp_degree": tp,
                                                      "world_size": world_size, "job_metadata": metadata})
        if not isinstance(job, str) or not job or len(job) > 512:
            raise PerseusError(f"Perseus server {self.url}: /register_job answered {_one_line(repr(job)[:80])}, "
                               f"not a job id")
        return job

    def _job(self, job_id: str) -> str:
        return urllib.parse.quote(job_id, safe="")

    def register_rank(self, job_id: str, rank: int, dp_rank: int, pp_rank: int, tp_rank: int,
                      frequencies: list[int]) -> None:
        self._request("POST", f"/register_rank/{self._job(job_id)}",
                      {"rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank, "tp_rank": tp_rank,
                       "available_frequencies": list(frequencies)})

    def schedule(self, job_id: str, rank: int) -> list[tuple[str, int]]:
        """This rank's next plan: (instruction, MHz) in instruction order. Waits for every rank."""
        doc = self._request("GET", f"/schedule/{self._job(job_id)}?rank={rank}", timeout=self.schedule_timeout)
        where = f"Perseus server {self.url}: /schedule"
        if not isinstance(doc, dict) or doc.get("rank") != rank or not isinstance(doc.get("frequencies"), list):
            raise PerseusError(f"{where} answered {_one_line(repr(doc)[:120])}, not rank {rank}'s schedule")
        out = []
        for i, pair in enumerate(doc["frequencies"]):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], int) and not isinstance(pair[1], bool)):
                raise PerseusError(f"{where}: item {i} of rank {rank}'s schedule is {_one_line(repr(pair)[:80])}, "
                                   f"not [instruction, MHz]")
            out.append((pair[0], pair[1]))
        return out

    def report(self, job_id: str, result: dict) -> None:
        self._request("POST", f"/result/{self._job(job_id)}", result)
