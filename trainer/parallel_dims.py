"""The process topology: the only code that knows how the world splits into parallel dimensions.

The world is a grid pp x dp_replicate x dp_shard x tp (outermost to innermost, so that tensor-parallel
peers, which talk the most, are neighbouring ranks on one node). Data parallelism is dp_replicate x
dp_shard: DDP and ZeRO-1 replicate, ZeRO-2/3 and FSDP shard, hybrid sharding does both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    """Sizes of the four parallel dimensions; their product must be the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.tp} x "
                f"{self.pp} = {product} does not equal the world size {self.world_size}"
            )

    @property
    def dp(self) -> int:
        """Ranks that read distinct data."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with one named dimension per parallelism in use.

        Data-parallel dimensions are also flattened into `dp` (data loading, loss averaging); when
        both are in use `dp_replicate` and `dp_shard` stay addressable for hybrid sharding.
        """
        used = [(name, size) for name, size in self.sizes().items() if size > 1]
        if not used:  # one process, or every dimension of size 1
            used = [("dp_replicate", 1)] if self.world_size == 1 else []
        names = tuple(name for name, _ in used)
        mesh = init_device_mesh(device_type, tuple(size for _, size in used), mesh_dim_names=names)
        dp_names = tuple(name for name in ("dp_replicate", "dp_shard") if name in names)
        if len(dp_names) == 2 or (dp_names and len(names) > 1):
            mesh[dp_names]._flatten("dp")  # private but the documented way (torchtitan does the same)
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("build_mesh() has not been called")
        return self._mesh

    def dp_mesh(self) -> DeviceMesh | None:
        """The (flattened) data-parallel sub-mesh, or None without data parallelism.

        A world of one process has its size-1 dimension as the data-parallel mesh: a data-parallel
        strategy run on one device (a config meant for N) then wraps the model over a group of one,
        the code path of N ranks, instead of finding no group.
        """
        names = self.mesh.mesh_dim_names or ()
        if "dp" in _flattened_names(self.mesh):
            return self.mesh["dp"]
        for name in ("dp_replicate", "dp_shard"):
            if name in names and (getattr(self, name) > 1 or self.world_size == 1):
                return self.mesh[name]
        return None

    def fsdp_mesh(self) -> DeviceMesh | None:
        """Mesh for fully_shard: 1-D (dp_shard) or 2-D (dp_replicate, dp_shard) for hybrid sharding."""
        if self.world_size == 1:  # sharded over one rank, as dp_mesh explains
            return self.dp_mesh()
        if not self.fsdp_enabled:
            return None
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]


def _flattened_names(mesh: DeviceMesh) -> set[str]:
    try:
        mesh["dp"]
    except (KeyError, RuntimeError, ValueError):
        return set()
    return {"dp"}


def shard_rows(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of `tensor` under DTensor's Shard(0) layout (ceil-sized chunks), as a view."""
    rows = tensor.shape[0]
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return tensor[start:min(start + chunk, rows)]
