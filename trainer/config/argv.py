"""The `train` command line: argv -> (config path, canonical (key, raw value) overrides), with
seed flags (trainer/config/flags.py) mapped to their keys and a close match named for a typo."""

from __future__ import annotations

from typing import Any

from trainer.config.schema import ConfigError


def parse_train_args(argv: list[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    """argv -> (config path, canonical (key, raw value) overrides in command-line order)."""
    from trainer.config.flags import FLAGS, model_name_key

    config_path: str | None = None
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            if config_path is None and arg.endswith((".yaml", ".yml")):
                config_path = arg
                i += 1
                continue
            raise ConfigError(f"unexpected argument '{arg}' (options look like --section.key VALUE)")
        name, eq, inline = arg.partition("=")
        alias = FLAGS.get(name) or FLAGS.get(name.replace("_", "-")) if "." not in name else None
        switch = alias is not None and alias.is_switch
        if eq:
            value: Any = inline
            i += 1
        elif switch and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            value = True
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"option '{name}' needs a value")
            value = argv[i + 1]
            i += 2
        if name == "--config":
            config_path = str(value)
        elif "." in name:
            overrides.append((name[2:], value))
        elif alias is not None:
            if name == "--model_name":
                overrides.append(model_name_key(value))
            else:
                overrides.append((alias.canonical, alias.convert(value)))
        else:
            raise ConfigError(f"unknown option '{name}'{_option_hint(name)}")
    return config_path, overrides


# What `train` takes besides seed flags and --section.key (each handled where it is named).
OWN_OPTIONS = ("--config", "--dry-run", "--json", "--print-config", "--print-completion", "--version", "--help")


def _option_hint(name: str) -> str:
    """' (did you mean --train_steps?)', or where to look."""
    from contract.suggest import close_matches
    from trainer.config import config_keys
    from trainer.config.flags import FLAGS

    if name in OWN_OPTIONS:  # one of ours where it does not belong (--json without --dry-run)
        return " (see `trainer --help`)"
    found = close_matches(name, [*OWN_OPTIONS, *FLAGS, *(f"--{k}" for k in config_keys())])
    if found:
        return f" (did you mean {found[0]}?)"
    return " (`trainer --print-config` lists every key, set as --section.key VALUE; seed flags: docs/flags.md)"
