#!/usr/bin/env python3
"""mypy over runner/, contract/ and trainer/ ([tool.mypy] in pyproject.toml), held to a baseline
that only shrinks (.mypy-baseline.json).

The baseline holds each file's error count; what is enforced is each package's sum (runner/transport,
trainer/models, ..., a top-level module such as runner/api.py on its own): a move or a split inside
a package changes nothing. A package over its count fails, and the errors of its files that grew are
printed; a package under its count passes and says to lower the baseline (`--update`), which
refuses to raise any package. runner/api.py and contract/ are checked with --strict's flags
([[tool.mypy.overrides]]), so their counts are strict counts.

    .venv/bin/python scripts/mypy_check.py            # check (scripts/test.sh runs this)
    .venv/bin/python scripts/mypy_check.py --update   # write the lower counts down
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE = REPO / ".mypy-baseline.json"
Error = dict  # one line of `mypy --output json`: file, line, column, message, hint, code, severity


def package(path: str) -> str:
    """The unit a count is enforced for: runner/transport, trainer/models, contract, runner/api.py."""
    parts = path.split("/")
    if parts[0] == "contract":  # small, and strict as a whole
        return "contract"
    return path if len(parts) <= 2 else "/".join(parts[:2])


def run_mypy() -> list[Error]:
    """mypy's errors, configured by pyproject.toml (its cache under .build/mypy: warm runs take seconds)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--output", "json"], cwd=REPO, capture_output=True, text=True
    )
    errors = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc.get("severity") == "error":
                errors.append(doc)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not errors):  # 2: mypy itself failed
        sys.exit(
            f"mypy_check: mypy failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return errors


def by_file(errors: list[Error]) -> dict[str, int]:
    return dict(sorted(Counter(e["file"] for e in errors).items()))


def by_package(files: dict[str, int]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for path, n in files.items():
        out[package(path)] += n
    return dict(sorted(out.items()))


def compare(
    now: dict[str, int], base: dict[str, int]
) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """({package: (now, allowed)} over the baseline, {package: (now, allowed)} under it), by package."""
    have, allowed = by_package(now), by_package(base)
    over = {p: (n, allowed.get(p, 0)) for p, n in have.items() if n > allowed.get(p, 0)}
    under = {p: (have.get(p, 0), n) for p, n in allowed.items() if have.get(p, 0) < n}
    return over, under


def grown_files(now: dict[str, int], base: dict[str, int], packages: set[str]) -> set[str]:
    """Files of those packages with more errors than the baseline lists for them (a new file: any)."""
    return {f for f, n in now.items() if package(f) in packages and n > base.get(f, 0)}


def render(e: Error) -> str:
    return f"{e['file']}:{e['line']}: {e['message']}  [{e['code']}]"


def load_baseline() -> dict:
    if BASELINE.is_file():
        return json.loads(BASELINE.read_text())
    return {
        "about": "mypy errors per file (scripts/mypy_check.py enforces each package's sum); only lowered, "
        "by `scripts/mypy_check.py --update`",
        "files": {},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--update",
        action="store_true",
        help="write the current counts to .mypy-baseline.json (refused where a package's count would rise)",
    )
    args = ap.parse_args(argv)
    errors = run_mypy()
    now = by_file(errors)
    doc = load_baseline()
    base = doc["files"]
    over, under = compare(now, base)
    total, allowed = sum(now.values()), sum(base.values())
    if over and not (args.update and not BASELINE.is_file()):  # (the first --update writes one down)
        grown = grown_files(now, base, set(over))
        print("mypy_check: more type errors than .mypy-baseline.json allows; fix these (new or moved) ones:")
        for e in errors:
            if e["file"] in grown:
                print(f"  {render(e)}")
        for p, (n, a) in over.items():
            print(f"mypy_check: {p}: {n} errors, the baseline allows {a}")
        if args.update:
            print("mypy_check: --update refused: the baseline only shrinks")
        return 1
    if args.update:
        doc["files"] = now
        doc["packages"] = by_package(now)
        BASELINE.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"mypy_check: baseline written: {total} errors (was {allowed})")
        return 0
    if under:
        for p, (n, a) in under.items():
            print(f"mypy_check: {p}: {n} errors, under the baseline's {a}")
        print(
            "mypy_check: lower the baseline: .venv/bin/python scripts/mypy_check.py --update (and commit it)"
        )
    print(f"mypy_check: {total} type errors, baseline {allowed}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
