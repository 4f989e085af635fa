"""Relative paths that come from somewhere the runner does not trust (a node's SFTP listing, a
node's checkpoint listing, a file tree about to be sent) checked before any of them becomes a
path here or on another node.

The rule, one component at a time: not empty, not `.` or `..`, no `/` inside a name (a listing
entry is one name), no NUL, no control character (C0, DEL, C1: they would also reach a terminal),
at most NAME_MAX bytes; the whole path relative and at most PATH_MAX bytes. Then `under()` keeps
the resolved destination under its root through any link already there: a checked name cannot
climb out, and neither can a symlink someone left in the destination.
"""

from __future__ import annotations

import os
from pathlib import Path

NAME_MAX = 255
PATH_MAX = 4096


def _control(ch: str) -> bool:
    o = ord(ch)
    return o < 0x20 or 0x7F <= o <= 0x9F


def name_error(name: str) -> str | None:
    """Why `name` cannot be one component of a path, or None."""
    if name == "":
        return "an empty name"
    if name in (".", ".."):
        return f"{name!r} as a name"
    if "/" in name:
        return "a '/' inside one name"
    if "\0" in name:
        return "a NUL byte"
    if any(_control(ch) for ch in name):
        return "a control character"
    if len(name.encode(errors="surrogateescape")) > NAME_MAX:
        return f"a name over {NAME_MAX} bytes"
    return None


def rel_error(rel: str) -> str | None:
    """Why a '/'-separated relative path cannot be used under a root, or None."""
    if rel.startswith("/"):
        return "an absolute path"
    if len(rel.encode(errors="surrogateescape")) > PATH_MAX:
        return f"a path over {PATH_MAX} bytes"
    for part in rel.split("/"):
        if why := name_error(part):
            return why
    return None


def shown(rel: str) -> str:
    """A path for a one-line message: repr makes control characters and NULs visible, and a
    hostile name cannot make the line long."""
    r = repr(rel)
    return r if len(r) <= 200 else r[:200] + "..."


def under(root: str | os.PathLike, rel: str) -> Path:
    """root/rel, once rel passes rel_error and the path, resolved through every link that already
    exists on the way, still lies under root (resolved as well: a root that is itself a link is
    the user's choice). ValueError with the reason otherwise."""
    if why := rel_error(rel):
        raise ValueError(f"{shown(rel)}: {why}")
    base = os.path.realpath(root)
    path = os.path.join(root, *rel.split("/"))
    real = os.path.realpath(path)
    if real != base and not real.startswith(base.rstrip("/") + "/"):
        raise ValueError(f"{shown(rel)}: leads out of {root} through a link (to {real})")
    return Path(path)
