"""What the container a trainer runs in may use (Docker --memory / --cpus from the inventory's
`memory:` / `cpus:`), read from its cgroup: v2 (`memory.max`, `cpu.max`) or v1
(`memory/memory.limit_in_bytes`, `cpu/cpu.cfs_quota_us`). Inside a container sysconf and
/proc/meminfo still describe the host. Read by `trainer probe` and by the check before the model
is built (trainer/models/build.py)."""

from __future__ import annotations

from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def read_int(path: Path | str) -> int | None:
    """The file's number, None when it is missing or not all digits (v2's "max", v1's "-1")."""
    try:
        raw = Path(path).read_text()[:32].strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


def memory_limit(cgroup: Path | None = None) -> tuple[int, Path] | None:
    """(bytes, the file that says so) of the container's memory limit; None when there is none to
    read. v1's "unlimited" is a huge number: callers compare with what the machine has."""
    root = cgroup or CGROUP
    for f in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        limit = read_int(f)
        if limit:
            return limit, f
    return None


def cpus(cgroup: Path | None = None) -> float | None:
    """The container's CPU quota (Docker --cpus) in CPUs, None when unlimited."""
    root = cgroup or CGROUP
    v2 = root / "cpu.max"
    if v2.exists():
        quota, _, period = v2.read_text().strip().partition(" ")
        return None if quota == "max" else round(int(quota) / int(period), 3)
    quota, period = read_int(root / "cpu" / "cpu.cfs_quota_us"), read_int(root / "cpu" / "cpu.cfs_period_us")
    if quota is None or period is None:  # "-1" is not all digits: unlimited
        return None
    return round(quota / period, 3)
