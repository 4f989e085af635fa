"""What under a checkpoint root is the trainer's own: the one rule every removal and replacement
there goes through (trainer/checkpoint/checkpointer.py, its pruning, `latest`, crash leftovers).

The trainer deletes or replaces only what it wrote. A checkpoint directory is the trainer's when
  - it holds MARKER, a small file the trainer writes first into every directory it creates there
    (`.tmp-<name>/`, later renamed `<name>/`; listed in rank 0's manifest, so `runner up --resume`
    copies it with the rest), or
  - it is a complete checkpoint by its manifests (trainer versions before the marker, a copy the
    runner assembled): trainer_state.json and at least one `manifest.rank<r>.json`, and nothing in it
    but files those manifests list at their recorded size, the manifests themselves and the files
    rank 0 shares with every node (storage.RANK0_FILES).
Anything else is someone else's: a user's `step-2/` with a thesis in it, a link, a file. Where one
stands where a save must write, the save is refused in one line naming it (nothing touched); a
foreign directory that only looks like an old checkpoint is left out of pruning. `latest` is
replaced only when it is a pointer: a regular file of one line naming a checkpoint of the root.
Before, a save's `rmtree` of `<name>/` deleted whatever folder of that name was there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

from trainer.checkpoint.on_disk import LATEST, PREEMPT_SUFFIX, STATE_FILE, TMP_PREFIX
from trainer.checkpoint.storage import RANK0_FILES

MARKER = ".trainer-checkpoint"
MARKER_TEXT = b"written by the trainer: a checkpoint directory it may replace or prune\n"
POINTER_MAX = 4096            # bytes of a `latest` pointer (on_disk.resolve_resume reads as many)
MANIFEST_MAX = 16 << 20       # bytes of one manifest read to recognise an unmarked checkpoint
MANIFEST_RE = re.compile(r"manifest\.rank\d{1,7}\.json")
MOVE_AWAY = "nothing was changed: move it elsewhere, or set checkpoint.dir to another directory"


def _lstat(p: Path) -> os.stat_result | None:
    try:
        return os.lstat(p)
    except OSError:
        return None


def _marked(d: Path) -> bool:
    st = _lstat(d / MARKER)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != len(MARKER_TEXT):
        return False
    try:
        with open(d / MARKER, "rb") as f:
            return f.read(len(MARKER_TEXT) + 1) == MARKER_TEXT
    except OSError:
        return False


def _complete_by_manifests(d: Path) -> bool:
    """An unmarked directory that is nothing but a trainer checkpoint (module doc)."""
    try:
        entries = list(os.scandir(d))
    except OSError:
        return False
    sizes: dict[str, int] = {}
    for e in entries:
        if e.is_symlink() or not e.is_file(follow_symlinks=False):
            return False
        sizes[e.name] = e.stat(follow_symlinks=False).st_size
    manifests = [n for n in sizes if MANIFEST_RE.fullmatch(n)]
    if STATE_FILE not in sizes or not manifests:
        return False
    listed: dict[str, int] = {}
    for name in manifests:
        if sizes[name] > MANIFEST_MAX:
            return False
        try:
            files = json.loads((d / name).read_bytes())
        except (OSError, ValueError, RecursionError):
            return False
        if not isinstance(files, dict):
            return False
        for f, entry in files.items():
            if not (isinstance(entry, list) and entry and type(entry[0]) is int):
                return False
            listed[f] = entry[0]
    return all(n in manifests or n in RANK0_FILES or n == MARKER or listed.get(n) == size
               for n, size in sizes.items())


def is_ours(path: Path) -> bool:
    """Whether `path` is a checkpoint directory the trainer wrote (module doc): never a link."""
    st = _lstat(path)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return False
    return _marked(path) or _complete_by_manifests(path)


def _kind(path: Path) -> str:
    st = _lstat(path)
    if st is None:
        return "nothing"
    if stat.S_ISLNK(st.st_mode):
        return "a link"
    return "a folder" if stat.S_ISDIR(st.st_mode) else "a file"


def in_the_way(path: Path) -> str | None:
    """Why a save cannot make or replace `path` (one line), or None when nothing or ours is there."""
    if _lstat(path) is None or is_ours(path):
        return None
    return (f"{path}: {_kind(path)} the trainer did not write stands where a checkpoint goes (no {MARKER} "
            f"and not a checkpoint by its manifests); {MOVE_AWAY}")


def make(d: Path) -> None:
    """Create `d` (which must not exist: mkdir refuses otherwise) and mark it as the trainer's.
    When the marker cannot be written (a full disk), the empty directory goes again: a leftover
    without the marker would stand in the way of every later save."""
    d.mkdir()
    try:
        fd = os.open(d / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(MARKER_TEXT)
    except BaseException:
        (d / MARKER).unlink(missing_ok=True)
        d.rmdir()
        raise


def remove(path: Path) -> bool:
    """Delete `path` when it is the trainer's; leave it (False) otherwise."""
    if not is_ours(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def name_pattern(template: str, prefix: str) -> re.Pattern[str]:
    """The names this run gives its checkpoints (checkpoint.name / checkpoint.prefix), .preempt too."""
    if prefix:
        body = re.escape(prefix) + r"\.\d{4}_\d{4}_\d{4}_\d{2}(?:-\d+)?"
    else:
        head, _, tail = template.partition("{step}")
        body = re.escape(head) + r"(?P<step>\d+)" + re.escape(tail)
    return re.compile(body + f"(?:{re.escape(PREEMPT_SUFFIX)})?")


def pointer_problem(root: Path, looks_like: re.Pattern[str]) -> str | None:
    """Why `root/latest` may not be replaced, or None: absent, or a pointer (a regular file of at
    most POINTER_MAX bytes, one line naming a checkpoint of root that is the trainer's, or, when that
    name is gone, a name of this run's naming)."""
    pointer = root / LATEST
    st = _lstat(pointer)
    if st is None:
        return None
    why = f"{pointer}: {_kind(pointer)} the trainer did not write"
    if stat.S_ISREG(st.st_mode) and st.st_size <= POINTER_MAX:
        try:
            text = pointer.read_bytes().decode()
        except (OSError, UnicodeDecodeError):
            text = ""
        name = text[:-1] if text.endswith("\n") else text
        plain = name not in ("", ".", "..") and not any(c in name for c in "/\n\0")
        if plain and (is_ours(root / name) or (_lstat(root / name) is None and looks_like.fullmatch(name))):
            return None
        why = f"{pointer}: not a pointer the trainer wrote (one line naming a checkpoint of {root})"
    return f"{why} stands where the trainer keeps its `latest` pointer; {MOVE_AWAY}"


def write_pointer(root: Path, name: str) -> None:
    """`latest` := name, atomically, through a temporary file of a new name (O_EXCL: an existing
    file of the user's is never opened for writing)."""
    for n in range(100):
        tmp = root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}-{n}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        try:
            with os.fdopen(fd, "w") as f:
                f.write(name + "\n")
            os.replace(tmp, root / LATEST)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return
    raise FileExistsError(f"{root}: no free temporary name for the `latest` pointer")


def future_problem(root: Path, looks_like: re.Pattern[str], after_step: int, last_step: int) -> str | None:
    """At the start of a run: the first thing of root that would stand in the way of a save of steps
    (after_step, last_step], or of `latest` (one line), so a run is refused before it trains, not
    at its first save."""
    if not root.exists():
        return None
    if not root.is_dir():
        return f"checkpoint.dir: '{root}' exists and is not a directory; {MOVE_AWAY}"
    # Names with a time stamp (checkpoint.prefix) are chosen free at each save: only `latest` matters.
    for entry in sorted(root.iterdir()) if "step" in looks_like.groupindex else []:
        m = looks_like.fullmatch(entry.name.removeprefix(TMP_PREFIX))
        if m is not None and after_step < int(m["step"]) <= last_step and (why := in_the_way(entry)):
            return why
    return pointer_problem(root, looks_like)
