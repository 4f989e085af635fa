"""Which NVML device is this process's GPU, and its cumulative energy counter.

NVML numbers every GPU of the machine in PCI bus order and ignores CUDA_VISIBLE_DEVICES, while
`cuda:i` is the i-th *visible* device in CUDA's order (fastest first unless
CUDA_DEVICE_ORDER=PCI_BUS_ID). So `nvmlDeviceGetHandleByIndex(local_rank)` reads the wrong GPU
as soon as a job runs on a subset (`CUDA_VISIBLE_DEVICES=2,3`) or the GPUs differ. The handle is
found, in order of exactness, by:

1. the UUID CUDA itself reports for the device (`torch.cuda.get_device_properties(i).uuid`),
2. its PCI address (`pci_domain_id:pci_bus_id:pci_device_id.0`, where torch exposes them),
3. the i-th entry of CUDA_VISIBLE_DEVICES: a `GPU-` UUID (a unique prefix is enough, as for
   CUDA) or an index (meant in NVML's order: right with CUDA_DEVICE_ORDER=PCI_BUS_ID or
   identical GPUs); unset means index i.

MIG instances (`MIG-` entries) have no energy counter of their own: reported, not guessed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

UUID = re.compile(r"^(GPU-)?[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")


@dataclass
class CudaIdentity:
    """What CUDA says about the process's device `index` (None where torch does not expose it)."""

    index: int
    uuid: str | None = None        # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", NVML's spelling
    pci_bus_id: str | None = None  # "0000:3b:00.0"


def cuda_identity(index: int) -> CudaIdentity:
    import torch

    return identity_from_props(index, torch.cuda.get_device_properties(index))


def identity_from_props(index: int, props: Any) -> CudaIdentity:
    """torch prints the UUID without NVML's "GPU-" prefix; PCI fields exist in newer torch only."""
    ident = CudaIdentity(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if UUID.match(uuid):
        ident.uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    pci = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(v, int) for v in pci):
        ident.pci_bus_id = f"{pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}.0"
    return ident


def _by_visible_entry(nvml: Any, entry: str) -> tuple[Any, str]:
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry)), f"CUDA_VISIBLE_DEVICES entry {entry} (NVML index)"
    if entry.startswith("MIG-"):
        raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry} is a MIG instance: NVML has no energy counter for it")
    if entry.startswith("GPU-"):
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        hits = [h for h in handles if str(nvml.nvmlDeviceGetUUID(h)).startswith(entry)]
        if len(hits) != 1:
            raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry} matches {len(hits)} NVML devices")
        return hits[0], f"CUDA_VISIBLE_DEVICES entry {entry}"
    raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry!r} is neither an index nor a GPU- UUID")


def nvml_handle(nvml: Any, ident: CudaIdentity, visible: str | None) -> tuple[Any, str]:
    """(NVML handle of the device, how it was found); ValueError when nothing identifies it."""
    tried = []
    if ident.uuid:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(ident.uuid), f"UUID {ident.uuid}"
        except nvml.NVMLError as e:
            tried.append(f"UUID {ident.uuid}: {e}")
    if ident.pci_bus_id:
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(ident.pci_bus_id), f"PCI {ident.pci_bus_id}"
        except nvml.NVMLError as e:
            tried.append(f"PCI {ident.pci_bus_id}: {e}")
    if visible is None:
        return nvml.nvmlDeviceGetHandleByIndex(ident.index), f"index {ident.index} (CUDA_VISIBLE_DEVICES unset)"
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ident.index >= len(entries):
        raise ValueError(f"cuda:{ident.index} but CUDA_VISIBLE_DEVICES={visible!r} lists {len(entries)}"
                         + (f" ({'; '.join(tried)})" if tried else ""))
    return _by_visible_entry(nvml, entries[ident.index])


def open_device(index: int, nvml: Any = None, ident: CudaIdentity | None = None,
                environ: dict[str, str] | None = None) -> tuple[Any, Any, str]:
    """(pynvml module, NVML handle of cuda:index, how it was found); raises on any NVML failure.

    `nvml` and `ident` default to pynvml and what torch reports; tests pass stand-ins because no
    GPU exists on the test machine."""
    if nvml is None:
        import pynvml as nvml
    env = os.environ if environ is None else environ
    nvml.nvmlInit()
    ident = ident or cuda_identity(index)
    handle, how = nvml_handle(nvml, ident, env.get("CUDA_VISIBLE_DEVICES"))
    return nvml, handle, how


def nvml_reader(index: int, nvml: Any = None, ident: CudaIdentity | None = None,
                environ: dict[str, str] | None = None) -> tuple[Callable[[], float] | None, str]:
    """(reader of this GPU's cumulative Joules, "NVML <device>") or (None, why not)."""
    try:
        nvml, handle, how = open_device(index, nvml, ident, environ)
    except ImportError:
        return None, "pynvml not installed (pip install nvidia-ml-py)"
    except Exception as e:  # noqa: BLE001 - any NVML failure means: no usable sensor
        return None, f"NVML unusable for cuda:{index} ({e})"
    try:
        nvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # Volta and newer; raises NotSupported before
        name = nvml.nvmlDeviceGetUUID(handle)
    except Exception as e:  # noqa: BLE001
        return None, f"NVML unusable for cuda:{index} ({e})"
    return (lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3), f"NVML {name} (by {how})"  # mJ -> J
