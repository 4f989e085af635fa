"""`trainer export CKPT DIR`: a checkpoint's model as a transformers `save_pretrained` directory.

CKPT is a checkpoint directory, a checkpoints root (meaning its `latest`), or a run collected
from nodes without shared storage (`runner collect`'s `artifacts/<run>/`: each node's copy holds
only its own ranks' shards; the export reads their union). The model is rebuilt on one process
(no process group) from the checkpoint's config.json (the transformers config the run built, so
the run's model.path need not exist here) or, for older checkpoints, its config.yaml; its weights
are read from the DCP shards whatever layout wrote them and saved with save_pretrained, next to
the run's tokenizer files and generation config (trainer/models/files.py). Load it with
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from trainer.checkpoint import safe_read
from trainer.checkpoint.on_disk import read_state, resolve_resume, verify_manifests
from trainer.checkpoint.state import model_signature
from trainer.config import Config, ConfigError, apply_yaml
from trainer.models import files as model_files

MARKER = ".trainer-export"  # in every DIR an export wrote: a later export may write there again
USAGE = ("usage: trainer export CKPT DIR   (CKPT: a checkpoint directory, a checkpoints root, or a run "
         "collected from several nodes, artifacts/<run>/)")


def node_copies(path: Path) -> list[Path]:
    """The checkpoint directories to read: one, or each node's copy of the latest checkpoint of a
    collected run (`<run>/<node>/checkpoints/`), which must all name the same checkpoint."""
    if not path.is_dir():
        raise ConfigError(f"export: '{path}' is not a directory")
    roots = sorted(p for p in path.glob("*/checkpoints") if p.is_dir())
    if (path / "trainer_state.json").is_file() or (path / "latest").is_file() or not roots:
        ckpt = resolve_resume(str(path), path)
        if ckpt is None:
            raise ConfigError(f"export: no checkpoint under '{path}'")
        return [ckpt]
    copies = [c for c in (resolve_resume("latest", r) for r in roots) if c is not None]
    names = {c.name for c in copies}
    if not copies:
        raise ConfigError(f"export: no node under '{path}' has a checkpoint (<node>/checkpoints/latest)")
    if len(names) != 1:
        raise ConfigError(f"export: the nodes under '{path}' point at different checkpoints ({', '.join(sorted(names))});"
                          " pass one node's checkpoint directory")
    return copies


def _union(copies: list[Path], into: Path) -> Path:
    """A directory holding every file of every copy (the first copy of each name wins: the files
    rank 0 writes are the same on every node): links to the shards, copies of the model files that
    the export copies out by name. A link in a copy is refused."""
    for c in copies:
        for f in c.iterdir():
            if f.is_symlink():  # collect writes none: a link here would read (and copy out) what it names
                raise ConfigError(f"{f}: a link, not a file of the checkpoint; replace it with the file or remove it")
            if not f.is_file() or (into / f.name).exists():
                continue
            if f.name in model_files.MODEL_FILES:  # copied into the export by name: a copy, never a link
                shutil.copyfile(f, into / f.name)
            else:
                os.symlink(f.resolve(), into / f.name)
    return into


def check_destination(out: Path) -> None:
    """DIR is new, empty, or an earlier export (MARKER): save_pretrained replaces config.json and
    the weights there and deletes weight shards it did not write, so a folder of the user's (another
    model) lost its files before. One line naming the folder and a file in it, nothing written."""
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise ConfigError(f"export: '{out}' exists and is not a directory; export into a new or empty directory")
    first = next(iter(sorted(p.name for p in out.iterdir())), None)
    if first is not None and not (out / MARKER).is_file():
        raise ConfigError(f"export: '{out}' holds files the trainer did not write (e.g. {first!r}); nothing was "
                          "written: export into a new or empty directory")


def export(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    check_destination(Path(argv[1]))
    copies = node_copies(Path(argv[0]))
    with tempfile.TemporaryDirectory(prefix="trainer-export-") as tmp:
        ckpt = copies[0] if len(copies) == 1 else _union(copies, Path(tmp))
        return _export(ckpt, copies[0], Path(argv[1]))


def _export(ckpt: Path, named: Path, out: Path) -> int:
    from trainer.models.build import build_model, model_spec

    state = read_state(ckpt)
    if not (ckpt / "config.yaml").is_file():
        raise ConfigError(f"{named / 'config.yaml'}: missing; cannot rebuild the model")
    err = verify_manifests(ckpt, int(state.get("world_size", 1)), 0, 1, all_present=True, crc=False,
                           hint="collected from nodes without shared storage? export the run directory "
                                "(artifacts/<run>/), which holds every node's copy")
    if err:
        raise ConfigError(f"export: {err}")
    cfg = Config()
    apply_yaml(cfg, ckpt / "config.yaml")
    if (ckpt / "config.json").is_file():
        cfg.model.path = str(ckpt)  # the config the run built: model.path of the run may be a node's path
    cfg.model.load_weights = False  # weights come from the checkpoint
    spec = model_spec(cfg.model, state["model"].get("vocab_size"))
    mine = model_signature(spec)
    for key, value in state["model"].items():
        if mine.get(key) != value:
            raise ConfigError(f"{named / 'trainer_state.json'}: model key '{key}' is {value!r} but the config "
                              f"rebuilds {mine.get(key)!r}")
    model = build_model(spec, cfg.model, cfg.train.seed)
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": expected, this is a single-process read
        try:
            safe_read.load({"app": {"model": sd}}, ckpt)
        except Exception as e:  # noqa: BLE001 - one line for the user
            raise ConfigError(f"{named}: cannot read the model shards: {' '.join(str(e).split())[:300]}") from None
    model.load_state_dict(sd)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = True  # trained without a KV cache; generation wants one
    check_destination(out)  # again: the model took a while to build
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `trainer export`: a later export may replace these files\n")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(out)
    model_files.copy(ckpt, out, model_files.TOKENIZER_FILES + ("generation_config.json",))
    logging.getLogger("trainer").info("exported %s (step %d) to %s", named, state["step"], out)
    print(f"exported {named} (step {state['step']}, {spec.family}) to {out}")
    return 0
