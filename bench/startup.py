"""Start-up: how long the `runner` command takes before it does anything (issue 55), side by side
with `git --version`-class tools, the interpreter itself, and other launchers' CLIs.

    .venv/bin/python -m bench.startup [--repeats 21] [--baseline DIR] [--torchx BIN] [--sky BIN]

Each command runs `--repeats` times, alternating with the others (a load spike hits every row
alike); the wall time's median and minimum are kept (the machine is shared: the minimum is the
least disturbed run). Rows: `runner --version`, `runner --help` (every command's parser built),
`runner up --dry-run` of hosts/pis.yaml and of generated 1,000- and 10,000-node inventories
(bench/fanout.py's: start-up, inventory, plan, printing); `python -c pass` (the floor every Python
CLI pays), `git --version`, `ssh -V`, `docker --version`; torchx's and SkyPilot's CLIs when given
(each pip-installed into a throwaway venv under /tmp, never into .venv). `--baseline DIR` measures
another checkout's runner (the one before this work) the same way, in the same run. Targets:
`--version` and `--help` <= 0.15 s, a dry-run of hosts/pis.yaml <= 0.3 s, of 1,000 nodes < 0.5 s.

Also recorded: which of the heavy packages (paramiko, docker, rich, yaml, matplotlib, urllib3)
each runner command imports (`python -X importtime`). Results: bench/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.fanout import generated_inventory
from bench.sandbox_bench import REPO

HEAVY = ("paramiko", "docker", "rich", "yaml", "matplotlib", "urllib3", "requests")
TARGETS = {"runner --version": 0.15, "runner --help": 0.15, "runner up --dry-run hosts/pis.yaml": 0.3,
           "runner up --dry-run 1,000 nodes": 0.5}


def runner_argv(root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "runner", *args]


def commands(root: Path, invs: dict[int, Path]) -> dict[str, list[str]]:
    """The runner's rows for the checkout at root (run from it: its own package is imported)."""
    return {"runner --version": runner_argv(root, "--version"),
            "runner --help": runner_argv(root, "--help"),
            "runner up --dry-run hosts/pis.yaml": runner_argv(root, "up", "-i", str(REPO / "hosts" / "pis.yaml"),
                                                              "--dry-run"),
            "runner up --dry-run 1,000 nodes": runner_argv(root, "up", "-i", str(invs[1000]), "--dry-run"),
            "runner up --dry-run 10,000 nodes": runner_argv(root, "up", "-i", str(invs[10000]), "--dry-run")}


def others(torchx: str | None, sky: str | None) -> dict[str, list[str]]:
    rows = {"python -c pass": [sys.executable, "-c", "pass"]}
    for name, argv in (("git --version", ["git", "--version"]), ("ssh -V", ["ssh", "-V"]),
                       ("docker --version", ["docker", "--version"])):
        if shutil.which(argv[0]):
            rows[name] = argv
    if torchx:
        rows["torchx --version"] = [torchx, "--version"]
        rows["torchx --help"] = [torchx, "--help"]
    if sky:
        rows["sky --version"] = [sky, "--version"]
        rows["sky --help"] = [sky, "--help"]
    return rows


def measure(rows: dict[str, tuple[list[str], Path]], repeats: int) -> dict[str, dict]:
    """{row: {median_s, min_s}}: every row once per round, `repeats` rounds."""
    times: dict[str, list[float]] = {k: [] for k in rows}
    for argv, cwd in rows.values():  # one unmeasured run each: the page cache, .pyc files
        subprocess.run(argv, cwd=cwd, capture_output=True)
    for _ in range(repeats):
        for name, (argv, cwd) in rows.items():
            t0 = time.perf_counter()
            proc = subprocess.run(argv, cwd=cwd, capture_output=True)
            times[name].append(time.perf_counter() - t0)
            if proc.returncode != 0:
                raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-1500:].decode()}")
    return {k: {"median_s": round(statistics.median(v), 3), "min_s": round(min(v), 3)} for k, v in times.items()}


def heavy_imports(argv: list[str], cwd: Path) -> list[str]:
    """The heavy packages (HEAVY) the command imports, from `python -X importtime`."""
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], cwd=cwd, capture_output=True, text=True)
    names = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
             if line.startswith("import time:")}
    return sorted(names & set(HEAVY))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--baseline", type=Path, help="another checkout's runner, measured the same way")
    ap.add_argument("--baseline-label", help="what the baseline is (a commit), for the result file")
    ap.add_argument("--torchx", help="torchx's CLI (in a throwaway venv)")
    ap.add_argument("--sky", help="SkyPilot's CLI (in a throwaway venv)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as d:
        invs = {n: generated_inventory(Path(d), n) for n in (1000, 10000)}
        rows = {k: (v, REPO) for k, v in commands(REPO, invs).items()}
        if args.baseline:
            rows.update({f"before: {k}": (v, args.baseline) for k, v in commands(args.baseline, invs).items()})
        rows.update({k: (v, REPO) for k, v in others(args.torchx, args.sky).items()})
        load = os.getloadavg()[0]
        results = measure(rows, args.repeats)
        imports = {k: heavy_imports(v, REPO) for k, v in commands(REPO, invs).items()}
        if args.baseline:
            imports.update({f"before: {k}": heavy_imports(v, args.baseline)
                            for k, v in commands(args.baseline, invs).items()})
    doc = {"what": "wall seconds from exec to exit, median and minimum of the repeats (all rows interleaved)",
           "cpus": os.cpu_count(), "load_at_start": round(load, 2), "load_at_end": round(os.getloadavg()[0], 2),
           "repeats": args.repeats, "python": sys.version.split()[0],
           "baseline": (args.baseline_label or str(args.baseline)) if args.baseline else None,
           "versions": {k: _version(v) for k, v in {"torchx": args.torchx, "sky": args.sky}.items() if v},
           "targets": TARGETS, "rows": results, "heavy_imports": imports}
    out = REPO / "bench" / "results" / "startup.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print("| command | median | min | target |\n|---|---|---|---|")
    for k, v in results.items():
        print(f"| {k} | {v['median_s']:.3f} s | {v['min_s']:.3f} s | {TARGETS.get(k.removeprefix('before: '), '')} |")
    print(f"\nwrote {out.relative_to(REPO)}")
    return 0


def _version(cli: str) -> str:
    """The version of the package whose venv holds cli (its pip's answer)."""
    pip = Path(cli).with_name("pip")
    name = {"torchx": "torchx", "sky": "skypilot"}[Path(cli).name]
    proc = subprocess.run([str(pip), "show", name], capture_output=True, text=True)
    return next((ln.split(":", 1)[1].strip() for ln in proc.stdout.splitlines() if ln.startswith("Version:")), "?")


if __name__ == "__main__":
    sys.exit(main())
