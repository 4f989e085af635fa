"""Run ids: which names are runs, which run is "the latest", and what a prefix names. One rule for
every command (`status`, `logs`, `collect`, `down`, `up --resume`), whatever it found the ids in
(container labels, run dirs on the nodes).

A runner-made id is `YYYYmmdd-HHMMSS-xxxx` (UTC start time, sortable); `up --resume NAME` can also
continue a run dir someone named by hand. Only names a container can carry (`runner-<run>-<node>`)
count: a label or directory with anything else in it is not a run, and never reaches a command.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterable
from datetime import datetime, timezone

from runner.core.errors import UserError

RUN_ID_RE = re.compile(r"\d{8}-\d{6}-[0-9a-f]{4}")
RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")


def new_run_id(now: float | None = None) -> str:
    """Sortable by start time, unique enough for concurrent launches."""
    t = datetime.fromtimestamp(now or time.time(), tz=timezone.utc)
    return t.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def is_run_name(name: str | None) -> bool:
    return bool(name and RUN_NAME_RE.fullmatch(name))


def latest(ids: Iterable[str]) -> str | None:
    """The newest runner-made id; a hand-made name only when there is no runner-made one."""
    names = {i for i in ids if is_run_name(i)}
    made = [i for i in names if RUN_ID_RE.fullmatch(i)]
    pool = made or names
    return max(pool) if pool else None


def resolve(ids: Iterable[str], wanted: str | None, where: str = "the nodes") -> str:
    """The run `wanted` names (an id or a unique prefix), or the latest when it is None/"latest"."""
    names = sorted({i for i in ids if is_run_name(i)})
    if wanted in (None, "latest"):
        found = latest(names)
        if found is None:
            raise UserError(f"no runs found in {where} (no runner containers, no run dirs)")
        return found
    if not is_run_name(wanted):
        raise UserError(f"{wanted!r} is not a run id (letters, digits, '.', '_', '-'); see `runner ls`")
    if wanted in names:
        return wanted
    matches = [i for i in names if i.startswith(wanted)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UserError(f"{wanted}: ambiguous in {where}: {', '.join(matches[:5])}" + (" ..." if len(matches) > 5 else ""))
    hint = f" (latest: {latest(names)}; see `runner ls`)" if names else ""
    raise UserError(f"{wanted}: no such run in {where}{hint}")
