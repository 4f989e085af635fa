"""A dockerd of a test's own: its own data root (which a test may put on a small tmpfs), exec root
and socket; no bridge, no iptables, as the sandbox's engines. Root only (required in CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import require

DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"


@contextmanager
def own_dockerd(root: Path, data_root: Path | None = None, *args: str) -> Iterator[tuple[object, str]]:
    """(a docker-py client, its socket URL) of a dockerd kept under root (a short path: the socket
    must fit sun_path), its images under data_root (root/data by default); stopped after."""
    import docker

    require("root and dockerd", os.geteuid() == 0 and os.path.exists(DOCKERD), "a dockerd of the test's own")
    root.mkdir(parents=True, exist_ok=True)
    data_root = data_root or root / "data"
    url = f"unix://{root / 'sock'}"
    logf = open(root / "dockerd.log", "wb")
    proc = subprocess.Popen([DOCKERD, "--data-root", str(data_root), "--exec-root", str(root / "exec"),
                             "--pidfile", str(root / "pid"), "-H", url, "--bridge", "none", "--iptables=false",
                             "--ip6tables=false", *args], stdout=logf, stderr=logf)
    try:
        end = time.time() + 60
        while True:
            try:
                client = docker.DockerClient(base_url=url, version="auto")  # asks the version: up?
                break
            except Exception:  # noqa: BLE001 - not listening yet
                assert proc.poll() is None and time.time() < end, (root / "dockerd.log").read_text()[-2000:]
                time.sleep(0.2)
        yield client, url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
        subprocess.run(["umount", "-R", "-l", str(data_root)], capture_output=True)  # overlay mounts left
        shutil.rmtree(root, ignore_errors=True)
