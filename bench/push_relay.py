"""First push of the trainer image over a slow uplink: the relay push beside a plain parallel push
and the naive sequential script, on namespaced sandbox nodes with `--uplink 100mbit --link 1gbit`
(a laptop on Wi-Fi in front of a LAN of nodes).

    .venv/bin/python -m bench.push_relay [--nodes 1 3 6] [--naive 3] [--uplink 100mbit] [--link 1gbit]

For each node count, from empty nodes: `runner push` (relay: this host sends one copy, the nodes
pass it on), `runner push --direct` (one stream per node, all at once) and `docker save | ssh node
docker load` one node after the other (the hand-written loop; only for the counts in --naive, as
its time is N x one node by construction). The bytes this host sent to the nodes are read from the
bridge's own counter (what crossed the shaped uplink), not from the runner's report.

Needs root and the trainer image on this host (scripts/build-image.sh). Results:
bench/results/push_relay.json. Target (issue 13): relay to 6 nodes <= 1.3 x one node.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.sandbox_bench import REPO, runner, ssh_argv, uplink_bytes, wipe

STATE = Path("/tmp/runner-bench-push-relay")
IMAGE = "runner-trainer:latest"
HOST = "unix:///var/run/docker.sock"


def up(n: int, uplink: str, link: str) -> Path:
    inv = STATE / "local.yaml"
    runner("sandbox", "--dir", str(STATE / "s"), "up", "--nodes", str(n), "--uplink", uplink, "--link", link,
           "--inventory", str(inv))
    doc = yaml.safe_load(inv.read_text())
    doc["job"] = {"image": IMAGE}
    inv.write_text(yaml.safe_dump(doc))
    return inv


def subset(inv: Path, n: int) -> Path:
    doc = yaml.safe_load(inv.read_text())
    doc["nodes"] = doc["nodes"][:n]
    p = STATE / f"inv-{n}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p



def timed(inv: Path, fn) -> dict:
    wipe(inv)
    b0, t0 = uplink_bytes(STATE / "s"), time.perf_counter()
    out = fn()
    s, sent = time.perf_counter() - t0, uplink_bytes(STATE / "s") - b0
    return {"s": round(s, 1), "uplink_mb": round(sent / 1e6, 1), **(out or {})}


def runner_push(inv: Path, *extra: str) -> dict:
    proc = runner("push", "-i", str(inv), *extra)
    return {"rows": [line.split()[:3] + line.split()[-2:] for line in proc.stdout.splitlines() if line.strip()]}


def naive(inv: Path) -> None:
    doc = yaml.safe_load(inv.read_text())
    for n in doc["nodes"]:
        subprocess.run(f"docker -H {HOST} save {IMAGE} | {' '.join(ssh_argv(doc, n))} docker load -q",
                       shell=True, stdout=subprocess.DEVNULL, check=True)


def floor(inv: Path, archive: Path) -> None:
    """The same nodes' engines loading the image from a local file, all at once, no network: what
    this machine's shared cores and disk allow (every sandbox node runs on them)."""
    doc = yaml.safe_load(inv.read_text())
    socks = [subprocess.run([*ssh_argv(doc, n), "echo $DOCKER_HOST"], capture_output=True, text=True,
                            check=True).stdout.strip() for n in doc["nodes"]]
    procs = [subprocess.Popen(["docker", "-H", s, "load", "-q", "-i", str(archive)], stdout=subprocess.DEVNULL)
             for s in socks]
    if any(p.wait() for p in procs):
        raise SystemExit("docker load of the local archive failed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 3, 6])
    ap.add_argument("--naive", type=int, nargs="*", default=[3])
    ap.add_argument("--direct", type=int, nargs="*", default=[3, 6])
    ap.add_argument("--floor", type=int, nargs="*", default=[1, 3, 6])
    ap.add_argument("--uplink", default="100mbit")
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "push_relay.json"))
    a = ap.parse_args()
    runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
    image_mb = int(subprocess.run(["docker", "-H", HOST, "image", "inspect", "-f", "{{.Size}}", IMAGE],
                                  capture_output=True, text=True, check=True).stdout) / 1e6
    res: dict = {"config": vars(a), "image_mb": round(image_mb, 1), "relay": {}, "direct": {}, "naive": {},
                 "floor": {}}
    kinds = ("relay", "direct", "naive", "floor")
    try:
        inv = up(max(a.nodes + a.naive + a.direct + a.floor), a.uplink, a.link)
        runner("push", "-i", str(subset(inv, 1)))  # the host's export cache, made once (not timed)
        for n in a.nodes:
            res["relay"][n] = timed(subset(inv, n), lambda n=n: runner_push(subset(inv, n)))
            print(f"relay {n}: {res['relay'][n]}", flush=True)
        for n in a.direct:
            res["direct"][n] = timed(subset(inv, n), lambda n=n: runner_push(subset(inv, n), "--direct"))
            print(f"direct {n}: {res['direct'][n]}", flush=True)
        for n in a.naive:
            res["naive"][n] = timed(subset(inv, n), lambda n=n: naive(subset(inv, n)))
            print(f"naive {n}: {res['naive'][n]}", flush=True)
        if a.floor:
            archive = STATE / "image.tar"
            subprocess.run(["docker", "-H", HOST, "save", "-o", str(archive), IMAGE], check=True)
            for n in a.floor:
                res["floor"][n] = timed(subset(inv, n), lambda n=n: floor(subset(inv, n), archive))
                print(f"floor {n}: {res['floor'][n]}", flush=True)
            archive.unlink()
    finally:
        runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
    out = Path(a.out)
    if out.is_file():  # a run of some parts only keeps the other parts' last figures
        old = json.loads(out.read_text())
        for kind in kinds:
            res[kind] = res[kind] or {int(k): v for k, v in old.get(kind, {}).items()}
    one = res["relay"].get(1, {}).get("s")
    for kind in kinds:
        for r in res[kind].values():
            if one:
                r["x_one_node"] = round(r["s"] / one, 2)
    out.write_text(json.dumps(res, indent=2))
    print(f"\nfirst push of {IMAGE} ({image_mb:.0f} MB), uplink {a.uplink}, node links {a.link}")
    print("| nodes | relay | plain parallel (--direct) | naive sequential | floor: local loads at once "
          "| uplink MB (relay / parallel / naive) |")
    print("|---|---|---|---|---|---|")
    for n in sorted({n for kind in kinds for n in res[kind]}):
        cells = []
        for kind in kinds:
            r = res[kind].get(n)
            cells.append(f"{r['s']:.0f} s ({r.get('x_one_node', 0):.2f}x)" if r else "")
        mbs = " / ".join(f"{res[k][n]['uplink_mb']:.0f}" if n in res[k] else "-" for k in ("relay", "direct", "naive"))
        print(f"| {n} | {' | '.join(cells)} | {mbs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
