"""A small real filesystem that fills up: a tmpfs of a few MiB mounted for one test (root only, as
the sandbox is; required in CI, skipped elsewhere), so "no room left" is the kernel's, not a mock's."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import require


@contextmanager
def small_fs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes at path, unmounted after."""
    require("root (to mount a small tmpfs)", os.geteuid() == 0, "not root")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave: int) -> None:
    """Write a filler file under path until `leave` bytes of its filesystem are free."""
    import shutil

    free = shutil.disk_usage(path).free
    with open(path / ".filler", "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))
