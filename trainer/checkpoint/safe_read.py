"""Reading a checkpoint runs nothing from it: its files come from a previous job or another node.

- `rank<r>.pt` (RNG state, data position) is read with `torch.load(weights_only=True)`, with
  the three numpy names NumPy's RNG state pickles to allowed (`RNG_GLOBALS`).
- DCP's `.metadata` is a pickle that `FileSystemReader` reads with `pickle.load`: `Reader` reads it
  with an unpickler that knows only DCP's own metadata classes, torch's sizes, dtypes and layouts
  (`_MetadataUnpickler`), and every shard file it names must be a plain name in the checkpoint.
- A non-tensor value in a shard (an optimizer's lr, betas...) is a `torch.save` blob that DCP's
  default planner loads with `weights_only=False`: `Planner` loads it with `weights_only=True`.

Anything else is one ConfigError naming the file.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from trainer.config import ConfigError
from trainer.runtime.unpickling import why_not_data

# numpy 2 moved numpy.core to numpy._core (pyproject allows numpy >= 1.26; a node's image may hold either).
_multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
MAX_RANK_FILE = 16 << 20  # RNG states (torch, python, numpy, one per GPU) and a data position: a few KB
# DCP's metadata is ~300 bytes per tensor shard (a 1280-entry ZeRO-3 checkpoint: 398,684 bytes), so a
# 70B model's optimizer state sharded over 512 ranks is ~300 MB; a larger file is not one the trainer wrote.
MAX_METADATA = 1 << 30
RNG_GLOBALS = [_multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rank_file(path: Path) -> dict[str, Any]:
    """A checkpoint's rank<r>.pt, read as data only, at most MAX_RANK_FILE bytes."""
    size = path.stat().st_size if path.is_file() else 0
    if size > MAX_RANK_FILE:
        raise ConfigError(f"{path}: {size} bytes, not a trainer RNG file (those are a few KB; at most "
                          f"{MAX_RANK_FILE}); delete it to resume without restoring RNG states")
    try:
        with torch.serialization.safe_globals(RNG_GLOBALS):
            obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - an unpickling error of any kind: one line
        raise ConfigError(f"{path}: not a trainer RNG file ({why_not_data(e)}); "
                          "delete it to resume without restoring RNG states") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("rng"), dict):
        raise ConfigError(f"{path}: not a trainer RNG file (no 'rng' mapping); "
                          "delete it to resume without restoring RNG states")
    return obj


def _allowed(module: str, name: str) -> Any:
    if module == dcp_metadata.__name__:
        obj = getattr(dcp_metadata, name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
    elif (module, name) == (_StorageInfo.__module__, "_StorageInfo"):
        return _StorageInfo
    elif module == "torch":
        obj = getattr(torch, name, None)
        if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    elif (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    elif (module, name) in (("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):
        return getattr(pathlib, name)
    elif (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    elif (module, name) == ("builtins", "getattr"):
        return _enum_member
    return None


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """What pickle's `getattr(cls, name)` may do here: name a member of a metadata enum (Python 3.11's
    pickling of an Enum member, e.g. TensorProperties' _MEM_FORMAT_ENCODING), nothing else."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == dcp_metadata.__name__ \
            and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {str(name)[:40]!r}) "
                                 "is not part of DCP metadata")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"'{module}.{name}' is not part of DCP metadata")
        return obj


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata file, at most MAX_METADATA bytes, unpickled as data, every shard it names a file
    inside the checkpoint."""
    size = path.stat().st_size if path.is_file() else 0
    if size > MAX_METADATA:
        raise ConfigError(f"{path}: {size} bytes, not DCP checkpoint metadata the trainer wrote (at most "
                          f"{MAX_METADATA}); the checkpoint is corrupt or was tampered with: resume from another")
    try:
        with path.open("rb") as f:
            md = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RecursionError, MemoryError) as e:
        raise ConfigError(f"{path}: not DCP checkpoint metadata ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise ConfigError(f"{path}: not DCP checkpoint metadata (a {type(md).__name__})")
    for info in md.storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise ConfigError(f"{path}: a shard entry is a {type(info).__name__}, not a storage record")
        if not _plain_name(info.relative_path):
            raise ConfigError(f"{path}: names shard file {info.relative_path!r}, which is not a file of the "
                              "checkpoint directory; the checkpoint is corrupt or was tampered with")
        for field in ("offset", "length"):
            v = getattr(info, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{path}: shard {info.relative_path}: {field} {v!r} is not a byte count")
    return md


class Reader(FileSystemReader):
    """FileSystemReader that hands DCP the metadata `read_metadata` already read and checked (no
    fallback to per-rank metadata files)."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(str(path))
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ConfigError(f"{self.path}: no per-rank metadata is read")
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class Planner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values load as data only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"value '{read_item.dest_index.fqn}' is not plain data ({why_not_data(e)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state_dict: dict[str, Any], path: Path, **planner_kwargs: Any) -> None:
    """dcp.load of `path` through Reader and Planner; any failure is one ConfigError (DCP's own
    CheckpointException is a BaseException carrying every rank's traceback in its text)."""
    reader = Reader(path, read_metadata(path / ".metadata"))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=Planner(**planner_kwargs))
    except CheckpointException as e:
        exc = next(iter(e.failures.values()))[0] if e.failures else e
        if isinstance(exc, ConfigError):
            raise ConfigError(str(exc)) from None
        raise ConfigError(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
