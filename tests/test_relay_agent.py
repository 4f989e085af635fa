"""The relay agent's archive check (runner/relay_agent.py, TarCheck): bytes from another node reach a
node's `docker load` only while they are exactly the archive the host described. Archives here are
written by GNU tar as the runner's own export streams are (images.Exported.archive_cmd), then
tampered with the ways a stranger on the nodes' network could."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from runner.relay_agent import Refused, TarCheck

AGENT = Path(__file__).resolve().parents[1] / "runner" / "relay_agent.py"
CONFIG = "blobs/sha256/" + "c" * 64
LAYERS = ["blobs/sha256/" + "1" * 64, "blobs/sha256/" + "2" * 64]


@pytest.fixture
def export(tmp_path):
    """A docker-save-like directory: manifest.json naming one tag, a config, two layers."""
    d = tmp_path / "x"
    (d / "blobs" / "sha256").mkdir(parents=True)
    (d / CONFIG).write_bytes(b'{"rootfs": {"diff_ids": []}}' * 40)
    for i, name in enumerate(LAYERS):
        (d / name).write_bytes(random.Random(i).randbytes(70_000 + 513 * i))
    (d / "manifest.json").write_text(json.dumps([{"Config": CONFIG, "RepoTags": ["app:1"], "Layers": LAYERS}]))
    return d


def tar(d: Path, *names: str, fmt: str = "gnu") -> bytes:
    # --hard-dereference: a name given twice is stored twice, not as a hard link to the first
    return subprocess.run(["tar", f"--format={fmt}", "--hard-dereference", "-cf", "-", "-C", str(d), *names],
                          capture_output=True, check=True).stdout


def expect(d: Path) -> dict:
    return {"manifest": hashlib.sha256((d / "manifest.json").read_bytes()).hexdigest(), "config": CONFIG,
            "config_sha256": hashlib.sha256((d / CONFIG).read_bytes()).hexdigest(), "layers": LAYERS}


def check(data: bytes, want: dict, seed: int = 0) -> tuple[bytes, bytes]:
    """Feed in random chunk sizes (as TCP delivers), then finish; (what went to the node's own
    load, what went on to the next node)."""
    c, rnd, i = TarCheck(want), random.Random(seed), 0
    load, nxt = bytearray(), bytearray()
    while i < len(data):
        n = rnd.choice([1, 7, 511, 512, 513, 4096, 65536])
        mine, theirs = c.feed(data[i:i + n])
        load += mine
        nxt += theirs
        i += n
    c.finish()
    return bytes(load), bytes(nxt)


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


def test_the_hosts_archive_passes_in_any_chunking(export):
    data = tar(export, "manifest.json", CONFIG, *LAYERS)
    for seed in range(5):
        assert check(data, expect(export), seed) == (data, data)  # no routing: all of it, both ways
    check(tar(export, "manifest.json", CONFIG, LAYERS[1]), expect(export))  # a subset of the layers too


def test_each_way_gets_a_valid_archive_of_just_its_layers(export):
    """The node loads only the layer it lacks and passes on only the one the next nodes lack; both
    streams are whole archives (manifest, config, end blocks) byte for byte the host's entries."""
    data = tar(export, "manifest.json", CONFIG, *LAYERS)
    whole = members(data)
    for seed in range(3):
        load, nxt = check(data, {**expect(export), "load": [LAYERS[1]], "forward": [LAYERS[0]]}, seed)
        assert members(load) == {k: whole[k] for k in ("manifest.json", CONFIG, LAYERS[1])}
        assert members(nxt) == {k: whole[k] for k in ("manifest.json", CONFIG, LAYERS[0])}
        check(load, expect(export))  # and each is an archive the next agent accepts
        check(nxt, expect(export))
    load, nxt = check(data, {**expect(export), "load": [], "forward": []})
    assert set(members(load)) == set(members(nxt)) == {"manifest.json", CONFIG}


@pytest.mark.parametrize("case, message", [
    ("extra entry", "unexpected entry 'evil'"),
    ("other manifest", "manifest.json is not the host's"),
    ("other config", f"{CONFIG} is not the host's"),
    ("entry twice", f"unexpected entry '{LAYERS[0]}'"),
    ("symlink", "is not a regular file"),
    ("pax headers", "is not a regular file"),
    ("bad checksum", "bad header checksum"),
    ("data after the end", "data after the end of the archive"),
    ("cut short", "archive ended early"),
    ("no config", "archive ended early"),
])
def test_tampered_archives_are_refused(export, case, message):
    want = expect(export)
    names = ["manifest.json", CONFIG, *LAYERS]
    if case == "extra entry":
        (export / "evil").write_text("x")
        data = tar(export, *names, "evil")
    elif case == "other manifest":
        (export / "manifest.json").write_text(json.dumps([{"Config": CONFIG, "RepoTags": ["ubuntu:latest"],
                                                           "Layers": LAYERS}]))
        data = tar(export, *names)
    elif case == "other config":
        (export / CONFIG).write_bytes(b"{}")
        data = tar(export, *names)
    elif case == "entry twice":
        data = tar(export, *names, LAYERS[0])
    elif case == "symlink":
        (export / LAYERS[1]).unlink()
        (export / LAYERS[1]).symlink_to("/etc/passwd")
        data = tar(export, *names)
    elif case == "pax headers":
        data = tar(export, *names, fmt="pax")
    elif case == "bad checksum":
        data = bytearray(tar(export, *names))
        data[136] ^= 0x01  # the first header's mtime changes, its checksum field does not
        data = bytes(data)
    elif case == "data after the end":
        data = tar(export, *names) + b"\x01" + bytes(511)
    elif case == "cut short":
        data = tar(export, *names)[:80_000]
    else:
        data = tar(export, "manifest.json", *LAYERS)
    with pytest.raises(Refused, match=message):
        check(data, want)


def test_the_agent_needs_nothing_but_the_standard_library():
    """It runs on the nodes as `python3 -c`, where nothing but python3 is installed."""
    tree = ast.parse(AGENT.read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods and mods <= set(sys.stdlib_module_names) - {"__future__"}, mods
    ast.parse(AGENT.read_text(), feature_version=(3, 8))  # Debian 11 / Raspberry Pi OS 11 have 3.9
