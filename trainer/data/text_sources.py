"""The documents of `data.source`, read offline through `datasets`.

`data.source` may be:
- a file: .txt (paragraphs are documents), .jsonl/.json, .parquet or .arrow;
- a folder `datasets` wrote with `save_to_disk` (a Dataset, or a DatasetDict: `data.split` picks one);
- a Hub dataset snapshot (`datasets--org--name/snapshots/<rev>/`, one of its config folders, or the
  repo folder itself: trainer/config/hub_layout.py) or any folder of .jsonl/.json/.parquet/.arrow files:
  read by `datasets` as it reads a Hub repo, splits from the file names (`train-00000-of-00001.parquet`,
  `data/train/...`; files without a split name are all `train`), then `data.split`;
- a folder of .txt files: every file, paragraphs as documents.

Each document is the row's `data.text_field`; with `data.chat_template true` that column holds
conversations (lists of {role, content} messages), rendered later by the model's own chat template.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, DataConfig

# Nothing downloads at run time; without these `datasets` waits on network timeouts even for local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TEXT_EXT = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet",
            ".arrow": "arrow"}


def load_texts(dcfg: DataConfig, cache_dir: str | None = None) -> list[Any]:
    """The documents: non-empty strings, or message lists with data.chat_template."""
    import datasets

    datasets.disable_progress_bars()
    ds, where, plain = _dataset(dcfg, cache_dir)
    field = "text" if plain else dcfg.text_field  # plain text files have the one column `datasets` names text
    if field not in ds.column_names:
        raise ConfigError(f"data.text_field: no column '{field}' in {where} (columns: {', '.join(ds.column_names)})")
    try:
        rows = list(ds[field])  # pyarrow's JSON reader keeps bytes as they are: decoded only here
    except UnicodeDecodeError:
        raise not_utf8(Path(where)) or ConfigError(f"data.source: '{where}' holds text that is not UTF-8") from None
    if dcfg.chat_template:
        bad = next((r for r in rows if not _is_conversation(r)), None)
        if bad is not None:
            raise ConfigError(f"data.chat_template: column '{field}' of {where} must hold conversations (lists of "
                              f"{{role, content}} messages), found {type(bad).__name__} {str(bad)[:60]!r}")
        return [r for r in rows if r]
    bad = next((r for r in rows if r is not None and not isinstance(r, str)), None)
    if bad is not None:
        hint = " (conversations: set data.chat_template true)" if _is_conversation(bad) else ""
        raise ConfigError(f"data.text_field: column '{field}' of {where} holds {type(bad).__name__}, not text{hint}")
    return [t for t in rows if t and t.strip()]


def _is_conversation(row: Any) -> bool:
    return isinstance(row, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in row)


def _dataset(dcfg: DataConfig, cache_dir: str | None) -> tuple[Any, str, bool]:
    """(a datasets.Dataset, the path to name in messages, whether it is read from .txt files)."""
    import datasets

    from trainer.config.hub_layout import MAX_DATA_ENTRIES, check_links, snapshot_dir

    src = Path(dcfg.source)
    if src.is_file():
        kind = TEXT_EXT.get(src.suffix)
        if kind is None:
            raise ConfigError(f"data.source: '{src}' is not a .txt/.jsonl/.json/.parquet/.arrow file nor a folder")
        return _load_files(kind, [str(src)], None, cache_dir), str(src), kind == "text"
    d = snapshot_dir(src, "data.source")
    if not d.is_dir():
        raise ConfigError(f"data.source: '{dcfg.source}' does not exist (a file or folder, or 'synthetic')")
    check_links(d, "data.source", MAX_DATA_ENTRIES)
    if (d / "dataset_dict.json").is_file() or (d / "state.json").is_file():
        try:
            ds = datasets.load_from_disk(str(d))
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"data.source: '{d}' looks like a save_to_disk folder but cannot be read: "
                              f"{' '.join(str(e).split())[:200]}") from None
        if isinstance(ds, datasets.DatasetDict):
            if dcfg.split not in ds:
                raise ConfigError(f"data.split: no split '{dcfg.split}' in {d} (splits: {', '.join(ds)})")
            ds = ds[dcfg.split]
        return ds, str(d), False
    files = sorted(f for f in d.rglob("*") if f.is_file() and f.suffix in TEXT_EXT
                   and not any(part.startswith(".") for part in f.relative_to(d).parts))
    if not files:
        raise ConfigError(f"data.source: no .txt/.jsonl/.parquet/.arrow files under '{d}'")
    kinds = {TEXT_EXT[f.suffix] for f in files}
    if len(kinds) != 1:
        raise ConfigError(f"data.source: '{d}' must hold files of one kind (.txt, .jsonl/.json, .parquet or .arrow)")
    kind = kinds.pop()
    if kind == "text":
        return _load_files(kind, [str(f) for f in files], None, cache_dir), str(d), True
    return _load_files(kind, None, str(d), cache_dir, dcfg.split), str(d), False


def _load_files(kind: str, files: list[str] | None, folder: str | None, cache_dir: str | None,
                split: str = "train") -> Any:
    import datasets

    try:
        if folder is not None:  # split names from the file layout, as for a Hub repo
            return datasets.load_dataset(folder, split=split, cache_dir=cache_dir)
        if kind == "arrow":
            return datasets.Dataset.from_file(files[0])  # type: ignore[index]
        kwargs: dict[str, Any] = {"sample_by": "paragraph"} if kind == "text" else {}
        return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir, **kwargs)
    except ValueError as e:
        msg = " ".join(str(e).split())
        where = folder or files[0]  # type: ignore[index]
        if "Unknown split" in msg:
            raise ConfigError(f"data.split: '{split}' is not a split of {where}: {msg[:200]}") from None
        if "Config name is missing" in msg or "BuilderConfig" in msg:
            raise ConfigError(f"data.source: '{where}' holds several configurations; point data.source at the "
                              f"folder of one: {msg[:200]}") from None
        raise not_utf8(Path(where)) or ConfigError(f"data.source: cannot read '{where}': {msg[:300]}") from None
    except (OSError, RuntimeError, datasets.exceptions.DatasetGenerationError) as e:  # RuntimeError: a loading script
        where = folder or files[0]  # type: ignore[index]
        raise not_utf8(Path(where)) or ConfigError(f"data.source: cannot read '{where}': "
                                                   f"{' '.join(str(e).split())[:300]}") from None


def not_utf8(where: Path) -> ConfigError | None:
    """One line naming the first text file of `where` (a file or a folder) that is not UTF-8, and the
    byte, or None when each is: `datasets` says only "An error occurred while generating the
    dataset", and pyarrow reads JSON lines without decoding them (a UnicodeDecodeError traceback when
    the rows were read). Looked for only once reading failed: a good corpus is never read twice."""
    import codecs

    try:
        files = [where] if where.is_file() else sorted(
            f for f in where.rglob("*") if f.is_file() and TEXT_EXT.get(f.suffix) in ("text", "json"))
    except OSError:  # a folder it may not list: the caller's own message stands
        return None
    for f in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        try:
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    decoder.decode(chunk)
                    offset += len(chunk)
                decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            return ConfigError(f"data.source: '{f}' is not UTF-8 (byte {offset + e.start}); save it as UTF-8")
        except OSError:
            continue
    return None
