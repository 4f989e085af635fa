"""What a node's probe sends back (its profile.json) and what a run dir's partition.json says,
checked before they are cached, planned with, printed or handed to the trainer: both come from
the node, so a number is a finite one, a name is a plain name, and a split is digits and commas.
A document that fails is the node's error in one line; a cached one that fails is measured again."""

from __future__ import annotations

import json
import math
import re

from runner.core.errors import UserError

KINDS = ("embed", "block", "head")
PER_KIND = ("time_s", "optim_s", "act_bytes", "train_bytes")
NODE_NUMBERS = ("memory_available", "boundary_bytes", "model_bytes", "runtime_bytes")
MODEL_INTS = ("num_layers", "hidden_size", "seq_len", "microbatch", "microbatches", "pp")
NAME = re.compile(r"[A-Za-z0-9_.+-]{1,64}")  # a model family, a dtype, a schedule
SPLIT = re.compile(r"custom:\d{1,7}(,\d{1,7}){0,4095}")  # as runner/profile/split.py writes it


def loads(text: str | None) -> object:
    """A node's JSON document, or None when it is not one (nested past Python's recursion limit
    too: RecursionError is not a ValueError, and ended `runner profile` in a traceback)."""
    try:
        return json.loads(text) if text else None
    except (ValueError, RecursionError):
        return None


def _number(x: object, positive: bool = False) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        v = float(x)
    except OverflowError:
        return False
    return math.isfinite(v) and (v > 0 if positive else v >= 0)


def problem(doc: object, compute: bool, link: bool) -> str | None:
    """Why a node's probe document cannot be used (None: it can). compute, link: which of its
    parts are needed (a probe run for a link alone measures no compute)."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if link:
        lk = doc.get("link")
        if not (isinstance(lk, dict) and _number(lk.get("latency_s")) and _number(lk.get("bandwidth_Bps"), positive=True)):
            return "link needs latency_s >= 0 and bandwidth_Bps > 0"
    return _compute_problem(doc) if compute else None


def _compute_problem(doc: dict) -> str | None:
    for key in PER_KIND:
        per = doc.get(key)
        if not isinstance(per, dict) or not all(_number(per.get(k)) for k in KINDS):
            return f"{key} needs a number >= 0 for each of {', '.join(KINDS)}"
    for key in NODE_NUMBERS:
        if not _number(doc.get(key)):
            return f"{key} is not a number >= 0"
    model = doc.get("model")
    if not isinstance(model, dict):
        return "model is not a mapping"
    for key in MODEL_INTS:
        v = model.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 31):
            return f"model.{key} is not a positive integer"
    for key in ("family", "dtype", "pp_schedule"):
        if not (isinstance(model.get(key), str) and NAME.fullmatch(model[key])):
            return f"model.{key} is not a plain name (letters, digits, _ . + -)"
    vs = model.get("virtual_stages", 1)
    if not (isinstance(vs, int) and not isinstance(vs, bool) and 0 < vs < 1 << 16):
        return "model.virtual_stages is not a positive integer"
    return None


def node_doc(doc: object, node: str, where: str, compute: bool, link: bool) -> dict:
    """doc when it can be used; one UserError naming the node, the file and the field otherwise."""
    why = problem(doc, compute, link)
    if why is not None:
        raise UserError(f"profile: node {node}: {where}: {why}; not using it (is the node's image this runner's?)")
    return doc  # type: ignore[return-value]


def split_spec(spec: object, node: str, where: str) -> str:
    """A recorded split as the trainer's `--parallel.partition` value, or one UserError."""
    if not (isinstance(spec, str) and SPLIT.fullmatch(spec)):
        shown = repr(spec)[:80].encode("ascii", "backslashreplace").decode()
        raise UserError(f"node {node}: {where}: spec {shown} is not custom:<layer bounds> as the planner writes it; "
                        "delete the file to plan the split again")
    return spec
