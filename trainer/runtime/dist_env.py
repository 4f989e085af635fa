"""Who am I: rank/world/local rank from torchrun, Slurm (srun) or Open MPI (mpirun) env; process group.

Order as in the FSDP stub: torchrun's RANK first, then Slurm, then Open MPI, else one process.
Slurm and MPI do not provide a rendezvous address, so MASTER_ADDR is required there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from trainer.config import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "single"             # single | torchrun | slurm | mpi

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(environ: Mapping[str, str], var: str, default: int | None = None) -> int:
    raw = environ.get(var)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"env {var} is required by this launcher but not set")
        return default
    text = raw.split("(")[0].split(",")[0].strip()  # Slurm writes e.g. "4(x2)" for tasks per node
    if not (text.isascii() and text.lstrip("-").isdigit() and len(text) <= 12):
        raise ConfigError(f"env {var}={raw[:40]!r} is not an integer")
    return int(text)


def _master(environ: Mapping[str, str], launcher: str, world: int) -> tuple[str, int]:
    addr = environ.get("MASTER_ADDR", "")
    if not addr:
        if world > 1 and launcher in ("slurm", "mpi"):
            raise ConfigError(f"env MASTER_ADDR is required under {launcher} (e.g. MASTER_ADDR=$(hostname) srun ...)")
        addr = "127.0.0.1"
    if len(addr) > 255 or not addr.isprintable() or any(c.isspace() for c in addr):
        raise ConfigError(f"env MASTER_ADDR={addr[:40]!r} is not a host name or address")
    port = _int(environ, "MASTER_PORT", 29500)
    if not 1 <= port <= 65535:
        raise ConfigError(f"env MASTER_PORT={port} is not a TCP port (1..65535)")
    return addr, port


MAX_WORLD = 1 << 20  # ranks of one job, as trainer/config/bounds.py MAX_RANKS
# Each launcher's variables: rank, world size, local rank, local world size.
NAMES = {"torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
         "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
         "mpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")}


def _checked(env: DistEnv) -> DistEnv:
    """Ranks that can be one process of the job, or one line naming the launcher's variables (a
    RANK not below WORLD_SIZE reached init_process_group, which waited for ranks that never come)."""
    rank, world, local_rank, local_world = NAMES[env.launcher]
    if not 1 <= env.world_size <= MAX_WORLD:
        raise ConfigError(f"env {world}={env.world_size}: a job has 1..{MAX_WORLD} ranks")
    if not 0 <= env.rank < env.world_size:
        raise ConfigError(f"env {rank}={env.rank} is not a rank of {world}={env.world_size} (0..{env.world_size - 1}); "
                          f"{env.launcher} sets both: start the trainer through it")
    if not 1 <= env.local_world_size <= env.world_size:
        raise ConfigError(f"env {local_world}={env.local_world_size} is not 1..{world}={env.world_size}")
    if not 0 <= env.local_rank < env.local_world_size:
        raise ConfigError(f"env {local_rank}={env.local_rank} is not below {local_world}={env.local_world_size} "
                          f"(0..{env.local_world_size - 1})")
    return env


def from_environ(environ: Mapping[str, str] | None = None) -> DistEnv:
    """This process's place in the job from its launcher's env, checked (`_checked`)."""
    env = os.environ if environ is None else environ
    if env.get("RANK", "") != "":
        world = _int(env, "WORLD_SIZE")
        addr, port = _master(env, "torchrun", world)
        return _checked(DistEnv(_int(env, "RANK"), world, _int(env, "LOCAL_RANK", 0),
                                _int(env, "LOCAL_WORLD_SIZE", world), addr, port, "torchrun"))
    if env.get("SLURM_PROCID", "") != "":
        world = _int(env, "SLURM_NTASKS")
        addr, port = _master(env, "slurm", world)
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", 0) or _int(env, "SLURM_TASKS_PER_NODE", world)
        return _checked(DistEnv(_int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0), local_world,
                                addr, port, "slurm"))
    if env.get("OMPI_COMM_WORLD_RANK", "") != "":
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        addr, port = _master(env, "mpi", world)
        return _checked(DistEnv(_int(env, "OMPI_COMM_WORLD_RANK"), world, _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                                _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world), addr, port, "mpi"))
    return DistEnv()


def pick_device(device: str = "auto"):
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("parallel.device: cuda requested but no CUDA device is visible")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return torch.device("cuda") if use_cuda else torch.device("cpu")


def training_dtype(requested: str, device_type: str, native_bf16: bool | None = None) -> tuple[str, str | None]:
    """The dtype to train in, and why it differs from the request (None when it does not).

    auto: bf16 on a CUDA device with native bf16 (compute capability >= 8: A100, H100, L4, ...),
    fp32 everywhere else (CPUs: bitwise-reproducible fp32 numerics by default).
    bf16 asked on a CUDA GPU without native bf16 (V100, T4) trains in fp32. Native, not
    `torch.cuda.is_bf16_supported()`'s default: that also counts emulation (any GPU on which a
    bf16 tensor can be created, slower than fp32), so it is True almost everywhere. CPUs keep an
    explicit bf16 (autocast runs it everywhere, and the CPU runs of the suite rely on that)."""
    if requested == "auto":
        if device_type != "cuda":
            return "fp32", None
        return ("bf16" if _native_bf16(native_bf16) else "fp32"), None
    if requested != "bf16" or device_type != "cuda":
        return requested, None
    if _native_bf16(native_bf16):
        return "bf16", None
    return "fp32", ("train.dtype bf16: this CUDA device has no native bf16 support "
                    "(torch.cuda.is_bf16_supported(including_emulation=False) is False); training in fp32")


def resolve_param_dtype(requested: str, dtype: str, device_type: str, task: str = "") -> str:
    """train.param_dtype for this run: auto -> bf16 where the run computes in bf16 on CUDA (FSDP2's
    mixed precision: bf16 activations throughout), else fp32 (autocast over fp32 weights).
    Image models (Wide-ResNet) stay fp32: mixed precision would cast BatchNorm's weight to bf16
    beside its fp32 running statistics, a mix batch_norm refuses (cuDNN and CPU alike)."""
    if task == "image":
        if requested == "bf16":
            raise ConfigError("train.param_dtype bf16: not for an image model (its BatchNorm keeps fp32 running "
                              "statistics); use auto or fp32 (train.dtype bf16 still computes in bf16 via autocast)")
        return "fp32"
    if requested == "auto":
        return "bf16" if dtype == "bf16" and device_type == "cuda" else "fp32"
    return requested


def cuda_index(local_rank: int, device_count: int) -> int:
    """The CUDA device of a local rank among the visible ones: a launcher that gives each task only
    its own GPU (Slurm --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank) leaves local rank 3 one
    device, cuda:0."""
    return local_rank % max(device_count, 1)


def local_device(device_type: str, local_rank: int):
    import torch

    if device_type != "cuda":
        return torch.device(device_type)
    return torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count()))


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def configure_allocator(environ: dict | None = None) -> str | None:
    """expandable_segments for the CUDA caching allocator (less fragmentation at changing shapes:
    chunked loss, eval, pipeline microbatches), unless the user set an allocator config. Must run
    before the first CUDA allocation. Returns what it set."""
    env = os.environ if environ is None else environ
    if any(env.get(v) for v in ALLOC_CONF_VARS):
        return None
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def init_one_rank_group(device) -> None:
    """A process group of this process alone (world size 1) on an in-memory store: no address, no
    port. For FSDP2 over a mesh of one rank (what the tests compare the trainer's one-process bf16
    weights with, master_weights.py); does nothing when a group exists."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = torch.device("cuda", device.index if device.index is not None
                                           else torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, **kwargs)


def _native_bf16(known: bool | None) -> bool:
    if known is not None:
        return known
    import torch

    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def configure_matmul_precision(device_type: str, dtype: str) -> str | None:
    """fp32 on CUDA: TF32 tensor cores for matmuls and convolutions (8x the fp32 rate on an A100,
    10 mantissa bits). Never on CPU: CPU runs stay bitwise reproducible. Returns what it set.

    The legacy flags on purpose: torch >= 2.9's per-backend `fp32_precision` API makes any later
    reader of the legacy flags (libraries, older inductor paths) raise a "mix of APIs" error."""
    if device_type != "cuda" or dtype != "fp32":
        return None
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return "fp32 matmuls and convolutions on TF32 tensor cores"


def init_process_group(env: DistEnv, device_type: str, backend: str = "auto", timeout_s: int = 1800) -> str:
    """Start the default process group (env:// rendezvous). Returns the backend used."""
    import torch
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if not env.distributed or dist.is_initialized():
        return backend
    # env:// reads these; srun/mpirun do not set them the torchrun way.
    os.environ.update({"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size),
                       "LOCAL_RANK": str(env.local_rank), "MASTER_ADDR": env.master_addr,
                       "MASTER_PORT": str(env.master_port)})
    kwargs = {}
    if device_type == "cuda":
        device = local_device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    return backend


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# The process groups' collective timeout now (contract/hang.py sizes it; trainer/runtime/heartbeat.py
# moves it as the run goes: start-up, steady steps, checkpoints).
_TIMEOUT_S: float | None = None


def set_collective_timeout(seconds: float) -> int:
    """Every process group this rank is in (the default one, DeviceMesh's, the checkpointer's):
    their collectives' timeout from now on, through torch's `_set_pg_timeout` (gloo and NCCL). A
    group made by `new_group` without a timeout would wait torch's default 30 minutes (10 on NCCL)
    whatever init_process_group was given (DeviceMesh's, split from the default group, take its
    timeout at creation). gloo's point-to-point waits keep their group's first timeout: the
    pipeline's waits pass p2p_timeout() instead (trainer/runtime/phase_hooks.py). Returns how many
    groups took it (0: no process group)."""
    global _TIMEOUT_S
    import warnings

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _TIMEOUT_S = float(seconds)
    if not dist.is_available() or not dist.is_initialized():
        return 0
    timeout, n = timedelta(seconds=seconds), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a backend that takes no timeout (torch warns): left as it is
        for group in list(c10d._world.pg_map):
            try:
                c10d._set_pg_timeout(timeout, group)
                n += 1
            except (ValueError, RuntimeError, AssertionError):
                continue
    return n


def p2p_timeout() -> timedelta | None:
    """The timeout a gloo point-to-point wait should be given now (None: none was sized)."""
    return None if _TIMEOUT_S is None else timedelta(seconds=_TIMEOUT_S)


def process_started(pid: int | str = "self") -> float | None:
    """Epoch seconds at which a process (default: this one) was started, from /proc (Linux), or
    None where it cannot be read. The in-place rejoin's `ready` carries it: its start-up split into
    the launcher's part (container start -> this process) and this process's own (imports)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime: clock ticks after boot
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
