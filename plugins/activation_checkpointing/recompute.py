"""Policies that recompute activations in the backward instead of keeping them.

All of them use torch's non-reentrant `torch.utils.checkpoint` (through `checkpoint_wrapper`, whose
`named_parameters` and `state_dict` drop the wrapper's prefix, so parameter names, optimizer groups and
checkpoints are the same as without it). The RNG state is saved with each checkpointed region and
restored for the recomputation, so dropout draws the same masks twice and the gradients equal those of
`none`.

- `full`: every block keeps only its input; its whole forward runs again in the backward
  (about one extra forward of the blocks).
- `every_n`: the same for every n-th block only (a memory/compute dial between `none` and `full`).
- `selective`: op-level, with torch's selective-checkpoint contexts: matmul and fused-attention outputs
  are kept, everything else (norms, activations, RoPE, residual adds, copies) is recomputed; no matmul
  runs twice.
- `attention`: only the attention core (softmax(QK^T)V and its dropout, the blocks' `core_attention`
  submodule) is recomputed, as in Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", selective recomputation): the activations that grow with the square of the
  sequence length, for a few percent extra FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing

CORE_ATTENTION = "core_attention"


def _existing_ops(names: list[tuple[Any, str]]) -> list[torch._ops.OpOverload]:
    """The `.default` overloads of those ops this torch build has (fused kernels vary by build)."""
    found = []
    for namespace, name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            found.append(packet.default)
    return found


# What `selective` keeps: matmuls (recomputing them would cost a forward's FLOPs; an MoE's grouped matmuls
# too, whose recompute would run the experts' forward again), fused attention
# (quadratic in the sequence length) and tensor-parallel reduce-scatters (a recompute would communicate
# again, as torchtitan's op-level policy also avoids). Everything else is cheap to recompute.
SELECTIVE_SAVE_OPS: list[torch._ops.OpOverload] = _existing_ops([
    (torch.ops.aten, "mm"),
    (torch.ops.aten, "addmm"),
    (torch.ops.aten, "bmm"),
    (torch.ops.aten, "baddbmm"),
    (torch.ops.aten, "_scaled_mm"),
    (torch.ops.aten, "_grouped_mm"),
    (torch.ops.aten, "_scaled_dot_product_flash_attention"),
    (torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
    (torch.ops.aten, "_scaled_dot_product_efficient_attention"),
    (torch.ops.aten, "_scaled_dot_product_cudnn_attention"),
    (torch.ops._c10d_functional, "reduce_scatter_tensor"),
])


def checkpointed(module: nn.Module, context_fn: Optional[Callable[[], Any]] = None) -> nn.Module:
    """`module` whose forward keeps only its inputs (and what `context_fn`'s policy saves) for the
    backward and runs again there."""
    options: dict[str, Any] = {"preserve_rng_state": True}
    if context_fn is not None:
        options["context_fn"] = context_fn
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)


class FullCheckpointing(ActivationCheckpointing):
    """Recompute every block: the least activation memory, about one extra forward of the blocks."""

    name = "full"

    def wrap_block(self, block: nn.Module, layer_index: int, num_layers: int) -> nn.Module:
        del layer_index, num_layers
        return checkpointed(block)


class EveryNthCheckpointing(ActivationCheckpointing):
    """Recompute every n-th block (layers n-1, 2n-1, ...): a fraction 1/n of `full`'s savings and cost."""

    name = "every_n"

    def __init__(self, n: int = 2) -> None:
        if n < 1:
            raise ValueError(f"every_n needs n >= 1 (n=1 checkpoints every block, as `full`), got n={n}")
        self.n = n

    @property
    def checkpoint_every_n(self) -> int:
        return self.n

    def check_model(self, num_layers: int) -> None:
        if self.n > num_layers:
            raise ValueError(f"every_n with n={self.n} checkpoints no block of a {num_layers}-layer model: "
                             f"use n <= {num_layers} (or activation_checkpointing=none)")

    def wrap_block(self, block: nn.Module, layer_index: int, num_layers: int) -> nn.Module:
        del num_layers
        return checkpointed(block) if (layer_index + 1) % self.n == 0 else block


class SelectiveCheckpointing(ActivationCheckpointing):
    """Op-level recomputation in every block: keep matmul and attention outputs, recompute the rest."""

    name = "selective"

    def __init__(self, save_ops: Sequence[torch._ops.OpOverload] = tuple(SELECTIVE_SAVE_OPS)) -> None:
        self.save_ops = frozenset(save_ops)

    def policy(self, ctx: SelectiveCheckpointContext, op: torch._ops.OpOverload, *args: Any,
               **kwargs: Any) -> CheckpointPolicy:
        """Per op of the forward: MUST_SAVE keeps its output for the backward, PREFER_RECOMPUTE runs it
        again there."""
        del ctx, args, kwargs
        return CheckpointPolicy.MUST_SAVE if op in self.save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    def check_strategy(self, strategy: Any, ep: int = 1) -> None:
        # Experts wrapped as FSDP2 units of their own (zero3/fsdp and 3d under ep > 1) run their unit's hooks
        # inside the checkpointed block: the recompute gathers their weights again, ops the forward did not
        # record, and torch's selective-checkpoint cache refuses the replay (measured on 4 gloo processes,
        # tiny_moe with 4 experts: zero3 ep=4 and 3d pp=2 ep=2 fail in the first backward with
        # "profiler._record_function_enter_new ... not found in storage"; ddp and zero2 with ep=4 train).
        if ep > 1 and strategy.wraps_experts_apart:
            raise ValueError(f"activation_checkpointing=selective cannot run with ep={ep} under "
                             f"strategy={strategy.name}: the experts' own FSDP2 unit gathers their weights "
                             "inside each checkpointed block, again in its recompute, which torch's selective "
                             "checkpointing refuses; pick activation_checkpointing=full, every_n or attention, "
                             "or strategy=ddp / zero1 / zero2 with ep")
        # The zero-bubble schedules (zero_bubble, zbv, dualpipev) run each stage's backward twice (input
        # gradients, then weight gradients, two autograd passes over one forward); torch's selective-checkpoint
        # cache serves one backward only.
        schedule = strategy.pipeline_schedule
        if schedule in ("zero_bubble", "zbv", "dualpipev"):
            raise ValueError(f"activation_checkpointing=selective cannot run under strategy.schedule={schedule} "
                             "(its split backward passes twice over each checkpointed region, which torch's "
                             "selective checkpointing does not support): pick activation_checkpointing=full, "
                             "every_n or attention, or another schedule")

    def wrap_block(self, block: nn.Module, layer_index: int, num_layers: int) -> nn.Module:
        del layer_index, num_layers

        # Called per checkpointed forward: a fresh cache holds the outputs saved in that forward. A plain
        # function, not a bound method: torch.compile accepts only functions (or partials) as context_fn.
        def contexts() -> tuple[Any, Any]:
            return create_selective_checkpoint_contexts(self.policy)

        return checkpointed(block, context_fn=contexts)


class AttentionCheckpointing(ActivationCheckpointing):
    """Recompute only each block's attention core (Korthikanti et al. 2022's selective recomputation)."""

    name = "attention"

    def wrap_block(self, block: nn.Module, layer_index: int, num_layers: int) -> nn.Module:
        del num_layers
        owners = [module for module in block.modules()
                  if isinstance(getattr(module, CORE_ATTENTION, None), nn.Module)]
        if not owners:
            raise ValueError(f"activation_checkpointing=attention recomputes the attention core, but block "
                             f"{layer_index} ({type(block).__name__}) has no `{CORE_ATTENTION}` submodule: give "
                             f"the model's attention one (softmax(QK^T)V without weights), as Llama and GPT do")
        for owner in owners:
            setattr(owner, CORE_ATTENTION, checkpointed(getattr(owner, CORE_ATTENTION)))
        return block


@dataclass
class FullCheckpointingConfig:
    """Schema of `activation_checkpointing=full`."""

    _target_: str = "trainer.plugins.activation_checkpointing.FullCheckpointing"


@dataclass
class EveryNthCheckpointingConfig:
    """Schema of `activation_checkpointing=every_n`."""

    _target_: str = "trainer.plugins.activation_checkpointing.EveryNthCheckpointing"
    # Checkpoint every n-th block, counted over the whole model (layers n-1, 2n-1, ...); n=1 is `full`.
    n: int = 2


@dataclass
class SelectiveCheckpointingConfig:
    """Schema of `activation_checkpointing=selective`."""

    _target_: str = "trainer.plugins.activation_checkpointing.SelectiveCheckpointing"


@dataclass
class AttentionCheckpointingConfig:
    """Schema of `activation_checkpointing=attention`."""

    _target_: str = "trainer.plugins.activation_checkpointing.AttentionCheckpointing"
