"""The files that describe a run's model to transformers, kept in OUTPUT_DIR and in every checkpoint.

config.json (the transformers config the run built: preset or model.path, overrides applied),
generation_config.json (model.path's own, when it has one) and the tokenizer's files
(`save_pretrained`: tokenizer.json, tokenizer_config.json, the chat template). Rank 0 copies them
into each checkpoint and every node's copy gets them (checkpoint_storage.RANK0_FILES), so
`trainer export` rebuilds the model and its tokenizer from a checkpoint alone, on a machine that
has neither the run's model.path nor its data.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from trainer.config import ConfigError

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "tokenizer.model")
TOKENIZER_FILES = tuple(f for f in MODEL_FILES if f not in ("config.json", "generation_config.json"))


def write(out: Path, hf_config: Any, tokenizer: Any | None, model_path: str | None) -> None:
    """Into OUTPUT_DIR (local rank 0 of each node), before training starts."""
    out.mkdir(parents=True, exist_ok=True)
    hf_config.to_json_file(str(out / "config.json"))
    gen = Path(model_path) / "generation_config.json" if model_path else None
    if gen is not None and gen.is_file():
        shutil.copyfile(gen, out / "generation_config.json")
    if tokenizer is not None:
        tokenizer.save(out)


def copy(src: Path, dst: Path, names: tuple[str, ...] = MODEL_FILES) -> list[str]:
    """The model files present in src copied into dst; their names."""
    done = []
    for name in names:
        if (src / name).is_symlink():  # never written as one: a link here would copy what it points at
            raise ConfigError(f"{src / name}: a link, not a model file of the run; replace it with the file "
                              "or remove it")
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            done.append(name)
    return done
