"""The one way the runner reads a YAML file it is handed (an inventory, a `--job` file, the
`job.config` it sizes a job from): bounded before it is read, UTF-8 or one line saying so, and its
events checked before anything is built, so no file makes the runner spend more than its bounds.

Why each limit:
- size: read at most `max_bytes` + 1 bytes (a 2 GB file, or /dev/zero, is never read whole);
- a regular file only, opened without blocking (a FIFO named as an inventory hung `--dry-run`);
- UTF-8 (with or without a BOM): a Latin-1 or UTF-16 file ended in a UnicodeDecodeError traceback;
- no anchors or aliases (`&a`, `*a`, `<<: *a`): nine lines of nested aliases expand to 9^9 values;
- at most MAX_DEPTH levels of nesting (a RecursionError before) and MAX_VALUES values in all
  (4 MiB of `[1,1,1,...]` took 29 s and 760 MB to build);
- a scalar the constructor cannot make (an integer of 5,000 digits, a timestamp of month 13) is
  one line, not a ValueError traceback.

Every refusal is a UserError of one line naming the file (and line where there is one).
"""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml

from runner.core.errors import UserError

MAX_BYTES = 8 << 20       # an inventory of 10,000 nodes is about 1 MiB
MAX_VALUES = 1_000_000    # scalars, mappings and lists together
MAX_DEPTH = 32            # mappings and lists inside each other: an inventory needs 5
CONFIG_MAX_BYTES = 1 << 20  # a trainer config (job.config): the trainer's own bound (trainer/config/schema.py)

# libyaml's parser when PyYAML was built with it (10x faster on a 10,000-node inventory); the
# nodes it makes carry the same line marks.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Val:
    """A plain value plus where it came from."""

    __slots__ = ("value", "line")

    def __init__(self, value: Any, line: int):
        self.value = value
        self.line = line


def read_text(path: str, what: str, max_bytes: int = MAX_BYTES) -> str:
    """The file's text: a regular file of at most max_bytes, UTF-8. One line otherwise."""
    return decode(path, what, read_bytes(path, what, max_bytes))


def read_bytes(path: str, what: str, max_bytes: int) -> bytes:
    """A regular file's bytes, at most max_bytes (refused from its size before reading, and never
    more than max_bytes + 1 read), opened without blocking. One UserError line otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UserError(f"{path}: cannot read {what}: no such file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what}: {exc.strerror}") from None
    except ValueError:  # a NUL in the name
        raise UserError(f"{path!r}: cannot read {what}: a NUL in its name") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise UserError(f"{path}: cannot read {what}: {kind}; name a file")
        if st.st_size > max_bytes:  # refused unread
            raise UserError(f"{path}: {what} is {st.st_size} bytes, over the {max_bytes} bytes this runner reads; "
                            "it holds settings, not data")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise UserError(f"{path}: cannot read {what}: {exc.strerror}") from None
    if len(data) > max_bytes:  # grew since the stat
        raise UserError(f"{path}: {what} is over the {max_bytes} bytes this runner reads; it holds settings, not data")
    return data


def decode(path: str, what: str, data: bytes) -> str:
    """UTF-8 text (a UTF-8 BOM dropped); another encoding is one line naming the first bad byte's line."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError(f"{path}: {what} is UTF-16 (it starts with a UTF-16 byte-order mark); save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: {what} is not UTF-8 (byte {data[exc.start]:#04x}); save it as UTF-8") \
            from None


def _scan(path: str, text: str) -> None:
    """Anchors, aliases, depth and the count of values, from libyaml's events, before anything is
    composed: what a file costs to build is bounded here. Refusals name the line and, for depth,
    the field path (built from the keys seen on the way down)."""
    stack: list[list] = []  # per open collection: ["map", expecting_key, key] or ["seq", index]
    count = 0
    for ev in yaml.parse(text, Loader=LOADER):
        line = ev.start_mark.line + 1
        if isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None) is not None:
            raise UserError(f"{path}:{line}: YAML anchors and aliases (&name, *name, <<: *name) "
                            "are not accepted: write the values out (`defaults:` holds what every node shares)")
        if isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            stack.pop()
            continue
        if not isinstance(ev, (yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            continue
        count += 1
        if count > MAX_VALUES:
            raise UserError(f"{path}:{line}: more than {MAX_VALUES} values; not an inventory or a config")
        top = stack[-1] if stack else None
        if top is not None and top[0] == "map" and top[1]:  # a key: the path names it from here on
            top[1], top[2] = False, ev.value if isinstance(ev, yaml.ScalarEvent) else "?"
        elif top is not None:  # a value: the mapping expects its next key, the list counts it
            top[1] = True if top[0] == "map" else top[1] + 1
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(stack) >= MAX_DEPTH + 1:
                raise UserError(f"{path}:{line}: {_where(stack)}: nested more than {MAX_DEPTH} levels deep; "
                                "not an inventory or a config")
            stack.append(["map", True, None] if isinstance(ev, yaml.MappingStartEvent) else ["seq", 0])


def _where(stack: list[list]) -> str:
    out = ""
    for entry in stack:
        if entry[0] == "map" and entry[2] is not None:
            out += f".{entry[2]}" if out else str(entry[2])
        elif entry[0] == "seq":
            out += f"[{entry[1] - 1}]"
    return visible(out) or "the document"


def visible(where: str) -> str:
    """A field path built from the file's own keys, with any control character escaped: the
    message stays one line, and a key cannot write to the terminal."""
    return where if where.isprintable() else where.encode("unicode_escape").decode()


class _Scalars(yaml.constructor.SafeConstructor):
    """One constructor for every scalar of a file (a loader per scalar cost most of the parse)."""

    def scalar(self, node: yaml.ScalarNode) -> Any:
        try:
            return self.construct_object(node, deep=True)
        finally:
            self.constructed_objects.clear()


def _convert(node: yaml.Node, path: str, where: str = "", sc: _Scalars | None = None) -> Val:
    sc = sc or _Scalars()
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, tuple[int, Val]] = {}
        for k, v in node.value:
            key = str(_scalar(sc, k, path, where)) if isinstance(k, yaml.ScalarNode) else str(k)
            w = f"{where}.{key}" if where else key
            kline = k.start_mark.line + 1
            if key in out:
                # YAML says keys are unique; PyYAML silently keeps the last, hiding a typo'd edit.
                raise UserError(f"{path}:{kline}: {visible(w)}: duplicate key (first at line {out[key][0]}); keep one")
            out[key] = (kline, _convert(v, path, w, sc))
        return Val(out, line)
    if isinstance(node, yaml.SequenceNode):
        return Val([_convert(v, path, f"{where}[{i}]", sc) for i, v in enumerate(node.value)], line)
    return Val(_scalar(sc, node, path, where), line)


def _scalar(sc: _Scalars, node: yaml.ScalarNode, path: str, where: str) -> Any:
    try:
        return sc.scalar(node)
    except (ValueError, OverflowError) as exc:  # int('9' * 5000), a timestamp of month 13
        shown = node.value[:40] + ("..." if len(node.value) > 40 else "")
        raise UserError(f"{path}:{node.start_mark.line + 1}: {visible(where) or 'value'}: {shown!r} cannot be read "
                        f"({str(exc).split(':')[0][:80]})") from None


def compose(path: str, text: str) -> Val | None:
    """The document of `text` (read from `path`) with each value's line kept; None when empty."""
    try:
        _scan(path, text)
        node = yaml.compose(text, Loader=LOADER)
        return None if node is None else _convert(node, path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark else 1
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{path}:{line}: YAML syntax error: {visible(str(problem))}") from None


def plain(v: Val | None) -> Any:
    """The value without line numbers: dicts, lists and scalars (a mapping's keys are strings)."""
    if v is None:
        return None
    if isinstance(v.value, dict):
        return {k: plain(x) for k, (_, x) in v.value.items()}
    if isinstance(v.value, list):
        return [plain(x) for x in v.value]
    return v.value


def load(path: str, what: str, max_bytes: int = MAX_BYTES) -> Any:
    """A YAML file as plain data, through every limit above (job.config for sizing, a profile's
    config): one UserError line naming the file for anything it refuses."""
    return plain(compose(path, read_text(path, what, max_bytes)))
