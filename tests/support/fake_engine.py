"""A Docker engine that answers what a test tells it: HTTP/1.1 on stdin/stdout, as `docker system
dial-stdio` carries a real engine's. A hostile node's engine for tests/unit/test_docker_api_answers.py
(tests/support/hostile_node.py runs it in place of dial-stdio): FAKE, there is no engine behind it.

    python fake_engine.py ANSWERS.json

ANSWERS maps a path without its /vX.Y prefix (a regular expression) to what is sent:
{"body": any JSON} | {"raw": "text", "repeat": n} | {"big_mb": n} (a JSON string of n MiB, sent as
fast as the channel takes it) | {"nest": n} (n nested lists) | {"many": "json", "n": n} (a list of n
copies of it); "trickle": s sends the body a byte
every s seconds; "chunked": true sends it chunked (no length first); "status": the HTTP status (200); "interim": s sends `100 Continue` every s seconds, for ever;
"head_trickle": s sends the status line and headers a byte every s seconds. /_ping and /version answer as an engine does
unless ANSWERS names them.
"""

from __future__ import annotations

import json
import re
import sys
import time

CONTAINER = {"Id": "c0" * 32, "Name": "/runner-x", "Image": "sha256:" + "ab" * 32,
             "Config": {"Labels": {"runner.run": "20260101-000000-abcd", "runner.rank": "0"}},
             "State": {"Status": "exited", "Running": False, "ExitCode": 3}}
DEFAULTS = {"/_ping": {"raw": "OK"}, "/version": {"body": {"ApiVersion": "1.41", "Version": "24.0.0"}},
            "/containers/json": {"body": [{"Id": "c0" * 32}]}, "/containers/[^/]+/json": {"body": CONTAINER}}


def body_of(spec: dict) -> bytes:
    if "body" in spec:
        return json.dumps(spec["body"]).encode()
    if "big_mb" in spec:
        return b'["' + b"x" * (spec["big_mb"] << 20) + b'"]'
    if "many" in spec:
        return b"[" + b",".join([spec["many"].encode()] * spec["n"]) + b"]"
    if "nest" in spec:
        return b"[" * spec["nest"] + b"]" * spec["nest"]
    return spec.get("raw", "").encode() * spec.get("repeat", 1)


def main() -> None:
    answers = {**DEFAULTS, **json.load(open(sys.argv[1]))}
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while line := inp.readline():
        target = line.decode().split(" ")[1]
        length = 0
        while (h := inp.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = h.decode().partition(":")
            length = int(v) if k.lower() == "content-length" else length
        inp.read(length)
        path = re.sub(r"^/v[0-9.]+/", "/", target.split("?")[0])
        spec = next((v for k, v in answers.items() if re.fullmatch(k, path)), {"status": 404, "body": {"message": "no"}})
        body = body_of(spec)
        status = spec.get("status", 200)
        while spec.get("interim"):  # answers that are not the answer: http.client skips each
            out.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            out.flush()
            time.sleep(spec["interim"])
        if spec.get("chunked"):  # no length said first: the reader finds out as it reads
            out.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                      .encode())
            for i in range(0, len(body), 1 << 20):
                piece = body[i:i + (1 << 20)]
                out.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            out.write(b"0\r\n\r\n")
            out.flush()
            continue
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        for i in range(0, len(head), 1 if spec.get("head_trickle") else len(head)):
            out.write(head[i:i + (1 if spec.get("head_trickle") else len(head))])
            out.flush()
            time.sleep(spec.get("head_trickle", 0))
        if spec.get("trickle"):
            for i in range(len(body)):
                out.write(body[i:i + 1])
                out.flush()
                time.sleep(spec["trickle"])
        else:
            for i in range(0, len(body), 1 << 20):
                out.write(body[i:i + (1 << 20)])
            out.flush()


if __name__ == "__main__":
    main()
