"""Collecting a run's artifacts from 3 sandbox nodes: first collect, a repeat with nothing new, and
a collect after the run appended a little (a few metrics lines, one new file), beside what users
do by hand today: `scp -r` of each node's run dir (the Pi guide), and `rsync -a` over ssh.

    .venv/bin/python -m bench.collect [--mb-per-node 96] [--files 24]

Each node's job writes checkpoint-like shards (random bytes, `--files` files summing to
`--mb-per-node` MB), a metrics.jsonl and a log. Bytes are what crossed SSH into the destination
(runner: its own count of copied bytes; scp/rsync: bytes of the files they (re)wrote, rsync's
`--stats`). Target (issue 9): a repeat collect moves <= 1% of the first. Results:
bench/results/collect.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from bench.sandbox_bench import REPO, Timer, runner, sandbox, ssh_argv, subset

IMAGE = "runner-trainer:latest"
ROW = re.compile(r"^(\S+)\s+\d+ files: (\d+) copied \(([\d.]+) MB", re.M)

WRITER = r"""
import os, json
out, n, mb = os.environ['OUTPUT_DIR'], int(os.environ['NFILES']), float(os.environ['MB'])
os.makedirs(f'{out}/checkpoints/step-10', exist_ok=True)
size = int(mb * 1e6 / n)
for i in range(n):
    with open(f'{out}/checkpoints/step-10/__{i}_0.distcp', 'wb') as f:
        f.write(os.urandom(size))
with open(f'{out}/metrics.jsonl', 'w') as f:
    for s in range(1, 11):
        f.write(json.dumps({'step': s, 'loss': 5.0 - 0.1 * s, 'tokens_per_s': 1000.0}) + '\n')
open(f'{out}/rank.log', 'w').write('\n'.join(f'step {s}' for s in range(1, 11)) + '\n')
"""

APPEND = ("cd {d} && for s in 11 12; do echo '{{\"step\": '$s', \"loss\": 3.9}}' >> metrics.jsonl; done && "
          "echo 'step 12' >> rank.log && echo done > finished.txt")


def runner_collect(inv: Path, run_id: str, dest: Path) -> tuple[float, float, int | None]:
    with Timer() as t:
        out = runner("collect", run_id, "-i", str(inv), "--dest", str(dest)).stdout
    rows = ROW.findall(out)
    return t.s, sum(float(mb) for _, _, mb in rows), sum(int(n) for _, n, _ in rows)


def _node_dirs(inv: Path, run_id: str) -> list[tuple[dict, dict, str]]:
    doc = yaml.safe_load(inv.read_text())
    return [(doc, n, f"{n['workdir']}/runs/{run_id}") for n in doc["nodes"]]


def scp_collect(inv: Path, run_id: str, dest: Path) -> tuple[float, float, int | None]:
    """scp -r of every node's run dir: everything, every time."""
    moved = 0
    with Timer() as t:
        for doc, n, d in _node_dirs(inv, run_id):
            target = dest / n["name"]
            shutil.rmtree(target, ignore_errors=True)
            dest.mkdir(parents=True, exist_ok=True)
            dd = doc["defaults"]
            subprocess.run(["scp", "-q", "-r", "-P", str(dd["port"]), "-i", dd["identity_file"],
                            "-o", f"UserKnownHostsFile={dd['known_hosts']}", "-o", "StrictHostKeyChecking=yes",
                            "-o", "BatchMode=yes", f"{dd['user']}@{n['host']}:{d}", str(target)], check=True)
            moved += sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    return t.s, moved / 1e6, None


def rsync_collect(inv: Path, run_id: str, dest: Path) -> tuple[float, float, int | None]:
    moved = 0
    with Timer() as t:
        for doc, n, d in _node_dirs(inv, run_id):
            ssh = ssh_argv(doc, n)
            dest.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(["rsync", "-a", "--stats", "-e", " ".join(ssh[:-1]), f"{ssh[-1]}:{d}/",
                                   str(dest / n["name"]) + "/"], check=True, capture_output=True, text=True)
            moved += int(re.search(r"Total transferred file size: ([\d,]+)", proc.stdout)[1].replace(",", ""))
    return t.s, moved / 1e6, None


def _size(mb: float) -> str:
    return f"{mb:.1f} MB" if mb >= 1 else f"{mb * 1e3:.1f} KB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb-per-node", type=float, default=96)
    ap.add_argument("--files", type=int, default=24)
    a = ap.parse_args()
    base = sandbox(3)
    job = {"image": IMAGE, "master_port": "auto", "command": ["python", "-c", WRITER],
           "env": {"NFILES": str(a.files), "MB": str(a.mb_per_node)}}
    inv = subset(base, 3, job)
    up = runner("up", "-i", str(inv))
    run_id = re.search(r"run (\S+) started", up.stdout)[1]

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-collect-") as tmp:
        dests = {name: Path(tmp) / name for name in ("runner", "scp", "rsync")}
        fns = {"runner": runner_collect, "scp": scp_collect, "rsync": rsync_collect}
        for phase in ("first", "repeat"):
            for name, fn in fns.items():
                s, mb, files = fn(inv, run_id, dests[name] / run_id if name == "runner" else dests[name])
                rows.setdefault(name, {})[phase] = {"s": round(s, 2), "mb": round(mb, 6), "files": files}
        for doc, n, d in _node_dirs(inv, run_id):
            subprocess.run([*ssh_argv(doc, n), APPEND.format(d=d)], check=True)
        for name, fn in fns.items():
            s, mb, files = fn(inv, run_id, dests[name] / run_id if name == "runner" else dests[name])
            rows[name]["after_append"] = {"s": round(s, 2), "mb": round(mb, 6), "files": files}
    runner("down", run_id, "-i", str(inv), check=False)
    for r in rows.values():
        r["repeat_pct_of_first"] = round(100 * r["repeat"]["mb"] / r["first"]["mb"], 3)
    res = {"nodes": 3, "mb_per_node": a.mb_per_node, "files_per_node": a.files + 2, "rows": rows}
    out = REPO / "bench/results/collect.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"3 nodes x {a.mb_per_node:.0f} MB in {a.files + 2} files each\n")
    print("| tool | first | repeat (nothing new) | after a small append | repeat / first (bytes) |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [f"{r[p]['s']:.2f}s, {_size(r[p]['mb'])}" + (f" ({r[p]['files']} files)" if r[p]["files"] is not None
                                                              else "") for p in ("first", "repeat", "after_append")]
        print(f"| {name} | {' | '.join(cells)} | {r['repeat_pct_of_first']:.3f}% |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
