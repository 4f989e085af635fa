"""Both CLIs answer like the tools people know: --version, whole option names only, the closest
command, option, inventory field or config key for a typo, help on every option, static shell
completion, and `trainer --print-config` (every key, its default, what it does) that docs/flags.md
carries verbatim. In-process, except one child that checks what the trainer's CLI imports."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest
import tomllib

from runner.cli.main import build_parser
from runner.cli.main import main as runner_main
from tests import REPO
from tests.support.runner_helpers import subcommands
from trainer.cli import main as trainer_main
from trainer.config import Config, config_keys
from trainer.config.doc import descriptions, render
from trainer.config.flags import ENV_KEYS

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def runner_error(capsys, *argv: str) -> str:
    """`runner ARGV` refused by its parser: the one stderr line (exit code 2 checked)."""
    with pytest.raises(SystemExit) as ei:
        runner_main(list(argv))
    assert ei.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_both_clis_print_the_version(capsys):
    with pytest.raises(SystemExit) as ei:
        runner_main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out == f"runner {VERSION}\n"
    assert trainer_main(["--version"]) == 0 and capsys.readouterr().out == f"trainer {VERSION}\n"


def _parsers(parser: argparse.ArgumentParser, path: str = "runner"):
    yield path, parser
    for name, sub in subcommands(parser).items():
        yield from _parsers(sub, f"{path} {name}")


def test_every_runner_option_has_help_and_no_abbreviation():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 15  # every command and `sandbox` actions
    missing, abbrev = [], []
    for path, p in parsers:
        abbrev += [path] if p.allow_abbrev else []
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                helped = {c.dest for c in a._choices_actions}
                missing += [f"{path} {name}" for name in a.choices if name not in helped]
            elif not a.help:
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")
    assert missing == [] and abbrev == []


@pytest.mark.parametrize("argv,line", [
    (["stauts"], "runner: error: argument COMMAND: invalid choice: 'stauts' (did you mean status?)"),
    (["sandbox", "upp"], "runner sandbox: error: argument ACTION: invalid choice: 'upp' (did you mean up?) "
     "(see 'runner sandbox --help')"),
    # An abbreviation is refused (it was --dry-run), with the option it abbreviates.
    (["up", "--dry"], "runner: error: unrecognized arguments: --dry (did you mean --dry-run?)"),
    (["status", "--jsn"], "runner: error: unrecognized arguments: --jsn (did you mean --json?)"),
    (["sandbox", "up", "--node", "3"], "runner: error: unrecognized arguments: --node 3 (did you mean --nodes?)"),
    # Trainer flags before `--`: the command as it should have been typed.
    (["up", "-i", "hosts/pis.yaml", "--train_steps", "5", "--batch_size", "16", "-d"],
     "runner: error: unrecognized arguments: --train_steps --batch_size 16 (trainer arguments go after `--`: "
     "runner up -i hosts/pis.yaml -d -- --train_steps 5 --batch_size 16)"),
    (["profile", "--mbs", "4"], "runner: error: unrecognized arguments: --mbs (trainer arguments go after `--`: "
     "runner profile -- --mbs 4)"),
])
def test_runner_typos_get_the_closest_name(capsys, argv, line):
    want = line if line.endswith("--help')") else f"{line} (see 'runner --help')"
    assert runner_error(capsys, *argv) == want


@pytest.mark.parametrize("argv,line", [
    (["--trian.steps", "5"], "error: unknown config key 'trian.steps' (did you mean train.steps?)"),
    (["--train.step", "5"], "error: unknown config key 'train.step' (did you mean train.steps?)"),
    (["--model.layers", "2"], "error: unknown config key 'model.layers' (did you mean model.num_hidden_layers?)"),
    (["--train_step", "5"], "error: unknown option '--train_step' (did you mean --train_steps?)"),
    (["--json", "1"], "error: unknown option '--json' (see `trainer --help`)"),
    (["plto", "out"], "error: unknown command 'plto' (did you mean plot?)"),
    (["--parallel.zero", "3"], "error: unknown config key 'parallel.zero' (`trainer --print-config` lists every key)"),
])
def test_trainer_typos_get_the_closest_name(capsys, argv, line):
    assert trainer_main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


def test_an_inventory_field_typo_gets_the_closest_field(tmp_path):
    from runner.core.errors import UserError
    from runner.inventory import load_inventory

    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults: {identity_fle: ~/.ssh/id_ed25519}\nnodes:\n  - {name: a, host: 10.0.0.1}\n")
    with pytest.raises(UserError) as ei:
        load_inventory(inv, check_files=False)
    assert str(ei.value) == f"{inv}:1: defaults.identity_fle: unknown field (did you mean identity_file?) (every node)"


def test_print_config_is_every_key_with_its_default_and_a_description(capsys, monkeypatch):
    for var in ENV_KEYS:
        monkeypatch.delenv(var, raising=False)
    assert trainer_main(["--print-config"]) == 0
    out = capsys.readouterr().out
    assert out == render(Config())
    docs = descriptions()
    assert list(docs) == config_keys() and [k for k, d in docs.items() if not d] == []
    data = __import__("yaml").safe_load(out)  # a config one can start from: it loads back to the defaults
    assert data == Config().to_dict()
    flags_md = (REPO / "docs" / "flags.md").read_text()
    block = re.search(r"<!-- print-config -->\n```yaml\n(.*?)```\n<!-- /print-config -->", flags_md, re.S)
    assert block and block[1] == out, "docs/flags.md is behind: python -m trainer.config.doc docs/flags.md"
    # With a config and overrides: the values such a run starts from.
    assert trainer_main(["--print-config", "--config", "configs/tiny.yaml", "--train.steps", "7"]) == 0
    assert "  steps: 7 " in capsys.readouterr().out


def test_completion_scripts_complete_in_bash(tmp_path):
    """The scripts each CLI prints, sourced into a real bash and asked as TAB asks them."""
    import shtab

    from runner.cli.completion import script
    from trainer.cli import COMMANDS
    from trainer.tools.completion import completion_parser

    scripts = {"runner": script(build_parser(), "bash"), "trainer": shtab.complete(completion_parser(COMMANDS), shell="bash")}
    cases = [("runner", ["sta"], "status"), ("runner", ["up", "--dr"], "--dry-run"),
             ("runner", ["sandbox", "u"], "up"), ("trainer", ["--train.st"], "--train.steps"),
             ("trainer", ["--print-c"], "--print-completion --print-config")]
    for prog, words, want in cases:
        path = tmp_path / f"{prog}.bash"
        path.write_text(scripts[prog])
        line = " ".join([prog, *words])
        got = subprocess.run(["bash", "-c", f'source {path}; COMP_WORDS=({line}); COMP_CWORD={len(words)}; '
                              f'COMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}; _shtab_{prog}; echo "${{COMPREPLY[@]}}"'],
                             capture_output=True, text=True, timeout=30)
        assert got.returncode == 0 and sorted(got.stdout.split()) == sorted(want.split()), (line, got)


def test_clis_start_without_torch_or_shtab():
    """--version, --help and --print-config of the trainer import no torch; neither CLI imports
    shtab unless asked for a completion script."""
    code = ("import contextlib, io, sys\n"
            "from trainer.cli import main\n"
            "import runner.cli.main\n"
            "runner.cli.main.build_parser()\n"
            "for argv in (['--version'], ['--help'], ['--print-config']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        assert main(argv) == 0\n"
            "print(sorted(m for m in ('torch', 'shtab') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout == "[]\n", r.stderr
