"""Read a W&B run file (`run-ID.wandb`, what `wandb sync` uploads) back: the records W&B's own
protobuf schema (wandb.proto.wandb_internal_pb2) defines, from the log format W&B writes them in.

wandb >= 0.2x writes the file from its Go core and ships no Python reader, so the framing is read
here: a 7-byte file header (":W&B", magic 0xBEE1, version 0), then LevelDB's log format, 32 KiB
blocks of chunks each with a 7-byte header (CRC-32C, length, type FULL/FIRST/MIDDLE/LAST).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every record of the file, in order, as wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, hex(magic), version)
    out, pending, pos = [], b"", HEADER.size
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0:
            break
        chunk = data[pos + CHUNK.size: pos + CHUNK.size + length]
        pos += CHUNK.size + length
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def history(path: Path) -> list[dict]:
    """The logged rows (`run.log`), each a dict of key -> value with W&B's _step."""
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def run_record(path: Path):
    """The run's own record: id, display name, project, config."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
