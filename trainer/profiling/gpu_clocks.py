"""GPU clocks for Perseus plans: one interface, `profile.gpu_clocks: off | auto | on`.

- off (the default): nothing is ever set; plans are recorded (plans-{rank}.csv) and the log says
  once per plan that it was not applied. The only mode for a GPU machine that is not yours (a
  borrowed or shared one): its clock settings must be left as they are.
- auto: tries NVML (`nvmlDeviceSetGpuLockedClocks`, which needs root or an administrator's
  permission); without a GPU, NVML, permission or support it falls back to off and says why.
- on: as auto, but a rank that cannot set clocks fails at start with that reason.

The supported list (graphics clocks at the highest memory clock, descending: what Zeus's client
reports to the server) is read in every mode: reading it changes nothing. Clocks that were set are
reset (`nvmlDeviceResetGpuLockedClocks`) at exit and on SIGTERM/SIGINT/SIGHUP (then the signal's
previous handler runs); a SIGKILLed rank cannot reset them: `nvidia-smi -rgc` does.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from trainer.config import ConfigError

log = logging.getLogger("trainer")

MODES = ("off", "auto", "on")
RESET_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class GpuClocks:
    """This rank's GPU clocks. `active`: plans are applied; `why`: why not, when not."""

    def __init__(self, mode: str, cuda_index: int | None, open_device: Callable[[int], tuple] | None = None):
        if mode not in MODES:
            raise ConfigError(f"profile.gpu_clocks: '{mode}' (off, auto or on)")
        self.mode, self.active, self.why = mode, False, ""
        self.supported: list[int] = []
        self._nvml: Any = None
        self._handle: Any = None
        self._locked = False
        self._previous: dict[int, Any] = {}
        if cuda_index is None:
            self.why = "no CUDA GPU"
        else:
            self._open(cuda_index, open_device)
        if mode == "off":
            self.why = "profile.gpu_clocks off"
        elif self._handle is not None and self.supported:
            self._try_lock()
        elif not self.why:
            self.why = "NVML lists no supported graphics clocks"
        if mode == "on" and not self.active:
            raise ConfigError(f"profile.gpu_clocks on: cannot set this rank's GPU clocks: {self.why} "
                              f"(use auto to fall back, or off)")
        if mode == "auto" and not self.active:
            log.warning("profile.gpu_clocks auto: plans are recorded, not applied: %s", self.why)

    def _open(self, cuda_index: int, open_device: Callable[[int], tuple] | None) -> None:
        if open_device is None:
            from trainer.profiling.nvml import open_device
        try:
            self._nvml, self._handle, _ = open_device(cuda_index)
            mem = max(self._nvml.nvmlDeviceGetSupportedMemoryClocks(self._handle))
            self.supported = sorted(self._nvml.nvmlDeviceGetSupportedGraphicsClocks(self._handle, mem), reverse=True)
        except ImportError:
            self.why = "pynvml not installed (pip install nvidia-ml-py)"
        except Exception as e:  # noqa: BLE001 - any NVML failure: no clock list, no control
            self._handle = None
            self.why = f"NVML unusable for cuda:{cuda_index} ({e})"

    def _try_lock(self) -> None:
        """Set the highest supported clock once: whether NVML lets this process set clocks at all."""
        try:
            self._set(self.supported[0])
        except Exception as e:  # noqa: BLE001 - NoPermission, NotSupported, ...
            self.why = f"NVML refused to set clocks ({e}; needs root or `nvidia-smi -acp UNRESTRICTED`)"
            return
        self.active = True
        atexit.register(self.reset)
        for sig in RESET_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: atexit still resets
                break

    def _set(self, mhz: int) -> None:
        self._nvml.nvmlDeviceSetGpuLockedClocks(self._handle, mhz, mhz)
        self._locked = True

    def apply(self, mhz: int) -> bool:
        """Lock the GPU at mhz when active; whether it was applied."""
        if not self.active:
            return False
        self._set(mhz)
        return True

    def reset(self) -> None:
        if self._locked:
            self._locked = False
            try:
                self._nvml.nvmlDeviceResetGpuLockedClocks(self._handle)
            except Exception as e:  # noqa: BLE001 - at exit: say so, nothing else can be done
                log.warning("could not reset the GPU clocks (%s): run `nvidia-smi -rgc`", e)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.reset()
        prev = self._previous.get(signum, signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
