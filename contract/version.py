"""The project's version, one for both CLIs (`runner --version`, `trainer --version`): the code that
runs says it. From a source tree (a clone run with PYTHONPATH, an editable install) that is its
pyproject.toml; from an installed package (a wheel, the trainer image), its metadata."""

from __future__ import annotations

import re
from pathlib import Path

DIST = "runner-trainer"


def version() -> str:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        text = pyproject.read_text()
    except OSError:
        text = ""
    if re.search(rf'^name\s*=\s*"{DIST}"', text, re.M):
        m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
        if m:
            return m[1]
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(DIST)
    except PackageNotFoundError:
        return "unknown"
