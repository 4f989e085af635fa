"""`trainer` console script: `trainer [train] --config X.yaml [overrides]` and registered subcommands.

Subcommands are looked up lazily in COMMANDS ("name" -> "module:function"), so a command's
imports (torch, matplotlib) cost nothing for the others. A command function takes argv (the
arguments after its name) and returns an exit code. Register a new one by adding a line to
COMMANDS or calling register() before main().

Overrides for `train`:
  --section.key VALUE | --section.key=VALUE   any canonical key (see trainer/config/)
  --config PATH | a positional PATH.yaml       the YAML file (FSDP stub: `trainer cfg.yaml`)
  seed flags (`--train_steps 5`, `--max-steps`, `--mbs`, ...)  see docs/flags.md
"""

from __future__ import annotations

import importlib
import os
import sys

from trainer.config import ConfigError
from trainer.config.argv import parse_train_args

USAGE = """usage: trainer [train] [--config X.yaml | X.yaml] [--section.key VALUE ...] [seed flags]
       trainer --dry-run [--json] [--config X.yaml] [...]   the layout and per-stage memory, nothing run
       trainer --print-config [--config X.yaml] [...]       every key: its value and what it does
       trainer --version | --print-completion bash|zsh|tcsh
       trainer COMMAND ...

Train (the default command) with a YAML config plus overrides. Precedence: CLI flag > env var >
YAML > default. Any key: --section.key VALUE (sections model, data, train, optim, schedule,
parallel, checkpoint, profile, logging, watch, elastic; plus --output-dir). Seed flags such as --train_steps,
--batch_size, --max-steps, --mbs, --dp/--tp/--pp are accepted as-is: see docs/flags.md.
Works as one process, under torchrun, srun (Slurm) or mpirun (Open MPI; MASTER_ADDR required).

examples:
  trainer --config configs/tiny.yaml
  torchrun --nproc-per-node 2 -m trainer --config configs/tiny.yaml --parallel.sharding zero3
  trainer configs/stub-zero3.yaml          (FSDP stub form: positional YAML with its dist.* keys)"""

COMMANDS: dict[str, str] = {
    "train": "trainer.cli:train_main",
    "print-config": "trainer.config.doc:print_config_main",  # also `trainer --print-config`
    "export": "trainer.checkpoint.export:export",
    "plot": "trainer.tools.plots:main",
    "probe": "trainer.tools.probe:main",  # per-node measurements for parallel.partition auto (runner profile)
    "perseus-plans": "trainer.profiling.perseus_plans:main",  # plan files from instructions-{rank}.csv
}


def register(name: str, target: str) -> None:
    COMMANDS[name] = target


def train_main(argv: list[str]) -> int:
    """Resolve and check everything that needs no torch first, so a bad config or launcher env
    fails in a fraction of a second; then import the loop."""
    from trainer.config import resolve
    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import from_environ

    if "--dry-run" in argv:  # trainer/tools/dry_run.py: meta device only, no launcher, no process group
        from trainer.tools.dry_run import main as dry_run

        return dry_run(argv)
    config_path, overrides = parse_train_args(argv)
    cfg = resolve(config_path, overrides)
    env = from_environ()
    if not (cfg.elastic.in_place and os.environ.get("ELASTIC_JOIN_EPOCH", "").isdigit()):
        # (a node coming back, joining a running job: its layout comes with regroup.json; train.run checks it)
        ParallelDims.from_config(cfg.parallel, env.world_size, env.local_world_size)
    from trainer.parallel.compose import check_supported
    from trainer.train import run

    check_supported(cfg)
    return run(cfg, env)


def _error(message: str) -> None:
    """One line on stderr in one write: every rank of a job shares the pipe, and print() writes the
    text and its newline in two calls, so another rank's line could land between them."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def _load(target: str):
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "train"
    if argv and not argv[0].startswith("-") and argv[0] in COMMANDS:
        command = argv.pop(0)
    elif argv and not argv[0].startswith("-") and not argv[0].endswith((".yaml", ".yml")):
        from contract.suggest import did_you_mean

        if hint := did_you_mean(argv[0], COMMANDS):
            _error(f"unknown command '{argv[0]}'{hint}")
            return 2
    if command == "train" and any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        print("\ncommands: " + ", ".join(sorted(COMMANDS)))
        return 0
    if command == "train" and "--version" in argv:
        from contract.version import version

        print(f"trainer {version()}")
        return 0
    if command == "train" and "--print-completion" in argv:
        from trainer.tools.completion import print_completion

        return print_completion(argv, COMMANDS)
    if command == "train" and "--print-config" in argv:
        command = "print-config"
    try:
        fn = _load(COMMANDS[command])
    except (ImportError, AttributeError):
        _error(f"command '{command}' is not available in this build")
        return 2
    try:
        return int(fn(argv) or 0)
    except ConfigError as e:
        _error(str(e))
        return 2
    except OSError as e:
        from trainer.runtime.full_disk import full_disk_line

        if line := full_disk_line(e):
            _error(line)
            return 2
        if e.filename is not None and e.strerror:  # a path this machine refuses: the user's to fix
            from trainer.config.schema import one_line

            _error(one_line(f"{e.filename}: {e.strerror} (errno {e.errno}); fix the path or its permissions, "
                            "then run again"))
            return 2
        raise
