"""Fuzz of the relay agent's header check (runner/agents/relay_agent.py parse_header) against three real tar
readers of other implementations: Python's tarfile, GNU tar, and Go's archive/tar (the reader
inside `docker load`; tests/tarlist/main.go, built here with Debian's golang-go). Thousands of
headers, each a real writer's header (the relay's own, tarfile's ustar/GNU/pax, GNU tar's
ustar/gnu/oldgnu/v7/pax) mutated the ways readers are known to disagree on: NUL- or space-led
and unterminated octal, base-256, checksum spellings and signed sums, other magics and versions,
prefix fields (which Go reads as GNU atime/ctime when they parse as octal), typeflags, names and
sizes at their boundaries. Every header the check accepts must be read by all three as the same
regular file, of the same name and size; the check must refuse every mutation that readers
disagree on, and still accept the plain variations a writer may choose."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from runner.agents.relay_agent import BLOCK, END, SIZE_MAX, Refused, member_header, parse_header
from tests.conftest import require
from tests.support.tar_blocks import FIELDS, checksum, patched

CASES = 6000
NUMERIC = ("mode", "uid", "gid", "size", "mtime", "devmajor", "devminor")
SIZES = (0, 1, 511, 512, 513, 1024, 4095, 70_000, 2 ** 31, 2 ** 33 - 1, SIZE_MAX - 1, SIZE_MAX, SIZE_MAX + 1,
         8 ** 12 - 1, 2 ** 40)


def _name(rnd: random.Random) -> str:
    parts = ["".join(rnd.choice("abcdef0123456789._-XYZ") for _ in range(rnd.randint(1, 30))) for _ in range(rnd.randint(1, 3))]
    name = "/".join(("a" + p) if p[0] in "._-" else p for p in parts)
    return name[:rnd.choice((99, 99, 60, 20))].rstrip("/") or "a"


def _octal(rnd: random.Random, width: int, value: int) -> bytes:
    """value in a field of width bytes, spelt one of the ways writers (and attackers) spell it."""
    digits = b"%o" % value
    form = rnd.randrange(16)
    if form == 0:
        return digits.rjust(width - 1, b"0") + b"\0"                  # the usual: zero-padded, NUL
    if form == 1:
        return (digits.rjust(width - 2, b"0") + b" \0")[-width:]        # GNU's checksum style
    if form == 2:
        return digits + bytes(rnd.choice(b" \0") for _ in range(width - len(digits)))  # short, mixed terminators
    if form == 3:
        return b"\0" + digits.rjust(width - 2, b"0") + b"\0"             # NUL-led: 0 to some, value to others
    if form == 4:
        return b" " + digits.rjust(width - 2, b"0") + b"\0"              # space-led
    if form == 5:
        return digits.rjust(width, b"0")                                # no terminator
    if form == 6:
        return b"\x80" + value.to_bytes(width - 1, "big", signed=False) if value < 256 ** (width - 1) else b"\xff" * width
    if form == 7:
        return digits + b"\0" + b"7" * (width - len(digits) - 1)       # text after the terminator
    if form == 8:
        return bytes(width)                                             # unset
    if form == 9:
        return b" " * width
    if form == 10:
        return rnd.choice((b"+", b"-")) + digits.rjust(width - 2, b"0") + b"\0"
    if form == 11:
        return digits[:1] + b" " + digits[1:] + b"\0"                   # a space inside
    if form == 12:
        return digits.rjust(width - 1, b"0").replace(b"7", b"8", 1) + b"\0"  # not octal
    if form == 13:
        return (b"%o" % value).rjust(width - 1, b" ") + b"\0"            # space-padded left (old writers)
    return digits.rjust(width - 1, b"0") + rnd.choice((b"\0", b" "))


def _with_checksum(b: bytes, rnd: random.Random) -> bytes:
    """b with a checksum spelt one of the ways writers spell it, a signed sum, or left stale."""
    form = rnd.choice((0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9))
    if form == 9:
        return b  # stale
    value = checksum(b, signed=form == 8)
    spelt = {0: b"%06o\0 ", 1: b"%07o\0", 2: b"%06o  ", 3: b"%o\0", 4: b" %06o\0", 5: b"%08o",
             6: b"\0%06o\0", 7: b"%o \0 ", 8: b"%06o\0 "}[form] % value
    return patched(b, fix_checksum=False, chksum=spelt)


def _mutate(b: bytes, rnd: random.Random) -> bytes:
    m = rnd.randrange(-6, 14)
    if m <= 2:  # a numeric field (size most often), spelt another way or at a boundary
        field = "size" if m <= 0 else rnd.choice(NUMERIC)
        a, z = FIELDS[field]
        value = rnd.choice(SIZES) if field == "size" else rnd.choice((0, 1, 0o644, 0o7777, 0o10000, 8 ** 7 - 1,
                                                                       rnd.randrange(8 ** 7)))
        return patched(b, **{field: _octal(rnd, z - a, value)})
    if m == 3:
        magic = rnd.choice((b"ustar\x0000", b"ustar\x00  ", b"ustar  \x00", b"ustar\x00\x00\x00", bytes(8),
                            b"USTAR\x0000", b"ustar 00", b"ustar\x0001"))
        return patched(b, magic=magic[:6], version=magic[6:])
    if m == 4:
        return patched(b, type=bytes([rnd.choice(b"0\x00123456789ASDgxKLNVMI" + bytes([rnd.randrange(256)]))]))
    if m == 5:
        return patched(b, prefix=rnd.choice((_name(rnd).encode(), b"%011o\0%011o\0" % (rnd.randrange(8 ** 11),
                                                                                         rnd.randrange(8 ** 11)),
                                             b"\0" + _name(rnd).encode(), b"0", b"/")))
    if m == 6:
        name = _name(rnd).encode()
        return patched(b, name=rnd.choice((name, name + b"/", b"../" + name, b"/" + name, name + b"\0x",
                                           b"a" * 100, name.replace(b"a", b"\xc3\xa9", 1), b"", b"./" + name,
                                           name.replace(b"a", b" ", 1), b"a/../" + name, b"x\\y")))
    if m == 7:
        return patched(b, linkname=rnd.choice((b"x", b"\0x", _name(rnd).encode())))
    if m == 8:
        return patched(b, pad=rnd.choice((b"\0\0\0\0\0\0\0\0tar\0", b"x", b"\0" * 11 + b"\x01")))
    if m == 9:
        field = rnd.choice(("uname", "gname"))
        return patched(b, **{field: rnd.choice((b"root", b"", b"r" * 32, b"\0root", b"ro ot", b"\xc3\xa9",
                                                b"nobody", b"a\0b"))})
    if m == 10:  # any byte anywhere
        i = rnd.randrange(BLOCK)
        return b[:i] + bytes([rnd.randrange(256)]) + b[i + 1:]
    return b  # unchanged (bar the checksum below): the plain variations must still pass


def _bases(rnd: random.Random, tmp: Path) -> list[bytes]:
    """Header blocks of real writers: the relay's own, Python's tarfile, GNU tar in every format."""
    out = [member_header(_name(rnd), rnd.choice(SIZES[:-3])) for _ in range(20)]
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        for _ in range(10):
            info = tarfile.TarInfo(_name(rnd))
            info.size, info.mode, info.mtime = rnd.choice(SIZES[:-3]), rnd.choice((0o644, 0o755, 0o4755)), rnd.randrange(2 ** 33)
            info.uid, info.gid, info.uname, info.gname = rnd.randrange(70000), rnd.randrange(9), "root", "staff"
            out.append(info.tobuf(fmt, "utf-8", "surrogateescape")[-BLOCK:])
    src = tmp / "src"
    src.mkdir()
    names = [_name(random.Random(i)).replace("/", "_") for i in range(4)]
    for i, n in enumerate(names):
        (src / n).write_bytes(os.urandom(i * 300))
    for fmt in ("ustar", "gnu", "oldgnu", "v7", "pax"):
        data = subprocess.run(["tar", f"--format={fmt}", "-cf", "-", "-C", str(src), *names], capture_output=True,
                              check=True).stdout
        out += [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)
                if any(data[i:i + BLOCK]) and data[i + 257:i + 262] in (b"ustar", bytes(5)) and data[i + 148:i + 155].strip(b" \0").isdigit()]
    return out


def _cases(tmp: Path, n: int, seed: int = 23) -> list[bytes]:
    rnd = random.Random(seed)
    bases = _bases(rnd, tmp)
    ustar = [b for b in bases if b[257:265] == b"ustar\x0000"]  # most cases start from one: they get past the magic
    out = []
    for _ in range(n):
        b = rnd.choice(ustar if rnd.random() < 0.8 else bases)
        for _ in range(rnd.choice((1, 1, 1, 2, 3))):
            b = _mutate(b, rnd)
        out.append(_with_checksum(b, rnd) if rnd.random() < 0.85 else b)
    return out


@pytest.fixture(scope="module")
def go_tarlist(tmp_path_factory) -> Path:
    require("Go (Debian golang-go)", shutil.which("go") is not None, "go is not on PATH")
    out = tmp_path_factory.mktemp("tarlist")
    env = {**os.environ, "GO111MODULE": "off", "CGO_ENABLED": "0"}  # stdlib only; Go's own build cache
    subprocess.run(["go", "build", "-o", str(out / "tarlist"), str((Path(__file__).resolve().parents[1] / "tarlist") / "main.go")],
                   env=env, cwd=out, check=True, capture_output=True, timeout=300)
    return out / "tarlist"


def _archive(path: Path, accepted: list[tuple[bytes, int]]) -> None:
    """Each header followed by its content as a hole (a sparse file: sizes up to 8 GiB cost nothing;
    every reader seeks over them), then the end blocks."""
    pos = 0
    with open(path, "wb") as f:
        for block, size in accepted:
            f.seek(pos)
            f.write(block)
            pos += BLOCK + -(-size // BLOCK) * BLOCK
        f.seek(pos)
        f.write(END)


def _python(path: Path) -> list[tuple[str, int, str]]:
    with tarfile.open(path, "r:") as tf:
        return [("file" if m.type == tarfile.REGTYPE else repr(m.type), m.size, m.name) for m in tf]


def _gnu(path: Path) -> list[tuple[str, int, str]]:
    res = subprocess.run(["tar", "--list", "--verbose", "--numeric-owner", "--quoting-style=escape", "-f", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and not res.stderr, res.stderr[-2000:]
    out = []
    for line in res.stdout.splitlines():
        words = line.split()
        out.append(("file" if words[0].startswith("-") else words[0][:1], int(words[2]), words[-1]))
    return out


def _go(path: Path, tarlist: Path) -> list[tuple[str, int, str]]:
    res = subprocess.run([str(tarlist), str(path)], capture_output=True, text=True, timeout=120)
    lines = res.stdout.splitlines()
    assert lines and lines[-1] == "END", lines[-3:]
    out = []
    for line in lines[:-1]:
        kind, size, name = line.split(" ", 2)
        out.append(("file" if kind == str(ord("0")) else kind, int(size), json.loads(name)))
    return out


def test_no_header_the_check_accepts_is_read_otherwise(tmp_path, go_tarlist):
    headers = _cases(tmp_path, CASES)
    accepted, refused = [], 0
    for b in headers:
        try:
            accepted.append((b, *parse_header(b)))
        except Refused:
            refused += 1
    print(f"\n[figure] {len(headers)} mutated headers: {len(accepted)} accepted, {refused} refused")
    # Enough of both that the comparison says something: the plain variations pass, the rest is refused.
    assert len(accepted) > CASES // 6 and refused > CASES // 3, (len(accepted), refused)
    assert len({b for b, _, _ in accepted}) > CASES // 10  # not one header over and over
    path = tmp_path / "accepted.tar"
    _archive(path, [(b, size) for b, _, size in accepted])
    want = [("file", size, name) for _, name, size in accepted]
    for reader, got in (("Python tarfile", _python(path)), ("GNU tar", _gnu(path)), ("Go archive/tar", _go(path, go_tarlist))):
        diff = [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=False)) if w != g]
        assert len(got) == len(want) and not diff, (reader, len(got), len(want), diff[:1],
                                                    accepted[diff[0][0]][0] if diff else None)


@pytest.mark.parametrize("block, why", [
    (patched(member_header("a", 0), size=b"\0" + b"%010o" % 512 + b"\0"), "NUL-led size: 0 to tarfile, 512 to Go and GNU"),
    (patched(member_header("a", 512), magic=b"ustar ", version=b" \0", prefix=b"%011o\0%011o\0" % (1, 1)),
     "GNU magic with a prefix: Go reads the prefix as times (name 'a'), the relay's first check read '1/a'"),
    (patched(member_header("a", 512), prefix=b"etc"), "ustar prefix: 'etc/a' to every reader, never needed here"),
    (patched(member_header("a", 512), size=b"\x80" + (512).to_bytes(11, "big")), "base-256 size"),
    (patched(member_header("a", 512), type=b"\0"), "old regular-file type: a directory to Go if the name ends in /"),
])
def test_headers_readers_disagree_on_are_refused(block, why):
    with pytest.raises(Refused):
        parse_header(block)


def test_the_relays_own_headers_read_alike(tmp_path, go_tarlist):
    """member_header at every size it may write, and names of the lengths docker save uses."""
    rnd = random.Random(5)
    items = [(member_header(n, s), n, s) for s in SIZES if s <= SIZE_MAX
             for n in ("manifest.json", f"{'a' * 64}.json", f"{'b' * 64}/layer.tar", f"blobs/sha256/{'c' * 64}", _name(rnd))]
    assert all(parse_header(b) == (n, s) for b, n, s in items)
    path = tmp_path / "own.tar"
    _archive(path, [(b, s) for b, _, s in items])
    want = [("file", s, n) for _, n, s in items]
    assert _python(path) == want and _gnu(path) == want and _go(path, go_tarlist) == want
    assert not re.search(rb"[^\x00-\x7f]", b"".join(b for b, _, _ in items))
