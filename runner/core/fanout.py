"""Per-node work in parallel, bounded: one helper that every per-node operation goes through.

A thousand-node inventory must not become a thousand threads each holding an SSH handshake and
its sockets at once: the pool is `--parallel N` wide (default 64), and the process's open-file
limit is raised to its hard limit at start (the usual soft 1024 ran out near 110 watched nodes).
"""

from __future__ import annotations

import argparse
import resource
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741
DEFAULT_PARALLEL = 64


def parallel(items: list[I], fn: Callable[[I], T], workers: int = DEFAULT_PARALLEL
             ) -> list[tuple[I, T | None, Exception | None]]:
    """fn over items, at most `workers` at a time; (item, result, error) in input order."""
    if not items:
        return []
    from concurrent.futures import ThreadPoolExecutor  # here: the CLI's parser imports this module at start

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as ex:
        futs = [ex.submit(fn, it) for it in items]
        out: list[tuple[I, T | None, Exception | None]] = []
        for it, f in zip(items, futs, strict=True):
            try:
                out.append((it, f.result(), None))
            except Exception as exc:  # noqa: BLE001 - reported per node by the caller
                out.append((it, None, exc))
        return out


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, else argparse's own one-line error."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", type=positive_int, default=DEFAULT_PARALLEL, metavar="N",
                   help=f"nodes worked on at once (default {DEFAULT_PARALLEL})")


def raise_open_file_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (what a user may do without privileges)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft
