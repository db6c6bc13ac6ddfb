"""What a forward keeps for the backward, in bytes: the quantity the policies trade against FLOPs.

`SavedActivationMeter` counts the tensors autograd saves (through `torch.autograd.graph.saved_tensors_hooks`)
plus the op outputs a selective-checkpoint policy caches (those bypass the hooks: the policy keeps them in
its own storage). Storages are counted once however many views of them are saved (q, k and v slices of
one fused projection, a weight and its transpose), and the model's own parameters and buffers are left
out: what remains is activation memory. Inside a checkpointed region torch's own hooks take over, so only
what the region really keeps (its inputs) reaches the meter.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from trainer.plugins.activation_checkpointing.recompute import SelectiveCheckpointing


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


class SavedActivationMeter:
    """Distinct bytes of activations saved for the backward while the meter is entered.

    ``with meter: loss = model(x)`` counts what that forward leaves for ``loss.backward()``.
    """

    @classmethod
    def applying(cls, policy: Any, model: nn.Module) -> SavedActivationMeter:
        """A meter for `model` that watches `policy`, which is then applied to the model (watching must
        come first: the policy captures its decision function when it wraps the blocks)."""
        meter = cls([model])
        meter.watch(policy)
        policy.apply(model)
        return meter

    def __init__(self, models: Iterable[nn.Module]) -> None:
        self._models = list(models)
        self._model_storages: set[tuple[str, int]] = set()
        self._storages: dict[tuple[str, int], int] = {}
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def add(self, value: Any) -> None:
        """Count the tensors in `value` (a tensor or a nested container of them)."""
        for tensor in tree_leaves(value):
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                key = _storage_key(tensor)
                if key not in self._model_storages:
                    self._storages[key] = tensor.untyped_storage().nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def watch(self, policy: Any) -> None:
        """Also count what a selective-checkpoint policy caches (call before the policy wraps blocks)."""
        if not isinstance(policy, SelectiveCheckpointing):
            return
        decide = policy.policy

        def observed(ctx: SelectiveCheckpointContext, op: torch._ops.OpOverload, *args: Any,
                     **kwargs: Any) -> CheckpointPolicy:
            decision = decide(ctx, op, *args, **kwargs)
            if not ctx.is_recompute and decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
                self.add(ctx.op_output)
            return decision

        policy.policy = observed  # type: ignore[method-assign]

    def __enter__(self) -> SavedActivationMeter:
        # Taken now rather than at construction: the weights may have been materialized since.
        self._model_storages = {_storage_key(t) for model in self._models
                                for t in (*model.parameters(), *model.buffers()) if t.numel()}
        self._storages.clear()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
