"""`trainer export CKPT DIR`: a checkpoint's model as a transformers `save_pretrained` directory.

CKPT is a checkpoint directory (or a checkpoints root, meaning its `latest`). The model is
rebuilt from the checkpoint's config.yaml on one process (no process group), its weights are
read from the DCP shards whatever layout wrote them, and it is saved with save_pretrained
(plus tokenizer.json when the run trained on text). Load it with
`AutoModelForCausalLM.from_pretrained(DIR)` (or the family's class).
"""

from __future__ import annotations

import logging
import shutil
import sys
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from trainer.checkpoint import read_state, resolve_resume
from trainer.checkpoint_state import model_signature
from trainer.config import Config, ConfigError, apply_yaml

USAGE = "usage: trainer export CKPT DIR   (CKPT: a checkpoint directory or a checkpoints root)"


def export(argv: list[str]) -> int:
    from trainer.models.build import build_model, model_spec

    if len(argv) != 2 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    ckpt = resolve_resume(argv[0], Path(argv[0]))
    if ckpt is None:
        raise ConfigError(f"export: no checkpoint under '{argv[0]}'")
    out = Path(argv[1])
    state = read_state(ckpt)
    if not (ckpt / "config.yaml").is_file():
        raise ConfigError(f"{ckpt / 'config.yaml'}: missing; cannot rebuild the model")
    cfg = Config()
    apply_yaml(cfg, ckpt / "config.yaml")
    cfg.model.load_weights = False  # weights come from the checkpoint
    spec = model_spec(cfg.model, state["model"].get("vocab_size"))
    mine = model_signature(spec)
    for key, value in state["model"].items():
        if mine.get(key) != value:
            raise ConfigError(f"{ckpt / 'trainer_state.json'}: model key '{key}' is {value!r} but the config "
                              f"rebuilds {mine.get(key)!r}")
    model = build_model(spec, cfg.model, cfg.train.seed)
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": expected, this is a single-process read
        try:
            dcp.load({"app": {"model": sd}}, checkpoint_id=str(ckpt), planner=DefaultLoadPlanner())
        except Exception as e:  # noqa: BLE001 - one line for the user
            raise ConfigError(f"{ckpt}: cannot read the model shards: {' '.join(str(e).split())[:300]}") from None
    model.load_state_dict(sd)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if (ckpt / "tokenizer.json").is_file():
        shutil.copyfile(ckpt / "tokenizer.json", out / "tokenizer.json")
    logging.getLogger("trainer").info("exported %s (step %d) to %s", ckpt, state["step"], out)
    print(f"exported {ckpt} (step {state['step']}, {spec.family}) to {out}")
    return 0
