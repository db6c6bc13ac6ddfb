"""The process topology: the only code that knows how the world splits into parallel dimensions.

The world is a grid pp x dp_replicate x dp_shard x cp x tp (outermost to innermost, so that
tensor-parallel peers, which talk the most, are neighbouring ranks on one node, with the context-parallel
ring next). Data parallelism is dp_replicate x dp_shard: DDP and ZeRO-1 replicate, ZeRO-2/3 and FSDP shard,
hybrid sharding does both. Context-parallel ranks read the same samples (each its part of every sequence)
but hold different tokens, so for the weights they are data-parallel ranks too: gradients are averaged
over dp x cp (`dp_cp_mesh`) and sharded strategies shard over dp_shard x cp (`fsdp_mesh`), as in
torchtitan, so cp ranks do not each hold a full copy.

Expert parallelism (`ep`) adds no ranks: it borrows them from the data-parallel ones, as torchtitan does.
The dp x cp ranks of one (pp, tp) coordinate, in mesh order, are cut into groups of `ep` consecutive
ranks; each group splits the experts of every MoE layer (n_experts / ep each) and exchanges tokens by
all-to-all, and the `dp x cp / ep` groups ("edp", the ranks left) hold the same experts, so expert weights
are replicated or sharded over edp while every other weight is over dp x cp. Both live on a second mesh
pp x edp x ep x tp (`expert_mesh`), whose ranks are the world mesh's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened dimensions: name -> the mesh dimensions it joins (those of size > 1 among them).
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             "dp_shard_cp": ("dp_shard", "cp")}


@dataclass
class ParallelDims:
    """Sizes of the five parallel dimensions; their product must be the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    ep: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flattened: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in MESH_ORDER:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate x dp_shard x cp x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.cp} x "
                f"{self.tp} x {self.pp} = {product} does not equal the world size {self.world_size}"
            )
        if self.ep < 1 or (self.dp * self.cp) % self.ep != 0:
            raise ValueError(f"ep={self.ep} must divide the data-parallel x context-parallel size "
                             f"{self.dp} x {self.cp} = {self.dp * self.cp} (experts borrow those ranks)")

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

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts under expert parallelism: dp x cp / ep."""
        return self.dp * self.cp // self.ep

    @property
    def dp_cp_enabled(self) -> bool:
        """Whether gradients are averaged over several ranks (data or context parallel)."""
        return self.dp * self.cp > 1

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with one named dimension per parallelism in use.

        Dimensions used together are also flattened (`_flatten` is private but the documented way;
        torchtitan does the same): `dp` (dp_replicate x dp_shard: data loading), `dp_cp` (dp x cp: gradient
        and loss averaging) and `dp_shard_cp` (the sharding group of FSDP/ZeRO); the original dimensions
        stay addressable (hybrid sharding, the cp ring).
        """
        used = [(name, size) for name, size in self.sizes().items() if size > 1]
        if not used:  # one process, or every dimension of size 1
            used = [("dp_replicate", 1)] if self.world_size == 1 else []
        names = tuple(name for name, _ in used)
        mesh = init_device_mesh(device_type, tuple(size for _, size in used), mesh_dim_names=names)
        # kept here, not sliced from the root later (torch deprecates slicing flattened dimensions)
        self._flattened = {flat: mesh[present]._flatten(flat) for flat, members in FLATTENED.items()
                           if len(present := tuple(name for name in members if name in names)) > 1}
        self._mesh = mesh
        if self.ep > 1:  # the same ranks, seen as pp x edp x ep x tp (see the module docstring)
            self._expert_mesh = init_device_mesh(device_type, (self.pp, self.edp, self.ep, self.tp),
                                                 mesh_dim_names=("pp", "edp", "ep", "tp"))
        return mesh

    def ep_mesh(self) -> DeviceMesh | None:
        """The expert-parallel group of this rank (None with ep=1)."""
        return None if self._expert_mesh is None else self._expert_mesh["ep"]

    def edp_mesh(self) -> DeviceMesh | None:
        """The ranks holding the same experts as this one (size dp x cp / ep; None with ep=1)."""
        return None if self._expert_mesh is None else self._expert_mesh["edp"]

    def named_groups(self) -> list[tuple[str, DeviceMesh]]:
        """Every 1-D mesh this rank communicates over, by the dimension it serves: the mesh dimensions, the
        flattened ones (dp, dp_cp, dp_shard_cp) and under expert parallelism ep and edp (what the hang
        diagnosis and `mode=check` name)."""
        groups = [(name, self.mesh[name]) for name in self.mesh.mesh_dim_names or ()]
        groups += list(self._flattened.items())
        if self._expert_mesh is not None:
            groups += [("ep", self._expert_mesh["ep"]), ("edp", self._expert_mesh["edp"])]
        return groups

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("build_mesh() has not been called")
        return self._mesh

    def _joined(self, flat: str) -> DeviceMesh | None:
        """The mesh of the dimensions `FLATTENED[flat]` joins: the flattened one, the single one in use,
        or None when none is in use."""
        used = [name for name in FLATTENED[flat] if getattr(self, name) > 1]
        if not used:
            return None
        return self.mesh[used[0]] if len(used) == 1 else self._flattened[flat]

    def dp_mesh(self) -> DeviceMesh | None:
        """The (flattened) data-parallel sub-mesh: ranks that read different samples. None without data
        parallelism.

        A world of one process has its size-1 dimension as the data-parallel mesh: a data-parallel
        strategy run on one device (a config meant for N) then wraps the model over a group of one,
        the code path of N ranks, instead of finding no group.
        """
        if self.world_size == 1:
            return self.mesh[self.mesh.mesh_dim_names[0]]  # type: ignore[index]
        return self._joined("dp")

    def dp_cp_mesh(self) -> DeviceMesh | None:
        """The ranks over which gradients and losses are averaged: data parallel x context parallel (each
        cp rank's loss is the mean over its own tokens, all of equal count). None when both are 1."""
        if self.world_size == 1:
            return self.dp_mesh()
        return self._joined("dp_cp")

    def cp_mesh(self) -> DeviceMesh | None:
        """The context-parallel ring (None with cp=1)."""
        return self.mesh["cp"] if self.cp_enabled else None

    def fsdp_mesh(self) -> DeviceMesh | None:
        """Mesh for fully_shard: 1-D (dp_shard x cp) or 2-D (dp_replicate, dp_shard x cp) for hybrid
        sharding; None when there is nothing to shard over."""
        if self.world_size == 1:  # sharded over one rank, as dp_mesh explains
            return self.dp_mesh()
        shard = self._joined("dp_shard_cp")
        if shard is None:
            return None
        if self.dp_replicate > 1:
            shard_name = "dp_shard_cp" if self.fsdp_enabled and self.cp_enabled else ("dp_shard" if self.fsdp_enabled else "cp")
            with warnings.catch_warnings():  # no other way to pair a flattened dimension with another yet
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                return self.mesh["dp_replicate", shard_name]
        return shard


def shard_rows(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of `tensor` under DTensor's Shard(0) layout (ceil-sized chunks), as a view."""
    rows = tensor.shape[0]
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return tensor[start:min(start + chunk, rows)]
