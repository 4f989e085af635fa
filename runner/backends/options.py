"""What `up` takes besides the inventory, declared per backend as a dataclass (as torchx's run
options): UpOptions holds what every backend reads; a backend's own subclass (SshUpOptions,
SlurmUpOptions) adds its fields, each declared with `option()`: its CLI flag, help and the line
that refuses it where a run goes to another backend.

The CLI adds every backend's own fields to `runner up` (runner/cli/up.py), and both the CLI and
runner.api go through `options_for`: a field of another backend, given to a run, is one UserError
naming it and the backend it belongs to, whichever way it came in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from runner.core.errors import Unsupported


def option(default: Any, flag: str, help: str, *, refusal: str | None = None, **argparse: Any) -> Any:
    """A backend's own option: a dataclass field with its CLI spelling (`flag`, `help`, the other
    add_argument keywords) and, where the general line says too little, the words that follow the
    flag when it is refused on another backend (`is for SSH runs; on Slurm use --requeue`)."""
    meta = {"flag": flag, "help": help, "refusal": refusal, "argparse": argparse}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class UpOptions:
    """Options of `up` every backend takes.

    Attributes:
        resume: continue a run from its latest checkpoint: a run id (or prefix), or "latest".
        ignore_sizing: start even where the memory estimate says a node cannot hold its stage.
        trainer_args: extra trainer arguments, appended to job.args.
        notify: a command (`sh -c` here) or an http(s) URL told when an attached run ends
            (default: $RUNNER_NOTIFY, then job.notify).
    """

    resume: str | None = None
    ignore_sizing: bool = False
    trainer_args: list[str] = field(default_factory=list)
    notify: str | None = None


def own_fields(cls: type[UpOptions]) -> list[Field]:
    """The fields a backend's options class adds to UpOptions, in declaration order."""
    common = {f.name for f in fields(UpOptions)}
    return [f for f in fields(cls) if f.name not in common]


def flag_of(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _default(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def given(options: UpOptions) -> dict[str, Any]:
    """The fields of options that differ from their defaults (what the caller set)."""
    return {f.name: getattr(options, f.name) for f in fields(options) if getattr(options, f.name) != _default(f)}


def options_for(backend: Any, options: UpOptions | Mapping[str, Any] | None, backends: list[Any],
                inventory: str) -> UpOptions:
    """options as `backend.Options`: None gives the defaults; another backend's options class or a
    mapping is taken field by field, and a field that is not the backend's own (another
    backend's, or nobody's) is refused in one line naming it and whose it is."""
    cls = backend.Options
    if options is None:
        return cls()
    if isinstance(options, cls) and type(options) is cls:
        return options
    if isinstance(options, UpOptions):
        values = given(options)
    elif isinstance(options, Mapping):
        values = dict(options)
    else:
        raise TypeError(f"options: expected {cls.__name__} or a mapping, got {type(options).__name__}")
    mine = {f.name for f in fields(cls)}
    foreign = [k for k in values if k not in mine]
    if foreign:
        raise Unsupported(refusal(foreign, backend, backends, inventory))
    return cls(**values)


def refusal(names: list[str], backend: Any, backends: list[Any], inventory: str) -> str:
    """One line for options given to a run that goes to `backend` but belong to another (or to
    none): each owner's flags together, or the owner's own words where it declared them."""
    parts: list[str] = []
    plain: dict[str, list[str]] = {}
    for name in names:
        owner, f = next(((b, f) for b in backends for f in own_fields(b.Options) if f.name == name), (None, None))
        if owner is None:
            known = ", ".join(f.name for f in fields(backend.Options))
            parts.append(f"{name}: not an option of any backend (the options of {backend.label} runs: {known})")
        elif f.metadata.get("refusal"):
            parts.append(f"{flag_of(f)} {f.metadata['refusal']}")
        else:
            plain.setdefault(owner.name, []).append(flag_of(f))
    for name, flags in plain.items():
        owner = next(b for b in backends if b.name == name)
        parts.append(f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} for {owner.label} runs "
                     f"(--scheduler {owner.name}); this run goes to {backend.label} ({inventory})")
    return "; ".join(parts)
