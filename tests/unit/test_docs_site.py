"""The documentation site: the README stays an introduction, the CLI reference is the parser's,
the performance tables are bench/results/'s, and the built site renders in a real browser (its home
page and the inventory reference: title, headings, a screenshot)."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests import REPO

DOCS = REPO / "docs"


def _hook(name: str):
    """A module of docs/hooks/ (code the site builds with, not a package of the project)."""
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", DOCS / "hooks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- the README ----------------------------------------------------------------------------

def test_readme_is_an_introduction():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), "a date in the README: it belongs in CHANGELOG.md"
    assert not re.findall(r"\b\d[\d,]* (?:passed|failed)\b", text), "a test count in the README"
    assert not re.findall(r"\btests/\S+\.py\b|\btest_\w+", text), "a test file or test name in the README"
    for link in re.findall(r"\]\((docs/[^)#\s]+)", text):  # every page the README points to exists
        assert (REPO / link).exists(), link


# --- the inventory reference ---------------------------------------------------------------

def test_inventory_reference_lists_every_field_the_loader_accepts():
    """Each field an inventory may hold has its row (type, default, meaning) in docs/inventory.md."""
    from runner.inventory import elastic_spec, perseus_spec, slurm
    from runner.inventory.model import BUILD_FIELDS, JOB_FIELDS, NODE_FIELDS, TOP_FIELDS

    page = (DOCS / "inventory.md").read_text()
    rows = set(re.findall(r"^\| `([\w.\[\]]+)`(?:, `([\w.]+)`)? \|", page, re.M))
    listed = {name for row in rows for name in row if name}
    want = (TOP_FIELDS | NODE_FIELDS | JOB_FIELDS | {f"build.{f}" for f in BUILD_FIELDS}
            | {f"sync[].{f}" for f in ("src", "dst")} | {f"perseus.{f}" for f in perseus_spec.FIELDS}
            | {f"elastic.{f}" for f in elastic_spec.FIELDS} | slurm.SLURM_FIELDS)
    assert want - listed == set(), "fields the loader accepts that docs/inventory.md does not list"
    login = re.search(r"^\| `login` \| `\{([^}]*)\}`", page, re.M)
    assert login and {f.strip() for f in login[1].split(",")} == slurm.LOGIN_FIELDS


# --- generated pages -----------------------------------------------------------------------

def test_cli_reference_is_the_parsers():
    ref = _hook("cli_reference")
    page = (DOCS / "cli.md").read_text()
    assert ref.block(page) == ref.render(), "docs/cli.md is behind: python docs/hooks/cli_reference.py docs/cli.md"
    for cmd in ref._subparsers(ref.build_parser())[0]:  # each command has its section, linked from the table
        assert f"### `runner {cmd}`" in page and f"(#runner-{cmd})" in page, cmd


def test_performance_tables_come_from_bench_results():
    bench = _hook("bench_tables")
    page = (DOCS / "performance.md").read_text()
    names = re.findall(r"^<!-- bench:([\w-]+)(?: [\w.-]+)? -->$", page, re.M)
    assert set(names) == set(bench.TABLES), "every table on the page, and no other"
    out = bench.render(page)
    assert "<!-- bench:" not in out
    # figures read from the files, as the benchmarks wrote them
    collect = json.loads((REPO / "bench/results/collect.json").read_text())["rows"]["runner"]
    assert f"{collect['first']['s']:.2f} s / {collect['repeat']['s']:.2f} s" in out
    tt = json.loads((REPO / "bench/results/trainer_throughput.json").read_text())["results"]["trainer"]
    assert f"{tt['tokens_per_s']:,.0f} tok/s" in out
    h200 = json.loads((REPO / "bench/results/gpu_throughput.json").read_text())
    assert h200["device"] in out
    # the figures are not typed into the page itself
    assert f"{collect['first']['s']:.2f}" not in page


def test_a_bench_table_without_its_results_stops_the_build(tmp_path):
    bench = _hook("bench_tables")
    with pytest.raises(FileNotFoundError, match="launch.json: run its benchmark"):
        bench.render("<!-- bench:runner -->\n", bench.Results(tmp_path))
    with pytest.raises(ValueError, match="no such table"):
        bench.render("<!-- bench:nonesuch -->\n")


# --- the built site in a browser -------------------------------------------------------------

class _Page(HTMLParser):
    """A page's <title> and its h1/h2 headings, as text."""

    def __init__(self):
        super().__init__()
        self.title, self.headings, self._in = "", [], None

    def handle_starttag(self, tag, attrs):
        if tag in ("title", "h1", "h2"):
            self._in, self._text = tag, []

    def handle_endtag(self, tag):
        if tag == self._in:
            text = " ".join("".join(self._text).replace("¶", "").split())
            if tag == "title":
                self.title = text
            else:
                self.headings.append((tag, text))
            self._in = None

    def handle_data(self, data):
        if self._in:
            self._text.append(data)


def _source_headings(md: Path) -> list[tuple[str, str]]:
    """The page's own h1/h2 as the markdown writes them (code fences skipped, code spans as text)."""
    out, fenced = [], False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,2}) (.+)", line)):
            out.append((f"h{len(m[1])}", m[2].replace("`", "").strip()))
    return out


@functools.lru_cache(maxsize=1)
def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium_run(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def served_site(tmp_path_factory):
    """The site built from this tree (strictly) and served on loopback."""
    if _chromium() is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs Debian's chromium)")
    site = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    build = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr[-3000:]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path, md, title", [
    ("/", "index.md", "runner-trainer"),
    ("/inventory/", "inventory.md", "Inventory reference - runner-trainer"),
])
def test_page_renders_in_a_headless_browser(served_site, tmp_path, path, md, title):
    url = served_site + path
    dom = _chromium_run(["--dump-dom", url], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = _Page()
    page.feed(dom.stdout)
    assert page.title == title
    want = _source_headings(DOCS / md)
    assert want and [h for h in page.headings if h in want] == want, (page.headings, want)

    shot = tmp_path / "page.png"
    res = _chromium_run([f"--screenshot={shot}", "--window-size=1280,2000", "--hide-scrollbars", url],
                        tmp_path / "profile-shot")
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    assert _png_size(shot) == (1280, 2000)
    # a rendered page, not a blank one: a PNG of one colour at this size is a few kB
    assert shot.stat().st_size > 30_000, shot.stat().st_size
