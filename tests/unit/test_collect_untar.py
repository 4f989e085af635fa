"""Collect's local unpacker (runner/delivery/untar.py): a node's tar stream gives names and bytes,
only for the names collect asked for, only as regular files, on any laptop (GNU tar's extraction
flags were required before; macOS's bsdtar refuses `--no-overwrite-dir`)."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.delivery.collect_files import UNTAR, stream_tar
from runner.transport.ssh import Remote
from tests.support.hostile_node import HostileNode


def _member(tf: tarfile.TarFile, name: str, data: bytes = b"", kind=tarfile.REGTYPE, link: str = "",
            mode: int = 0o644) -> None:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode, ti.uid, ti.mtime = kind, link, mode, 0, 2_000_000_000
    ti.size = len(data) if kind == tarfile.REGTYPE else 0
    tf.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _tar(build, fmt=tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        build(tf)
    return buf.getvalue()


def _untar(tmp_path: Path, stream: bytes, names: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    staging, listed = tmp_path / "staging", tmp_path / "names"
    listed.write_bytes(b"\0".join(n.encode("utf-8", "surrogateescape") for n in names))
    p = subprocess.run([*UNTAR, str(staging), str(listed)], input=stream, capture_output=True, timeout=60)
    return p, staging


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under root: a file's bytes, or 'dir' / 'link' / 'other'."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "link" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes() if p.is_file() else "other"
    return out


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_only_the_asked_for_regular_files_are_written(tmp_path, fmt):
    """A hostile stream: a link, a hard link, a directory and a device under names asked for; an
    absolute and a climbing name; a second copy of a name; files not asked for. Only the asked-for
    regular files come out, each once (the first), mode 0600, no time from the node."""
    long = "d/" + "x" * 200 + "/" + "y" * 150  # past ustar's 100 bytes: a GNU long name or a pax record
    odd = "caf\udce9.bin"  # a Latin-1 name that is not UTF-8, as a node's file system may hold it

    def build(tf):
        _member(tf, "a.txt", b"hello", mode=0o6755)
        _member(tf, "junk.bin", b"j" * 5000)
        _member(tf, "lnk", kind=tarfile.SYMTYPE, link="/etc/passwd")
        _member(tf, "hard", kind=tarfile.LNKTYPE, link="/etc/passwd")
        _member(tf, "sub", kind=tarfile.DIRTYPE)
        _member(tf, "dev", kind=tarfile.CHRTYPE)
        _member(tf, "/tmp/abs", b"abs")
        _member(tf, "../up", b"up")
        _member(tf, "a.txt", b"second copy")
        _member(tf, long, b"long")
        _member(tf, "sub/b.txt", b"bee")
        _member(tf, odd, b"odd")

    asked = ["a.txt", "lnk", "hard", "sub", "dev", "/tmp/abs", "../up", long, "sub/b.txt", odd, "gone.bin"]
    p, staging = _untar(tmp_path, _tar(build, fmt), asked)
    assert p.returncode == 0, p.stderr
    files = {k: v for k, v in _tree(staging).items() if v != "dir"}
    assert files == {"a.txt": b"hello", long: b"long", "sub/b.txt": b"bee", odd: b"odd"}, files
    dirs = sorted(k for k, v in _tree(staging).items() if v == "dir")
    assert dirs == ["d", "d/" + "x" * 200, "sub"], dirs  # only the parents of files written
    for rel in ("a.txt", "sub/b.txt"):
        st = os.lstat(staging / rel)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_mtime < 2_000_000_000, (rel, oct(st.st_mode))
    assert not (tmp_path / "up").exists() and not Path("/tmp/abs").exists()


def _gnu_sparse_header(name: bytes, real_size: int) -> bytes:
    """A GNU sparse member (type S) with no data blocks: one map entry at the end, the rest a hole
    of real_size (base-256 in the header, so it can be anything)."""
    h = bytearray(512)
    h[0:len(name)] = name
    h[100:108], h[108:116], h[116:124] = b"0000600\0", b"0000000\0", b"0000000\0"
    h[124:136] = h[136:148] = b"00000000000\0"  # size stored in the stream: 0
    h[156:157], h[257:265] = b"S", b"ustar  \0"
    h[483:495] = b"\x80" + real_size.to_bytes(11, "big")
    h[148:156] = b"        "
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _pax_sparse(name: str, real_size: int) -> bytes:
    def build(tf):
        ti = tarfile.TarInfo(name)
        ti.pax_headers = {"GNU.sparse.map": f"{real_size},0", "GNU.sparse.size": str(real_size)}
        tf.addfile(ti, io.BytesIO(b""))
        _member(tf, "b.txt", b"bee")
    return _tar(build, tarfile.PAX_FORMAT)


@pytest.mark.parametrize("form", ["gnu", "pax"])
def test_a_sparse_member_writes_nothing(tmp_path, form):
    """Found by an audit: tarfile takes a sparse member as a regular file and gives its holes as
    zeros up to the size its header claims, so a 1.5 KB stream wrote 200 MB here (and any size it
    liked, within collect's stream bounds: they count stream bytes). Refused: the name is absent."""
    big = 200 << 20
    stream = (_gnu_sparse_header(b"a.txt", big) + _tar(lambda tf: _member(tf, "b.txt", b"bee")) if form == "gnu"
              else _pax_sparse("a.txt", big))
    assert len(stream) < 20_000
    p, staging = _untar(tmp_path, stream, ["a.txt", "b.txt"])
    assert p.returncode == 0, p.stderr
    assert _tree(staging) == {"b.txt": b"bee"}


@pytest.mark.parametrize("damage", ["cut", "not-a-tar", "empty"])
def test_a_stream_that_is_not_a_whole_tar_is_one_line_and_exit_1(tmp_path, damage):
    whole = _tar(lambda tf: (_member(tf, "a.txt", b"a" * 4000), _member(tf, "b.txt", b"b" * 4000)))
    stream = {"cut": whole[:512 + 2000], "not-a-tar": b"<html>502 Bad Gateway</html>\n" * 40, "empty": b""}[damage]
    p, staging = _untar(tmp_path, stream, ["a.txt", "b.txt"])
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = p.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("the stream is not a whole tar: "), lines
    if damage == "cut":  # what was written stays short: verification refuses it by size
        assert (staging / "a.txt").stat().st_size < 4000


def test_a_damaged_header_ends_the_stream_there(tmp_path):
    """tarfile reads a header that fails its checksum after the first as the archive's end: what
    came before is written, what comes after is absent, and collect's verification names each file
    missing (GNU tar skipped to the next header instead)."""
    whole = _tar(lambda tf: (_member(tf, "a.txt", b"a" * 4000), _member(tf, "b.txt", b"b" * 4000)))
    p, staging = _untar(tmp_path, whole[:4608] + b"\x01" * 512 + whole[5120:], ["a.txt", "b.txt"])
    assert p.returncode == 0, p.stderr
    assert _tree(staging) == {"a.txt": b"a" * 4000}


def test_the_padding_after_the_end_blocks_is_read_through(tmp_path):
    """A sender blocked writing its record padding into a reader that left would fail (EPIPE) on a
    healthy stream."""
    stream = _tar(lambda tf: _member(tf, "a.txt", b"a")) + b"\0" * (4 << 20)
    r, w = os.pipe()
    staging, listed = tmp_path / "staging", tmp_path / "names"
    listed.write_bytes(b"a.txt")
    p = subprocess.Popen([*UNTAR, str(staging), str(listed)], stdin=r, stderr=subprocess.PIPE)
    os.close(r)
    with os.fdopen(w, "wb") as fh:
        fh.write(stream)  # blocks, then raises BrokenPipeError, if the unpacker stopped reading
    assert p.wait(timeout=60) == 0 and (staging / "a.txt").read_bytes() == b"a"


def test_collect_needs_no_gnu_tar_on_this_machine(tmp_path, monkeypatch):
    """This machine's `tar` is not GNU tar (macOS's bsdtar refused the flags collect gave it): here
    a `tar` that fails whatever it is given comes first on PATH. Collect still brings the files;
    the node keeps its own tar."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "tar").write_text("#!/bin/sh\necho 'tar: this is not GNU tar' >&2\nexit 64\n")
    (fake / "tar").chmod(0o755)
    rd = tmp_path / "node" / "home" / "rd"
    (rd / "sub").mkdir(parents=True)
    (rd / "a.txt").write_bytes(b"hello")
    (rd / "sub" / "b.bin").write_bytes(os.urandom(300_000))
    node = HostileNode(tmp_path / "node", fourth=41)
    node_path = os.environ["PATH"]
    node.rewrite = lambda c: f"PATH={node_path}; {c}"
    monkeypatch.setenv("PATH", f"{fake}:{node_path}")
    staging = tmp_path / "staging"
    with node, Remote(node.node()).connect() as r:
        stream_tar(r, str(rd), ["a.txt", "sub/b.bin"], staging)
        assert subprocess.run(["tar", "--version"], capture_output=True).returncode == 64  # the fake is what runs here
    assert (staging / "a.txt").read_bytes() == b"hello"
    assert (staging / "sub" / "b.bin").read_bytes() == (rd / "sub" / "b.bin").read_bytes()


def test_collect_names_the_node_when_its_stream_is_not_a_tar(tmp_path):
    node = HostileNode(tmp_path / "node", fourth=42)
    rd = tmp_path / "node" / "home" / "rd"
    rd.mkdir(parents=True)
    (rd / "a.txt").write_text("hello")
    node.rewrite = lambda c: "cat /dev/null >/dev/null; printf 'HTTP/1.1 502 Bad Gateway\\r\\n%.0s' $(seq 100)" \
        if "tar --null" in c else c
    with node, Remote(node.node()).connect() as r:
        with pytest.raises(UserError) as err:
            stream_tar(r, str(rd), ["a.txt"], tmp_path / "staging")
    # Named for what the stream is, at once: not given up later as a stall ("... stalled (under
    # 64 KiB in 120s ...)"), which is the other way this stream could end.
    assert str(err.value).startswith(f"node evil: unpacking the files from {rd} failed: the stream is not a whole tar"), \
        str(err.value)


def test_the_unpacker_imports_only_the_standard_library():
    """It runs with -I (no PYTHON* variables, no user site): nothing of the project or a venv."""
    p = subprocess.run([sys.executable, "-I", "-c", "import sys, runpy; runpy.run_path(sys.argv[1]); "
                        "print(sorted(m for m in sys.modules if m.startswith(('runner', 'paramiko', 'yaml'))))",
                        UNTAR[-1]], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)
