"""Tar header blocks written by hand, the way an attacker writes them: any field any bytes, the
checksum recomputed (or not). Used by the relay tests (tests/test_relay_*.py)."""

from __future__ import annotations

from runner.agents.relay_agent import member_header

FIELDS = {"name": (0, 100), "mode": (100, 108), "uid": (108, 116), "gid": (116, 124), "size": (124, 136),
          "mtime": (136, 148), "chksum": (148, 156), "type": (156, 157), "linkname": (157, 257),
          "magic": (257, 263), "version": (263, 265), "uname": (265, 297), "gname": (297, 329),
          "devmajor": (329, 337), "devminor": (337, 345), "prefix": (345, 500), "pad": (500, 512)}


def checksum(block: bytes | bytearray, signed: bool = False) -> int:
    b = bytes(block[:148]) + b" " * 8 + bytes(block[156:])
    return sum(x - 256 if signed and x > 127 else x for x in b)


def patched(block: bytes, fix_checksum: bool = True, **fields: bytes) -> bytes:
    """block with the given fields replaced (each value NUL-padded to the field's width, or cut to
    it), and its checksum recomputed in the usual form unless fix_checksum is False."""
    b = bytearray(block)
    for field, value in fields.items():
        a, z = FIELDS[field]
        b[a:z] = value[:z - a].ljust(z - a, b"\0")
    if fix_checksum and "chksum" not in fields:
        b[148:156] = b"%06o\0 " % checksum(b)
    return bytes(b)


def header(name: str, length: int, /, **fields: bytes) -> bytes:
    """The relay's own header for (name, length), with the given fields replaced."""
    return patched(member_header(name, length), **fields)
