"""Weights both ends of the pipeline hold: an output head tied to the input embedding (GPT), and an
embedding the last stage reads too (DeepSeek-V3's multi-token prediction), when the pipeline puts the two
ends on different stages.

The family names them (`ModelFamily.shared_end_weights`): the first stage holds one copy (the embedding),
the last another (the tied head, or its own embedding table). They start equal (a broadcast from the first
stage), their gradients are summed after every step (each then holds the shared parameter's gradient: the
sum of what the two ends' uses contribute) and they sit in the same optimizer group, so they receive
identical updates and stay bitwise equal. The gradient norm counts the last stage's copy once
(`is_mirror`).

When one rank holds both ends (the V placement of ZBV and DualPipeV puts stage 0 and the last stage on pp
rank 0) the tie is local: the two stage parts still hold separate copies (each part is wrapped on its own,
and its state dict keeps the unsplit model's names), the copy, the gradient sum and the optimizer grouping
are the same, without a process group.
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
    """This rank's copies of the weights both pipeline ends hold and the group of the ranks holding them."""

    def __init__(self) -> None:
        # The group joins this rank's first- and last-stage ranks (None when one rank holds both, `local`);
        # `params` are this rank's first-stage copies and `mirrors` its last-stage copies, in the family's
        # order, the same on both ends.
        self.group: dist.ProcessGroup | None = None
        self.local = False
        self.params: list[torch.Tensor] = []
        self.mirrors: list[torch.Tensor] = []

    @property
    def active(self) -> bool:
        return self.group is not None or self.local

    def make_group(self, model: nn.Module, mesh: DeviceMesh, pp_size: int, last_stage_pp_rank: int) -> None:
        """A process group per pipeline line joining the first- and last-stage ranks, when both ends of the
        (unsplit) model hold a shared weight (new_group is collective: every rank creates every pair); none
        when the last stage is on the first stage's rank (a local tie)."""
        family = family_of(model)
        first, last = family.shared_end_weights(model, last=False), family.shared_end_weights(model, last=True)
        if not first or [id(w) for w in first] != [id(w) for w in last]:
            return
        if last_stage_pp_rank == 0:
            self.local = True
            return
        names = list(mesh.mesh_dim_names or ())
        lines = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp_size)
        for line in lines.tolist():
            group = dist.new_group([line[0], line[last_stage_pp_rank]])
            if dist.get_rank() in (line[0], line[last_stage_pp_rank]):
                self.group = group

    def find(self, parts: Sequence[nn.Module], unwrap: Callable[[nn.Module], nn.Module], num_stages: int) -> None:
        """Pick this rank's copies among its (wrapped) stage parts: the first stage's, the last stage's, or
        (a local tie) both."""
        if not self.active:
            return
        for part in parts:
            module = unwrap(part)
            stage = getattr(module, "pp_stage_index", None)
            if stage == 0:
                self.params = family_of(module).shared_end_weights(module, last=False)
            elif stage == num_stages - 1:
                self.mirrors = family_of(module).shared_end_weights(module, last=True)

    def broadcast_from_first_stage(self) -> None:
        """Identical copies to start with (they differ after a sharded init, which draws each stage's copy
        from its own seed): the first stage's wins."""
        with torch.no_grad():
            if self.local:
                for param, mirror in zip(self.params, self.mirrors, strict=True):
                    local_tensor(mirror.data).copy_(local_tensor(param.data))
                return
            for param in self.params or self.mirrors:
                dist.broadcast(local_tensor(param.data), group=self.group, group_src=0)

    def sum_grads(self) -> None:
        """Sum the two ends' gradients: both copies get the shared parameter's gradient."""
        if self.local:
            with torch.no_grad():
                for param, mirror in zip(self.params, self.mirrors, strict=True):
                    if param.grad is None or mirror.grad is None:
                        # an end that took no part in the loss: the other end's gradient is the whole
                        grad = param.grad if mirror.grad is None else mirror.grad
                        if grad is not None:
                            param.grad, mirror.grad = grad, grad.clone()
                        continue
                    total = local_tensor(param.grad) + local_tensor(mirror.grad)
                    local_tensor(param.grad).copy_(total)
                    local_tensor(mirror.grad).copy_(total)
            return
        for param in self.params or self.mirrors:
            if param.grad is not None:
                dist.all_reduce(local_tensor(param.grad), op=dist.ReduceOp.SUM, group=self.group)

    def is_mirror(self, param: torch.Tensor) -> bool:
        """Whether `param` is the last stage's copy, whose gradient duplicates the first stage's."""
        return any(param is p for p in self.mirrors)

    def optimizer_modules(self, model_parts: Sequence[nn.Module]) -> list[nn.Module]:
        """The modules whose parameters the optimizer groups are made from."""
        if not self.mirrors:
            return list(model_parts)
        # A tied head's copy is owned by a Linear here, which would put it in the weight-decay group; on the
        # first stage it is the embedding table (no decay). An extra owner of embedding type keeps both
        # copies in the same group, so they receive identical updates (the shared weights are embedding
        # tables: a tied head, an embedding copy, already in that group).
        owners = []
        for param in self.mirrors:
            owner = nn.Embedding(1, 1, device="meta")
            owner.weight = param  # type: ignore[assignment]
            owners.append(owner)
        return [*model_parts, *owners]

    def release(self) -> None:
        self.params, self.mirrors = [], []
