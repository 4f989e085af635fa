"""First push of the trainer image to one namespaced node, with `compress: auto` (the link probe
decides) beside `compress: true` (ssh -C always: the runner before the probe) and `false`, at each
link rate asked for (a gigabit LAN, a 100 Mbit/s Wi-Fi or home link).

    .venv/bin/python -m bench.push_compress [--links 1gbit 100mbit] [--modes auto true false]

Each push starts from an empty node. The bytes this host sent are the bridge's own counter (what
crossed the shaped link: the probe's included), not the runner's report. For `auto` the runner's
own decision line (`node node-0: link up ... MB/s, zlib here ... MB/s: ...`) is kept.

Needs root and the trainer image on this host (scripts/build-image.sh). Results:
bench/results/push_compress.json. Target: auto within 10% of the faster of true and false at
every rate.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.sandbox_bench import REPO, runner, uplink_bytes, wipe

STATE = Path("/tmp/runner-bench-push-compress")
IMAGE = "runner-trainer:latest"
HOST = "unix:///var/run/docker.sock"
DECISION = re.compile(r"node node-0: link up [^\n]*")


def up(link: str) -> Path:
    inv = STATE / "local.yaml"
    runner("sandbox", "--dir", str(STATE / "s"), "up", "--nodes", "1", "--netns", "--link", link,
           "--inventory", str(inv))
    return inv


def with_mode(inv: Path, mode: str) -> Path:
    doc = yaml.safe_load(inv.read_text())
    for n in doc["nodes"]:
        n["compress"] = {"true": True, "false": False}.get(mode, mode)
    doc["job"] = {"image": IMAGE}
    p = STATE / f"inv-{mode}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p



def push(inv: Path) -> dict:
    wipe(inv)
    b0, t0 = uplink_bytes(STATE / "s"), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "runner", "push", "-i", str(inv)], cwd=REPO, capture_output=True,
                          text=True)
    s, sent = time.perf_counter() - t0, uplink_bytes(STATE / "s") - b0
    if proc.returncode != 0:
        raise SystemExit(f"push failed: {proc.stderr[-2000:]}")
    m = DECISION.search(proc.stderr)
    return {"s": round(s, 1), "uplink_mb": round(sent / 1e6, 1), "decision": m[0] if m else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", nargs="+", default=["1gbit", "100mbit"])
    ap.add_argument("--modes", nargs="+", default=["auto", "true", "false"], choices=["auto", "true", "false"])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "push_compress.json"))
    a = ap.parse_args()
    runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
    image_mb = int(subprocess.run(["docker", "-H", HOST, "image", "inspect", "-f", "{{.Size}}", IMAGE],
                                  capture_output=True, text=True, check=True).stdout) / 1e6
    res: dict = {"config": vars(a), "image_mb": round(image_mb, 1), "links": {}}
    try:
        for link in a.links:
            inv = up(link)
            runner("push", "-i", str(with_mode(inv, "true")))  # the host's export cache, made once (not timed)
            rows = res["links"][link] = {}
            for mode in a.modes:
                rows[mode] = push(with_mode(inv, mode))
                print(f"{link} compress {mode}: {rows[mode]}", flush=True)
            best = min(rows[m]["s"] for m in ("true", "false") if m in rows)
            if "auto" in rows:
                rows["auto"]["x_best_fixed"] = round(rows["auto"]["s"] / best, 2)
    finally:
        runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"\nfirst push of {IMAGE} ({image_mb:.0f} MB) to one namespaced node")
    print("| link | auto | always ssh -C | never | auto / the faster fixed | auto's decision |")
    print("|---|---|---|---|---|---|")
    for link, rows in res["links"].items():
        cells = [f"{rows[m]['s']:.0f} s, {rows[m]['uplink_mb']:.0f} MB" if m in rows else "" for m in ("auto", "true", "false")]
        print(f"| {link} | {' | '.join(cells)} | {rows.get('auto', {}).get('x_best_fixed', '')} | "
              f"{rows.get('auto', {}).get('decision', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
