"""Model and dataset folders as they come from the Hugging Face Hub, read offline (torch-free).

A folder is taken as one of:
- a plain folder (`save_pretrained`, `hf download --local-dir`, `datasets` `save_to_disk`, files);
- a Hub cache repo folder (`models--org--name/` or `datasets--org--name/`, as `hf download` and
  `snapshot_download` leave it: `blobs/`, `refs/main`, `snapshots/<rev>/`), meaning the snapshot
  `refs/main` names (or its only snapshot);
- one snapshot, `.../snapshots/<rev>/`, whose files are links into `../../blobs/`.

After `job.sync` a node holds the same layout with the links replaced by the files they point to,
so the same paths work there. A link whose target is missing (an interrupted download, a cache
pruned by `hf cache delete`) is named in one line before anything reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.config.schema import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
MAX_REF = 4096          # bytes of refs/main (a commit hash: 40)
MAX_INDEX = 64 << 20    # bytes of a weights index (a 400B model's: ~150 KB)


def read_small_text(path: Path, limit: int, key: str) -> str:
    """A small text file the Hub (or a user) wrote: at most `limit` bytes read, UTF-8, or one line."""
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{key}: '{path}' cannot be read ({e.strerror or e})") from None
    if len(raw) > limit:
        raise ConfigError(f"{key}: '{path}' is over {limit} bytes; not a file of a Hub download")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: '{path}' is not UTF-8 text (byte {e.start}); download it again") from None


def snapshot_dir(path: str | Path, key: str) -> Path:
    """The folder to read: `path` itself, or the snapshot a Hub cache repo folder points at."""
    p = Path(path)
    snaps = p / "snapshots"
    if not (snaps.is_dir() and (p / "blobs").is_dir()):
        return p
    revs = sorted(d.name for d in snaps.iterdir() if d.is_dir())
    ref = p / "refs" / "main"
    if ref.is_file():
        rev = read_small_text(ref, MAX_REF, key).strip()
        if rev in revs:
            return snaps / rev
        raise ConfigError(f"{key}: '{ref}' names snapshot '{rev[:40]}', which is not under '{snaps}' "
                          f"(an interrupted download?); download it again or point {key} at one of {revs}")
    if len(revs) == 1:
        return snaps / revs[0]
    raise ConfigError(f"{key}: '{p}' holds {len(revs)} snapshots and no refs/main; point {key} at one of "
                      f"'{snaps}/<rev>' ({', '.join(revs) or 'none'})")


MAX_ENTRIES = 100_000          # files and folders of a model or tokenizer folder (a Hub repo: dozens)
MAX_DATA_ENTRIES = 10_000_000  # of a dataset folder (a corpus of many small files)


def check_links(root: Path, key: str, limit: int = MAX_ENTRIES) -> None:
    """One line naming the first link under `root` whose target does not exist. At most `limit`
    entries are looked at: `--model.path /` walked the whole filesystem before."""
    seen = 0
    for d, dirs, files in os.walk(root):
        seen += len(dirs) + len(files)
        if seen > limit:
            raise ConfigError(f"{key}: '{root}' holds over {limit} files and folders; point {key} at the "
                              "model, tokenizer or dataset folder itself")
        for name in sorted(dirs) + sorted(files):
            p = os.path.join(d, name)
            if os.path.islink(p) and not os.path.exists(p):
                raise ConfigError(f"{key}: '{p}' is a link to '{os.readlink(p)}', which does not exist (an "
                                  "interrupted download or a pruned cache?); download it again")


def model_dir(path: str | Path, load_weights: bool = True) -> Path:
    """The model folder `model.path` names, checked: a config.json, and with `load_weights` the
    weights (every shard an index lists), no broken link. One line naming what is missing."""
    key = "model.path"
    p = snapshot_dir(path, key)
    if not p.is_dir():
        raise ConfigError(f"{key}: '{path}' is not a local model directory")
    check_links(p, key)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{key}: '{p}' has no config.json (expected a save_pretrained folder or a Hub "
                          "snapshot, models--org--name/snapshots/<rev>/)")
    if not load_weights:
        return p
    present = [f for f in WEIGHT_FILES if (p / f).is_file()]
    if not present:
        raise ConfigError(f"{key}: '{p}' has config.json but no weights ({', '.join(WEIGHT_FILES)}); download "
                          "them, or set model.load_weights false to train this architecture from random init")
    index = next((f for f in present if f.endswith(".index.json")), None)
    if index is not None and not any(f == index.removesuffix(".index.json") for f in present):
        try:
            shards = sorted(set(json.loads(read_small_text(p / index, MAX_INDEX, key))["weight_map"].values()))
            if not all(isinstance(s, str) for s in shards):
                raise ValueError("a shard name is not a string")
        except (OSError, ValueError, KeyError, AttributeError, TypeError, RecursionError):
            raise ConfigError(f"{key}: '{p / index}' is not a weights index (no weight_map)") from None
        outside = [s for s in shards if s in ("", ".", "..") or "/" in s or "\\" in s or "\0" in s]
        if outside:  # transformers would load it from wherever it points
            raise ConfigError(f"{key}: '{p / index}' lists weight shard {outside[0][:100]!r}, which is not a file "
                              "of the model folder; a Hub index names its shards by file name only")
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise ConfigError(f"{key}: '{p}' lacks {len(missing)} of the {len(shards)} weight shards its "
                              f"{index} lists (first: {missing[0]}); download them again")
    return p
