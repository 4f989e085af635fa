"""What the README and docs promise, checked against the code: the two set-up commands CI runs,
and the seed-flag tables of docs/trainer.md and docs/flags.md (every row maps to what the parser
really does, every flag is listed)."""

from __future__ import annotations

import re

import pytest

from tests import REPO
from trainer.config import get_key, resolve
from trainer.config.argv import parse_train_args
from trainer.config.flags import FLAGS, YAML_ALIASES

README = (REPO / "README.md").read_text()
FLAGS_DOC = (REPO / "docs" / "flags.md").read_text()
TRAINER_DOC = (REPO / "docs" / "trainer.md").read_text()


def test_readme_opens_with_exactly_two_setup_commands():
    blocks = re.findall(r"```sh\n(.*?)```", README, re.S)
    first_two = [b.strip() for b in blocks[:2]]
    assert [b.split()[0] for b in first_two] == ["./scripts/demo.sh", "./scripts/test.sh"]
    assert all(len(b.splitlines()) == 1 for b in first_two)
    # .ci/run takes the test command from between these markers; the demo has its own.
    for marker, want in (("main-command", first_two[0]), ("test-command", first_two[1])):
        m = re.search(rf"<!-- {marker} -->\s*```sh\n(.*?)```\s*<!-- /{marker} -->", README, re.S)
        assert m and m[1].strip() == want, marker


def _readme_pairs() -> list[tuple[str, str]]:
    table = TRAINER_DOC[TRAINER_DOC.index("| users of |"):]
    table = table[: table.index("\n\n")]
    return re.findall(r"`([\w.-]+)` → `([\w.]+)`", table)


def test_readme_flag_table_matches_the_parser():
    pairs = _readme_pairs()
    listed = {name for name, _ in pairs}
    assert listed == set(FLAGS) | set(YAML_ALIASES), "docs/trainer.md table and trainer/config/flags.py differ"
    for name, canonical in pairs:
        alias = FLAGS.get(name) or YAML_ALIASES[name]
        assert alias.canonical == canonical, name


def test_flags_doc_rows_match_the_parser():
    rows = re.findall(r"^\| (?:YAML )?`([\w.-]+)` \| [^|]+ \| `([\w.]+)` \|", FLAGS_DOC, re.M)
    assert {name for name, _ in rows} == set(FLAGS) | set(YAML_ALIASES)
    for name, canonical in rows:
        assert (FLAGS.get(name) or YAML_ALIASES[name]).canonical == canonical, name


@pytest.mark.parametrize("argv", [["--export_timing_csv"], ["--export_timing_csv", "true"]])
def test_perseus_switch_parses_bare_and_with_a_value(argv):
    # Perseus' scripts pass `--export_timing_csv true`; a bare switch works too.
    path, overrides = parse_train_args(["--train.steps", "1", *argv])
    cfg = resolve(path, overrides, environ={})
    assert get_key(cfg, "profile.export_timing_csv") is True
