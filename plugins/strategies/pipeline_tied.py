"""An output head tied to the input embedding (GPT) when the pipeline puts them on different stages.

The first stage holds the embedding, the last the head: two copies of one parameter. They start equal
(a broadcast from the first stage), their gradients are summed after every step (each then holds the
tied parameter's gradient) and they sit in the same optimizer group, so they receive identical updates
and stay bitwise equal. The gradient norm counts the head's copy once (`is_mirror`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainer.models import family_of


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (shares storage, so in-place ops write through), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TiedWeights:
    """This rank's copy of a tied embedding/head parameter and the group of the ranks holding the copies."""

    def __init__(self) -> None:
        # The group joins this rank's first- and last-stage ranks; the parameter is this rank's copy
        # (the head's copy on the last stage is the "mirror").
        self.group: dist.ProcessGroup | None = None
        self.param: nn.Parameter | None = None
        self._mirror = False

    def make_group(self, model: nn.Module, mesh: DeviceMesh, pp_size: int, last_stage_pp_rank: int) -> None:
        """A process group per pipeline line joining the first- and last-stage ranks, when the (unsplit)
        model ties its output head to its input embedding (new_group is collective: every rank creates
        every pair)."""
        embedding, head = family_of(model).tied_weights(model)
        if embedding is None or head is not embedding:
            return
        names = list(mesh.mesh_dim_names or ())
        lines = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp_size)
        for line in lines.tolist():
            group = dist.new_group([line[0], line[last_stage_pp_rank]])
            if dist.get_rank() in (line[0], line[last_stage_pp_rank]):
                self.group = group

    def find(self, parts: Sequence[nn.Module], unwrap: Callable[[nn.Module], nn.Module], num_stages: int) -> None:
        """Pick this rank's copy among its (wrapped) stage parts: the embedding on stage 0, the head on
        the last stage."""
        if self.group is None:
            return
        for part in parts:
            module = unwrap(part)
            stage = getattr(module, "pp_stage_index", None)
            embedding, head = family_of(module).tied_weights(module)
            if stage == 0:
                self.param = embedding  # type: ignore[assignment]
            elif stage == num_stages - 1:
                self.param, self._mirror = head, True  # type: ignore[assignment]

    def broadcast_from_first_stage(self) -> None:
        """Identical copies to start with (they differ only after a sharded init, which draws the head
        separately): the first stage's embedding wins."""
        if self.param is not None:
            with torch.no_grad():
                dist.broadcast(local_tensor(self.param.data), group=self.group, group_src=0)

    def sum_grads(self) -> None:
        """Sum the embedding's and the head's gradients: both copies get the tied parameter's gradient."""
        if self.param is None or self.param.grad is None:
            return
        dist.all_reduce(local_tensor(self.param.grad), op=dist.ReduceOp.SUM, group=self.group)

    def is_mirror(self, param: torch.Tensor) -> bool:
        """Whether `param` is the head's copy, whose gradient duplicates the embedding's."""
        return self._mirror and param is self.param

    def optimizer_modules(self, model_parts: Sequence[nn.Module]) -> list[nn.Module]:
        """The modules whose parameters the optimizer groups are made from."""
        if self._mirror and self.param is not None:
            # The head copy is owned by a Linear here, which would put it in the weight-decay group; in the
            # unsplit model it is the embedding table (no decay). An extra owner of embedding type keeps
            # both copies in the same group, so they receive identical updates.
            owner = nn.Embedding(1, 1, device="meta")
            owner.weight = self.param
            return [*model_parts, owner]
        return list(model_parts)

    def release(self) -> None:
        self.param = None
