"""The relay agent's stream check (runner/agents/relay_agent.py, TarCheck): bytes from another node reach
a node's `docker load` only as the archive the agent writes itself from parts that are exactly
the host's. Streams here are the host's own (runner/delivery/relay.py chain_stream, from an export laid
out as `docker save` lays it out), then tampered with the ways an upstream node could; and the
agent's protocol lines, as a broken or hostile host side could send them, to the real agent."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from runner.agents.relay_agent import (
    BLOCK,
    END,
    LINE_MAX,
    Refused,
    TarCheck,
    check_head,
    check_route,
    member_header,
)
from runner.delivery.images import Exported, _load_export
from runner.delivery.relay import chain_plan, chain_stream, expectation, head_line, not_relayable, route_line
from tests.support.tar_blocks import header, patched

AGENT = Path(__file__).resolve().parents[2] / "runner" / "agents" / "relay_agent.py"


@pytest.fixture
def exp(tmp_path) -> Exported:
    """An export as runner.delivery.images makes it from `docker save` (legacy layout: <id>/layer.tar,
    <image id>.json, manifest.json): three layers, one a whole number of blocks."""
    d = tmp_path / "x"
    blobs = [random.Random(i).randbytes(n) for i, n in enumerate((70_000, 4096, 70_513))]
    diff_ids = ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]
    names = [f"{hashlib.sha256(b'id%d' % i).hexdigest()}/layer.tar" for i in range(3)]
    for name, blob in zip(names, blobs, strict=True):
        (d / name).parent.mkdir(parents=True)
        (d / name).write_bytes(blob)
    config = json.dumps({"architecture": "amd64", "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    image = hashlib.sha256(config).hexdigest()
    (d / f"{image}.json").write_bytes(config)
    (d / "manifest.json").write_text(json.dumps([{"Config": f"{image}.json", "RepoTags": ["x:1"], "Layers": names}]))
    return _load_export("app:1", f"sha256:{image}", d)


def stream(exp: Exported, layers: list[int]) -> bytes:
    return b"".join(bytes(c) for c in chain_stream(exp, layers))


def pieces(exp: Exported, layers: list[int]) -> list[tuple[bytes, bytes]]:
    """(header, content) of each part of the host's stream: to be tampered with."""
    out = []
    for name, path in [("manifest.json", exp.tag_manifest), (exp.config, exp.dir / exp.config),
                       *((exp.layers[i], exp.dir / exp.layers[i]) for i in layers)]:
        data = path.read_bytes()
        out.append((member_header(name, len(data)), data))
    return out


def join(parts: list[tuple[bytes, bytes]], end: bytes = END) -> bytes:
    return b"".join(h + d + bytes(-len(d) % BLOCK) for h, d in parts) + end


def check(data: bytes, want: dict, seed: int = 0, sizes=(1, 7, 511, 512, 513, 4096, 65536)) -> tuple[bytes, bytes]:
    """Feed in random chunk sizes (as TCP delivers), then finish; (what went to the node's own
    load, what went on to the next node)."""
    c, rnd, i = TarCheck(want), random.Random(seed), 0
    load, nxt = bytearray(), bytearray()
    while i < len(data):
        n = rnd.choice(sizes)
        mine, theirs = c.feed(data[i:i + n])
        load += mine
        nxt += theirs
        i += n
    end = c.finish()
    return bytes(load + end), bytes(nxt + end)


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


def test_the_hosts_stream_passes_in_any_chunking(exp):
    data = stream(exp, [0, 1, 2])
    for seed in range(5):  # no routing: all of it, both ways, byte for byte
        assert check(data, expectation(exp, [0, 1, 2], [0, 1, 2]), seed) == (data, data)
    sub = stream(exp, [1])  # a subset of the layers too
    assert check(sub, expectation(exp, [1], [1])) == (sub, sub)
    assert set(members(data)) == {"manifest.json", exp.config, *exp.layers}


def test_each_way_gets_the_archive_of_just_its_layers(exp):
    """Of the three layers announced, the node loads the one it lacks and passes on the one the
    next nodes lack; its stream carries just those two, and each way is the archive the host
    would have sent for its layers, byte for byte. A layer it has no use for is refused."""
    data = stream(exp, [0, 2])
    for seed in range(3):
        load, nxt = check(data, {**expectation(exp, [0, 1, 2], [2]), "forward": [0]}, seed)
        assert load == stream(exp, [2]) and nxt == stream(exp, [0])
        check(nxt, expectation(exp, [0], [0]))  # what it passes on, the next agent accepts
    with pytest.raises(Refused, match="where the host sent"):
        check(stream(exp, [0, 1, 2]), {**expectation(exp, [0, 1, 2], [2]), "forward": [0]})
    load, nxt = check(stream(exp, []), {**expectation(exp, [0, 1, 2], []), "forward": []})
    assert load == nxt == stream(exp, [])
    assert members(load) == {"manifest.json": exp.tag_manifest.read_bytes(),
                             exp.config: (exp.dir / exp.config).read_bytes()}


@pytest.mark.parametrize("missing, started", [
    ([[0, 1, 2], [0, 1, 2], [2]], [0, 1, 2]),  # the last node has the base: only the new layer reaches it
    ([[0], [1, 2], [0]], [0, 1, 2]),
    ([[1], [0, 1, 2], [2]], [0, 2]),           # node-1's agent did not start: node-0 passes it over
    ([[], [2], []], [0, 1, 2]),                # a node that lacks nothing (only the tag) is still a link
])
def test_what_relay_chain_sends_is_what_each_agent_accepts(exp, missing, started):
    """The chain as relay_chain plans it (chain_plan, head_line, route_line), each agent's check
    fed what the one before it passed on: every node's request passes the agent's own checks,
    every stream is accepted, and every node's `docker load` gets just its layers. The two halves
    agree on the protocol without a sandbox to show it."""
    token = "f" * 64
    sent, routes = chain_plan(missing, started)
    data = stream(exp, sent)  # from this host to the first node
    for k in started:
        head = head_line(exp, sorted(set().union(*missing)), missing[k], token if k else None)
        nxt, after = routes[k]
        route = route_line(None if nxt is None else ("10.0.1.12", 40000, token), after)
        check_head(head)
        check_route(route, head)
        load, data = check(data, {**head["expect"], "forward": route["layers"]}, seed=k)
        assert load == stream(exp, missing[k]), k
    assert data == stream(exp, [])  # the last node passes on the manifest and config alone (to no one)


def test_exports_the_agents_cannot_check_are_not_relayed(exp):
    """push streams these to each node directly: a layer over what an 11-digit size field holds,
    and layers saved compressed (the containerd image store's `docker save`: blobs/sha256/<digest>
    whose digest is not the uncompressed diff_id the agents check)."""
    assert not_relayable(exp) is None
    big = dataclasses.replace(exp, sizes=[*exp.sizes[:2], 8 ** 11])
    assert "a layer over 8589934591 bytes" in not_relayable(big)
    packed = dataclasses.replace(exp, layers=[f"blobs/sha256/{'e' * 64}", *exp.layers[1:]])
    assert "saved compressed" in not_relayable(packed)
    plain = dataclasses.replace(exp, layers=[f"blobs/sha256/{exp.diff_ids[0][7:]}", *exp.layers[1:]])
    assert not_relayable(plain) is None  # docker 25+ without the containerd store: uncompressed, digest = diff_id


def test_another_writers_canonical_headers_are_read_and_rewritten(exp):
    """Headers of Python's tarfile (ustar: other mode, mtime, owner names, checksum spelling) are
    read, and what leaves is the relay's own archive: no byte of a peer's header goes on."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for h, d in pieces(exp, [0, 1, 2]):
            info = tarfile.TarInfo(h[:100].rstrip(b"\0").decode())
            info.size, info.mode, info.mtime, info.uname, info.gname = len(d), 0o600, 1_700_000_000, "root", "wheel"
            tf.addfile(info, io.BytesIO(d))
    theirs = buf.getvalue()[:len(stream(exp, [0, 1, 2]))]  # tarfile pads to 10 KiB records: cut to the end blocks
    assert theirs != stream(exp, [0, 1, 2])
    assert check(theirs, expectation(exp, [0, 1, 2], [0, 1, 2])) == (stream(exp, [0, 1, 2]),) * 2


def _tamper(case: str, exp: Exported) -> bytes:
    p = pieces(exp, [0, 1, 2])
    (mh, md), (ch, cd), (h0, d0), (h1, d1), (h2, d2) = p
    flip = lambda d, i=-1: d[:i] + bytes([d[i] ^ 1]) + d[i:][1:]  # noqa: E731
    evil = (member_header("evil", 3), b"abc")
    if case == "extra entry at the end":
        return join([*p, evil])
    if case == "entry in place of a layer":
        return join([p[0], p[1], evil, *p[2:]])
    if case == "other manifest":
        return join([(mh, md.replace(b'"app:1"', b'"app:2"')), *p[1:]])
    if case == "other config":
        return join([p[0], (ch, flip(cd, 5)), *p[2:]])
    if case == "other layer content":
        return join([*p[:3], (h1, flip(d1)), p[4]])
    if case == "layers swapped":
        return join([*p[:2], p[3], p[2], p[4]])
    if case == "entry twice":
        return join([*p[:3], p[2], *p[3:]])
    if case == "larger size":
        return join([*p[:3], (header(exp.layers[1], len(d1) + 512), d1 + bytes(512)), p[4]])
    if case == "symlink":
        return join([*p[:3], (patched(h1, type=b"2", linkname=b"/etc/passwd"), d1), p[4]])
    if case == "pax header":
        return join([*p[:3], (patched(header("PaxHeaders/x", 20), type=b"x"), b"20 path=manifest.json\n"), *p[3:]])
    if case == "GNU long name":
        return join([*p[:3], (patched(header("././@LongLink", 14), type=b"L"), b"manifest.json\0"), *p[3:]])
    if case == "GNU magic":
        return join([*p[:3], (patched(h1, magic=b"ustar ", version=b" \0"), d1), p[4]])
    if case == "NUL-led size":
        return join([*p[:3], (patched(h1, size=b"\0" + b"%010o" % len(d1)), d1), p[4]])
    if case == "space-led size":
        return join([*p[:3], (patched(h1, size=b" %010o" % len(d1)), d1), p[4]])
    if case == "base-256 size":
        return join([*p[:3], (patched(h1, size=b"\x80" + len(d1).to_bytes(11, "big")), d1), p[4]])
    if case == "prefix":
        return join([*p[:3], (patched(h1, prefix=b"x"), d1), p[4]])
    if case == "bad checksum":
        return join([*p[:3], (patched(h1, fix_checksum=False, mtime=b"00000000001\0"), d1), p[4]])
    if case == "non-zero padding":
        return join(p[:2], end=b"") + h0 + d0 + b"\1" + bytes(-len(d0) % BLOCK - 1) + join(p[3:])
    if case == "data after the end":
        return join(p) + b"\1" + bytes(511)
    if case == "cut short":
        return join(p)[:80_000]
    if case == "no end blocks":
        return join(p, end=b"")
    if case == "no config":
        return join([p[0], *p[2:]])
    raise AssertionError(case)


@pytest.mark.parametrize("case, message", [
    ("extra entry at the end", "data after the last part"),
    ("entry in place of a layer", "entry 'evil' .* where the host sent"),
    ("other manifest", "manifest.json is not the host's"),
    ("other config", r"\.json is not the host's"),
    ("other layer content", r"layer\.tar is not the host's"),
    ("layers swapped", "where the host sent"),
    ("entry twice", "where the host sent"),
    ("larger size", "where the host sent"),
    ("symlink", "is not a regular file"),
    ("pax header", r"is not a regular file \(type b'x'\)"),
    ("GNU long name", "is not a regular file"),
    ("GNU magic", "not a POSIX ustar header"),
    ("NUL-led size", "size field .* is not octal"),
    ("space-led size", "size field .* is not octal"),
    ("base-256 size", "non-ASCII"),
    ("prefix", "prefix"),
    ("bad checksum", "bad header checksum"),
    ("non-zero padding", "non-zero padding"),
    ("data after the end", "data after the end of the archive"),
    ("cut short", "archive ended early"),
    ("no end blocks", "archive ended early"),
    ("no config", "where the host sent"),
])
def test_tampered_streams_are_refused(exp, case, message):
    with pytest.raises(Refused, match=message):
        check(_tamper(case, exp), expectation(exp, [0, 1, 2], [0, 1, 2]))


def test_no_whole_part_that_is_not_the_hosts_leaves(exp):
    """The last byte of a layer differs from the host's: everything before it may have left (it
    streams), the part itself never whole, on either way, whatever the chunking."""
    good = stream(exp, [0, 1, 2])
    bad = _tamper("other layer content", exp)
    last = good.index((exp.dir / exp.layers[1]).read_bytes()) + exp.sizes[1] - 1  # offset of its last byte
    assert good[last] != bad[last] and good[:last] == bad[:last]
    for sizes in ((1,), (512,), (65536,), (1 << 20,)):
        c, out, i = TarCheck(expectation(exp, [0, 1, 2], [0, 1, 2])), [bytearray(), bytearray()], 0
        with pytest.raises(Refused, match="is not the host's"):
            while i < len(bad):
                for o, b in zip(out, c.feed(bad[i:i + sizes[0]]), strict=True):
                    o += b
                i += sizes[0]
        for o in out:
            assert len(o) <= last and good.startswith(o), (sizes, len(o), last)


def test_the_agent_needs_nothing_but_the_standard_library():
    """It runs on the nodes as `python3 -c`, where nothing but python3 is installed."""
    tree = ast.parse(AGENT.read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods and mods <= set(sys.stdlib_module_names) - {"__future__"}, mods
    ast.parse(AGENT.read_text(), feature_version=(3, 8))  # Debian 11 / Raspberry Pi OS 11 have 3.9


def agent(*lines: bytes) -> subprocess.CompletedProcess:
    """The real agent, fed these lines on stdin (then EOF)."""
    return subprocess.run([sys.executable, "-u", str(AGENT)], input=b"".join(lines), capture_output=True, timeout=60)


def _good_head(exp: Exported, mode: str = "root") -> dict:
    return {"mode": mode, "expect": expectation(exp, [0], [0]), **({"token": "a" * 64} if mode == "listen" else {})}


@pytest.mark.parametrize("case", ["port 99999999", "port -1", "port 0", "port as text", "port true", "port 1.5",
                                  "host with a space", "host empty", "short token", "no forward",
                                  "forward layer not carried", "route not an object"])
def test_a_bad_route_line_is_one_error_line(exp, case):
    """The host's second line (where to pass the stream on) with a bad value: the agent says so in
    one ERROR line and exits 2; no traceback, nothing connected or loaded."""
    fwd = {"host": "127.0.0.1", "port": 4000, "token": "b" * 64}
    fwd.update({"port 99999999": {"port": 99999999}, "port -1": {"port": -1}, "port 0": {"port": 0},
                "port as text": {"port": "4000"}, "port true": {"port": True}, "port 1.5": {"port": 1.5},
                "host with a space": {"host": "a b"}, "host empty": {"host": ""},
                "short token": {"token": "b"}}.get(case, {}))
    route = {"forward": fwd, "layers": [0]}
    if case == "no forward":
        del route["forward"]
    elif case == "forward layer not carried":
        route["layers"] = [1]
    elif case == "route not an object":
        route = [fwd]
    res = agent(json.dumps(_good_head(exp, "listen")).encode() + b"\n", json.dumps(route).encode() + b"\n")
    out = res.stdout.decode().splitlines()
    assert (res.returncode, res.stderr, len(out)) == (2, b"", 2), res
    assert out[0].startswith("PORT ") and out[1].startswith("ERROR bad request: "), out


@pytest.mark.parametrize("case", ["not JSON", "a list", "mode", "no expect", "manifest digest", "size too large",
                                  "negative size", "layer index twice", "load not carried", "line too long"])
def test_a_bad_first_line_is_one_error_line(exp, case):
    head = _good_head(exp)
    e = head["expect"]
    raw = None
    if case == "not JSON":
        raw = b"{mode: root}\n"
    elif case == "a list":
        raw = b"[1]\n"
    elif case == "line too long":
        raw = json.dumps({**head, "pad": "x" * LINE_MAX}).encode() + b"\n"
    elif case == "mode":
        head["mode"] = "serve"
    elif case == "no expect":
        del head["expect"]
    elif case == "manifest digest":
        e["manifest"]["sha256"] = "../" * 20
    elif case == "size too large":
        e["layers"] = [[0, 8 ** 11]]
    elif case == "negative size":
        e["config"]["size"] = -1
    elif case == "layer index twice":
        e["layers"] = [[0, 5], [0, 5]]
    elif case == "load not carried":
        e["load"] = [2]
    res = agent(raw or json.dumps(head).encode() + b"\n", b'{"forward": null, "layers": []}\n')
    assert (res.returncode, res.stderr) == (2, b""), res
    assert res.stdout.decode().splitlines() == [res.stdout.decode().strip()] and \
        res.stdout.startswith(b"ERROR bad request: "), res.stdout


@pytest.mark.docker
def test_the_root_agent_refuses_and_loads_nothing_when_the_host_stream_is_wrong(exp):
    """Root mode reads the host's stream from stdin: the same check (a layer of other content is
    refused before the archive ends, so `docker load` is killed mid-part)."""
    res = agent(json.dumps(_good_head(exp)).encode() + b"\n", b'{"forward": null, "layers": []}\n',
                join(pieces(exp, [1])))  # layer 1 where the host announced layer 0
    assert res.returncode == 1 and res.stderr == b"", res
    assert res.stdout.decode().splitlines()[-1].startswith("ERROR refused: entry "), res.stdout
