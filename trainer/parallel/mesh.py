"""ParallelDims: the one object that owns the parallel degrees and the DeviceMesh built from them.

Mesh dims, outermost first: ("pp", "dp_replicate", "dp_shard", "tp") — tp fastest so TP peers
sit on the same node, pp slowest. dp = dp_replicate x dp_shard; dp = world / (tp x pp) when not
given. Sub-meshes by name: `mesh["pp"]`, `mesh["tp"]`, `dims.dp_mesh` (1-D "dp" for data
sharding and loss averaging), `dims.fsdp_mesh` (what fully_shard/DDP receive), "stage" (every
rank of one pipeline stage: dp x tp flattened, over which set-up broadcasts the seeded weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.config import ConfigError, ParallelConfig

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sharding: str = "ddp"
    mesh: Any = field(default=None, repr=False)
    # The flattened dims, kept as _flatten returns them: slicing a flattened dim out of the root
    # mesh (mesh["dp"]) is deprecated in torch (a UserWarning from every rank).
    flat: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def hybrid(self) -> bool:
        return self.sharding.endswith("_hybrid")

    @property
    def fsdp(self) -> bool:
        return self.sharding in ("zero2", "zero3", "zero2_hybrid", "zero3_hybrid")

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int, local_world_size: int) -> ParallelDims:
        tp, pp = p.tp, p.pp
        if world_size % (tp * pp):
            raise ConfigError(f"parallel.tp x parallel.pp = {tp}x{pp} does not divide the world size {world_size}")
        dp = world_size // (tp * pp)
        if p.dp is not None and p.dp != dp:
            raise ConfigError(f"parallel.dp {p.dp} x tp {tp} x pp {pp} = {p.dp * tp * pp} but the world size is "
                              f"{world_size}; fix the degrees or leave parallel.dp unset")
        sharding = "ddp" if p.sharding == "zero0" else p.sharding
        if sharding in ("ddp",):
            replicate, shard = dp, 1
        elif sharding in ("zero2", "zero3"):
            replicate, shard = 1, dp
        else:
            # Hybrid: shard within a node, replicate across nodes (default shard = DP ranks per node).
            shard = p.dp_shard or max(1, min(dp, local_world_size // (tp * pp)))
            if shard < 1 or dp % shard:
                raise ConfigError(f"parallel.dp_shard {shard} does not divide dp {dp} for {sharding}")
            replicate = dp // shard
        if p.dp_shard is not None and not sharding.endswith("_hybrid") and p.dp_shard != shard:
            raise ConfigError(f"parallel.dp_shard {p.dp_shard} only applies to *_hybrid sharding (got {sharding})")
        return cls(world_size, pp, replicate, shard, tp, sharding)

    def build_mesh(self, device_type: str) -> Any:
        """One DeviceMesh over all ranks, plus a flattened "dp" dim. Needs the process group."""
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                     mesh_dim_names=DIM_NAMES)
        self.flat = {"dp": self.mesh["dp_replicate", "dp_shard"]._flatten("dp"),
                     "stage": self.mesh["dp_replicate", "dp_shard", "tp"]._flatten("stage")}
        return self.mesh

    def _sub(self, name: str) -> Any:
        return self.flat[name] if name in self.flat else self.mesh[name]

    # --- sub-meshes and coordinates (single-process runs have no mesh: everything is rank 0 of 1)
    @property
    def dp_mesh(self) -> Any:
        return None if self.mesh is None else self._sub("dp")

    @property
    def fsdp_mesh(self) -> Any:
        """DDP: the flat dp mesh; ZeRO: the shard dim; hybrid: 2-D (replicate, shard) for HSDP."""
        if self.mesh is None:
            return None
        if self.hybrid:
            return self.mesh["dp_replicate", "dp_shard"]
        return self._sub("dp")

    def coord(self, name: str) -> int:
        if self.mesh is None:
            return 0
        return self._sub(name).get_local_rank()

    @property
    def stage_group(self) -> Any:
        """The process group of this rank's pipeline stage (all its dp and tp ranks)."""
        return None if self.mesh is None else self._sub("stage").get_group()

    @property
    def builds_weights(self) -> bool:
        """The one rank of its stage that builds the seeded model on the CPU (materialize.py)."""
        return all(self.coord(n) == 0 for n in DIM_NAMES if n != "pp")

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    def describe(self) -> str:
        return (f"world {self.world_size} = pp {self.pp} x dp {self.dp} (replicate {self.dp_replicate} x "
                f"shard {self.dp_shard}) x tp {self.tp}; sharding {self.sharding}")
