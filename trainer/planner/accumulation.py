"""`grad_sync=auto`: under gradient accumulation, reduce once per optimizer step when memory allows it.

An FSDP2-sharded run (zero3, fsdp, the sharded flavours of 3d without a pipeline) that accumulates over
several micro-batches can either reduce-scatter every micro-batch's gradients, so a rank only ever holds
gradient shards (ZeRO-3's memory), or let the gradients accumulate unsharded and reduce-scatter them once
per step, keeping the gathered parameters between the micro-batches: one reduce-scatter and one all-gather
per block and step instead of per micro-batch (7% faster on 2 gloo ranks, docs/BENCHMARKS.md). The second
holds a whole gradient and the whole parameters on every rank during the step, which does not fit for the
models ZeRO-3 exists for (Llama-2-70B's fp32 gradient alone is 280 GB). `auto` asks the planner whether the
per-step layout fits the device (its total capacity less the planner's headroom: the same answer on every
rank of a homogeneous job, whatever else runs there now) and takes it when it does. A pipeline schedule
reduces once per step and keeps the parameters gathered whatever is asked, so `auto` reads `step` there.

A run settles it before it builds the strategy (`trainer.run.settle_grad_sync`: `choose_grad_sync` with the
run's precision and checkpointing plugins and this machine's memory, agreed by every rank, written into
the config the strategy is then built from); `mode=plan` resolves it for the hardware profile
(`resolve_grad_sync` in `trainer.planner.core.plan`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch
from omegaconf import DictConfig

from trainer.planner.estimate import PlanOptions, evaluate, fits, usable_bytes
from trainer.planner.hardware import HardwareConfig, meminfo_bytes
from trainer.planner.layout import Layout, layout_from_config, model_config
from trainer.planner.memory import GB
from trainer.planner.params import ModelInventory, inventory

if TYPE_CHECKING:
    from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
    from trainer.interfaces.precision import Precision

__all__ = ["AccumulationChoice", "choose_grad_sync", "resolve_grad_sync", "this_machine"]


@dataclasses.dataclass(frozen=True)
class AccumulationChoice:
    """What `grad_sync=auto` resolved to, and why (one clause for the run's log)."""

    grad_sync: str
    reshard_after_backward: bool
    reason: str
    # Set when the ranks' agreement overrode this rank's own answer (its memory would have allowed "step").
    note: str = ""

    def describe(self) -> str:
        """The run's log line after the strategy's label: `grad_sync=auto -> step: <reason>`."""
        return f"grad_sync=auto -> {self.grad_sync}{self.note}: {self.reason}"


def resolve_grad_sync(inv: ModelInventory, layout: Layout, hardware: HardwareConfig,
                      options: PlanOptions) -> tuple[Layout, str]:
    """`layout` with `grad_sync=auto` resolved for `hardware` (any other layout comes back unchanged), and
    the reason in a few words."""
    if layout.grad_sync != "auto":
        return layout, "set explicitly"
    per_step = dataclasses.replace(layout, grad_sync="step", reshard_after_backward=False)
    per_microbatch = dataclasses.replace(layout, grad_sync="microbatch", reshard_after_backward=True)
    if layout.pp > 1:
        return per_step, "the pipeline schedule reduces once per step"
    if layout.num_microbatches <= 1:
        return per_microbatch, "one micro-batch per step: nothing accumulates"
    estimates = evaluate(inv, per_step, hardware, options)
    need = max(e.device["total"] for e in estimates)
    usable = usable_bytes(hardware, options.headroom)
    ok, _ = fits(estimates, hardware, options)
    sizes = f"{need / GB:.2f} GB needed per rank, {usable / GB:.2f} GB usable"
    if ok:
        return per_step, f"whole gradients and parameters fit ({sizes})"
    return per_microbatch, f"whole gradients and parameters do not fit ({sizes})"


def this_machine(base: HardwareConfig, device: torch.device, local_ranks: int,
                 host_bytes: Optional[float] = None, device_bytes: Optional[float] = None) -> HardwareConfig:
    """The hardware profile `base` (the configuration's) with this machine's memory: a CUDA device's total
    memory, or on a CPU run the host memory shared by the node's `local_ranks` (a rank's "device" memory is
    host memory). Capacities, not what is free now: every rank of a homogeneous job computes the same
    figures (`host_bytes` / `device_bytes` replace them, as the preflight does with the free memory)."""
    host = meminfo_bytes("MemTotal") if host_bytes is None else host_bytes
    if device_bytes is not None:
        per_device = device_bytes
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        per_device = float(torch.cuda.get_device_properties(index).total_memory)
    else:
        per_device = host / max(local_ranks, 1)
    return dataclasses.replace(base, name="this machine", device_type=device.type, memory_gb=per_device / GB,
                               reserved_gb=0.0, devices_per_node=max(local_ranks, 1), host_memory_gb=host / GB)


def choose_grad_sync(cfg: DictConfig, hardware: HardwareConfig, precision: Optional[Precision] = None,
                     activation_checkpointing: Optional[ActivationCheckpointing] = None) -> Optional[AccumulationChoice]:
    """What a run of `cfg` does with `grad_sync=auto` on `hardware`; None when there is nothing to choose (the
    config sets grad_sync, or its strategy has no such choice: 3d's replicating flavours reduce once per step
    anyway). `precision` / `activation_checkpointing`: the run's plugins, handed over (built from `cfg` when
    left out, as `mode=plan` does). A function of the config and `hardware` only, so every rank of a
    homogeneous job finds the same answer."""
    layout = layout_from_config(cfg, precision=precision, activation_checkpointing=activation_checkpointing)
    if layout.grad_sync != "auto":
        return None
    resolved, reason = resolve_grad_sync(inventory(model_config(cfg)), layout, hardware, PlanOptions.of(cfg))
    return AccumulationChoice(resolved.grad_sync, resolved.reshard_after_backward, reason)
