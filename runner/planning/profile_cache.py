"""Where `runner profile` keeps what it measured, so `runner up` with `parallel.partition: auto`
measures a node once per (node, image, model shape, limits), not at every launch.

A node's entry is keyed by everything that changes its numbers: its name, address and limits
(cpus, memory), the id of the image it runs, the probe's version and timing, and the job's shape
(the config file's bytes, the trainer args, the env: OMP_NUM_THREADS changes a CPU's speed). A
link's entry is keyed by the two nodes' keys. Files live under $RUNNER_PROFILE_CACHE, else
~/.cache/runner/profiles; `runner profile --refresh` measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from runner.inventory import Job, Node


def cache_dir() -> Path:
    return Path(os.environ.get("RUNNER_PROFILE_CACHE") or Path.home() / ".cache" / "runner" / "profiles")


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# Trainer flags that change no measurement (the probe times a layer at the microbatch shape; it
# does not step, save or split): a job re-run with another partition, pipeline, length or
# checkpointing keeps its profile, and an elastic run's new layout plans from it.
IGNORED_FLAGS = ("--parallel.partition", "--partition_method", "--resume", "--checkpoint.resume",
                 "--parallel.pp", "--parallel.dp", "--checkpoint.replicas", "--checkpoint.interval",
                 "--train.steps", "--train_steps", "--train.exit_interval")
# Env that changes no measurement: the test-support hold (trainer/runtime/hold.py) acts between steps.
IGNORED_ENV = ("TRAINER_TEST_HOLD",)


def shape_args(args: list[str]) -> list[str]:
    """The job's trainer args minus IGNORED_FLAGS (and their values)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        name, eq, _ = a.partition("=")
        if name in IGNORED_FLAGS:
            skip = not eq
            continue
        out.append(a)
    return out


def node_key(node: Node, job: Job, image_id: str | None, version: int, min_seconds: float) -> str:
    config = hashlib.sha256(Path(job.config).read_bytes()).hexdigest() if job.config else None
    return _digest({"version": version, "node": node.name, "host": node.host, "addr": node.rank_addr, "port": node.port,
                    "image": image_id, "cpus": node.cpus, "memory": node.memory, "config": config,
                    "args": shape_args(job.args), "min_seconds": min_seconds,
                    "env": {k: v for k, v in {**job.env, **node.env}.items() if k not in IGNORED_ENV}})


def link_key(a: str, b: str) -> str:
    return _digest([a, b])


def _path(kind: str, name: str, key: str) -> Path:
    return cache_dir() / f"{kind}-{name}-{key}.json"


def load(kind: str, name: str, key: str) -> dict | None:
    try:
        return json.loads(_path(kind, name, key).read_text())
    except (OSError, ValueError, RecursionError):  # what a node once answered: checked again by doc_check
        return None


def save(kind: str, name: str, key: str, doc: dict) -> None:
    p = _path(kind, name, key)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(p)  # a reader never sees half a file
