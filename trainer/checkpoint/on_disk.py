"""A checkpoint directory read and checked: trainer_state.json, the `latest` pointer, the
checkpoints of a root, and the manifests (size + crc32 of every file each rank wrote). Everything
here is read from disk another job or node wrote: each field is checked for shape and range,
each name for staying inside the checkpoint directory, and what is wrong is one line
(trainer/checkpoint/checkpointer.py turns it into a ConfigError on every rank)."""

from __future__ import annotations

import json
import math
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

from trainer.config import ConfigError

STATE_FILE = "trainer_state.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
PREEMPT_SUFFIX = ".preempt"


def crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


MAX_WORLD = 1 << 20  # as runner/delivery/resume_sync.py


def _count(v: Any, low: int, high: int | None = None) -> bool:
    return type(v) is int and v >= low and (high is None or v <= high)


def _state_error(state: Any) -> str | None:
    """What is wrong with a parsed trainer_state.json (its fields that resuming uses), or None."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a mapping"
    for key, low, high in (("step", 0, None), ("tokens_seen", 0, None), ("world_size", 1, MAX_WORLD)):
        if not _count(state.get(key), low, high):
            return f"'{key}' is {str(state.get(key))[:40]!r}, not an integer >= {low}" + (f" and <= {high}" if high else "")
    data = state.get("data")
    if not isinstance(data, dict):
        return "'data' is not a mapping"
    for key, low in (("global_batch", 1), ("consumed", 0)):
        if not _count(data.get(key), low):
            return f"'data.{key}' is {str(data.get(key))[:40]!r}, not an integer >= {low}"
    for key in ("scheduler", "model"):
        if not isinstance(state.get(key, {}), dict):
            return f"'{key}' is not a mapping"
    loss_min = state.get("loss_min")
    if loss_min is not None and not (type(loss_min) in (int, float) and math.isfinite(loss_min)):
        return f"'loss_min' is {str(loss_min)[:40]!r}, not a finite number"
    return None


def read_state(path: Path) -> dict:
    f = path / STATE_FILE
    if not f.is_file():
        raise ConfigError(f"{f}: missing; '{path}' is not a complete trainer checkpoint")
    try:
        state = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f}: corrupt ({e})") from None
    except RecursionError:
        raise ConfigError(f"{f}: corrupt (nested too deep)") from None
    err = _state_error(state)
    if err:
        raise ConfigError(f"{f}: corrupt ({err}); resume from another checkpoint")
    return state


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the complete checkpoints under root, oldest first (a malformed one is passed over)."""
    out = []
    for d in root.iterdir() if root.is_dir() else []:
        if d.is_dir() and not d.name.startswith(TMP_PREFIX) and (d / STATE_FILE).is_file():
            try:
                state = json.loads((d / STATE_FILE).read_text())
            except (OSError, ValueError, RecursionError):
                continue
            step = state.get("step") if isinstance(state, dict) else None
            if _count(step, 0):
                out.append((step, d))
    return sorted(out, key=lambda t: (t[0], t[1].stat().st_mtime))


def resolve_resume(value: str, root: Path) -> Path | None:
    """`latest` -> the pointed-at checkpoint (None when there is none yet: start fresh);
    a path -> that checkpoint, or a checkpoints root's latest."""
    if value == "latest":
        pointer = root / LATEST
        if not pointer.is_file():
            return None
        with pointer.open("rb") as f:
            name = f.read(4096).decode(errors="replace").strip()
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise ConfigError(f"{pointer}: names {name[:100]!r}, not a checkpoint directory of {root}; write "
                              "the name of one into it, or pass --checkpoint.resume DIR")
        if not (root / name).is_dir():
            raise ConfigError(f"{pointer}: points at '{name}', which does not exist under {root}")
        return root / name
    p = Path(value)
    if not p.exists() and (root / value).exists():
        p = root / value
    if p.is_dir() and (p / LATEST).is_file() and not (p / STATE_FILE).exists():
        return resolve_resume("latest", p)
    if not p.is_dir():
        raise ConfigError(f"checkpoint.resume: '{value}' is not a checkpoint directory")
    return p


def _manifest_error(files: Any) -> str | None:
    if not isinstance(files, dict):
        return f"a {type(files).__name__}, not a mapping of file names"
    for name, entry in files.items():
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            return f"lists {name[:100]!r}, which is not a file name in the checkpoint directory"
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                and (entry[1] is None or type(entry[1]) is int)):
            return f"{name[:100]!r}: {str(entry)[:40]!r} is not [size, crc32]"
    return None


def _read_manifest(path: Path, j: int, hint: str) -> tuple[dict, str | None]:
    m = path / f"manifest.rank{j}.json"
    if not m.is_file():
        return {}, f"{m}: missing (the checkpoint lacks rank {j}'s shard set){hint}"
    try:
        files = json.loads(m.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}, f"{m}: corrupt"
    except RecursionError:
        return {}, f"{m}: corrupt (nested too deep)"
    err = _manifest_error(files)
    return ({}, f"{m}: corrupt ({err})") if err else (files, None)


def _check_file(f: Path, size: int, manifest: str, hint: str) -> str | None:
    if not f.is_file():
        return f"{f}: missing (listed in {manifest}){hint}"
    if f.stat().st_size != size:
        return f"{f}: size {f.stat().st_size} != {size} recorded at save time (truncated or corrupt)"
    return None


def verify_manifests(path: Path, world_size: int, rank: int, nranks: int, *, all_present: bool = False,
                     crc: bool = True, hint: str = "") -> str | None:
    """Check the files listed by manifests j = rank, rank + nranks, ... (each rank checks a share).

    all_present (per-node storage): first check that every rank's manifest and every file they
    list are in this node's copy, since DCP may read any shard on any rank; `hint` is appended
    to "missing" errors (what to do about files that live on another node)."""
    hint = f"; {hint}" if hint else ""
    if all_present:
        for j in range(world_size):
            files, err = _read_manifest(path, j, hint)
            for name, (size, _) in files.items():
                err = err or _check_file(path / name, size, f"manifest.rank{j}.json", hint)
            if err:
                return err
    for j in range(rank, world_size, nranks):
        files, err = _read_manifest(path, j, hint)
        if err:
            return err
        for name, (size, want) in files.items():
            f = path / name
            err = _check_file(f, size, f"manifest.rank{j}.json", hint)
            if err:
                return err
            if crc and want is not None and crc32(f) != want:
                return f"{f}: checksum mismatch (corrupt)"
    return None


def scheduler_error(saved: dict, mine: dict) -> str | None:
    """Why a checkpoint's scheduler state is not one this run's scheduler wrote: LambdaLR's
    load_state_dict sets every key it is given as an attribute of the scheduler."""
    def kind(v: Any) -> Any:
        return "number" if type(v) in (int, float) else type(v)

    for key, value in saved.items():
        if key not in mine:
            return f"'scheduler.{key}' is not a field of this run's LR scheduler"
        want = mine[key]
        if kind(value) != kind(want) or (isinstance(want, list) and (
                len(value) != len(want) or any(kind(a) != kind(b) for a, b in zip(value, want, strict=True)))):
            return f"'scheduler.{key}' is {str(value)[:40]!r}, not like this run's {str(want)[:40]!r}"
    return None


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records of steps after the checkpoint (written before a crash; they are redone), so
    metrics.jsonl holds one record per step after a resume."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= step:
                keep.append(line)
        except (ValueError, AttributeError, TypeError, OverflowError, RecursionError):
            continue  # a line cut by the crash, or not one of ours
    # A temporary file of a new name (never a file that is there already), then swapped in.
    fd, tmp = tempfile.mkstemp(prefix=".metrics-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(ln + "\n" for ln in keep))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
