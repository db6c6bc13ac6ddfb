"""Memory preflight: will this run fit on this machine? Asked before any weight is materialized.

The planner's analytic estimate (trainer/planner/estimate.py) of the most loaded rank's device memory and
host memory is compared with what this machine has free now: on a CUDA run the free memory of this
process's GPU (`torch.cuda.mem_get_info`) per rank and the available host memory (`MemAvailable`) for the
node's ranks together; on a CPU run, where a rank's "device" memory is host memory, device and host bytes of
all the node's ranks against the available host memory. When it does not fit, `memory_preflight` returns
one line with needed vs available (GB = 1e9 bytes) and the planner's suggestions for this machine; the CLI
prints it and exits with status 3 (the code `mode=plan` uses for "does not fit"). `trainer.preflight=false`
skips the check (an estimate can be wrong: a run that knows better is not stopped by it).

No headroom is applied here, unlike `mode=plan`: the preflight only stops what cannot fit by the
estimate, not what is merely tight.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
from omegaconf import DictConfig

from trainer.planner.accumulation import this_machine
from trainer.planner.core import hardware_from_config
from trainer.planner.estimate import PlanOptions, evaluate
from trainer.planner.hardware import meminfo_bytes
from trainer.planner.layout import layout_from_config, model_config
from trainer.planner.memory import GB
from trainer.planner.params import inventory

__all__ = ["MachineMemory", "available_memory", "memory_preflight"]


@dataclasses.dataclass(frozen=True)
class MachineMemory:
    """What this machine offers a run now: free host memory and, on CUDA, free memory of one GPU (bytes)."""

    device_type: str
    host_available: float
    device_available: Optional[float] = None


def _nvml_free_bytes(index: int) -> Optional[float]:
    """Free memory of GPU `index` through NVML (no CUDA context is created), None without pynvml."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


def available_memory(device_type: str, launching: bool = False) -> MachineMemory:
    """Free host memory and, for CUDA, the free memory of this process's GPU (LOCAL_RANK's).

    `launching`: this process only starts the workers. It must not create a CUDA context on their GPU
    (it would hold hundreds of MB there for the whole run), so without NVML it takes the GPU's total
    memory, which needs no context, instead of the free memory (`cuda.mem_get_info` creates one).
    """
    device_available = None
    if device_type == "cuda":
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0"))
        device_available = _nvml_free_bytes(index)
        if device_available is None:
            if launching and not torch.cuda.is_initialized():
                device_available = float(torch.cuda.get_device_properties(index).total_memory)
            else:
                device_available = float(torch.cuda.mem_get_info(index)[0])
    return MachineMemory(device_type, meminfo_bytes("MemAvailable"), device_available)


def _device_type(cfg: DictConfig) -> str:
    import torch

    accelerator = str(cfg.trainer.accelerator)
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def _suggestions(cfg: DictConfig, machine: MachineMemory, local_ranks: int) -> list[str]:
    """The planner's best layouts of the same world size for this machine's free memory (at most two)."""
    from trainer.planner.search import search_configurations

    device_bytes = (machine.device_available or 0.0) if machine.device_type == "cuda" else None
    hardware = this_machine(hardware_from_config(cfg), torch.device(machine.device_type), local_ranks,
                            host_bytes=machine.host_available,
                            device_bytes=device_bytes)
    options = dataclasses.replace(PlanOptions.of(cfg), headroom=0.0, rank=None)
    try:
        found = search_configurations(cfg, inventory(model_config(cfg)), layout_from_config(cfg), hardware, options,
                                      top=2)
    except Exception:  # noqa: BLE001 - suggestions are a courtesy; the verdict stands without them
        return []
    return [" ".join(s.changes) for s in found]


def memory_preflight(cfg: DictConfig, machine: Optional[MachineMemory] = None,
                     launching: bool = False) -> Optional[str]:
    """None when the planner's estimate fits in `machine` (this machine's free memory by default), else
    one line: what is needed vs what is available, and what the planner suggests instead. `launching`:
    this process only starts the workers (see `available_memory`)."""
    device_type = _device_type(cfg)
    machine = machine or available_memory(device_type, launching)
    local_ranks = int(cfg.trainer.devices)
    layout = layout_from_config(cfg)
    options = dataclasses.replace(PlanOptions.of(cfg), headroom=0.0, rank=None)
    estimates = evaluate(inventory(model_config(cfg)), layout, hardware_from_config(cfg), options)
    device_per_rank = max(e.device["total"] for e in estimates)
    host_per_rank = max(e.host for e in estimates)
    short = []
    if machine.device_type == "cuda":
        if machine.device_available is not None and device_per_rank > machine.device_available:
            short.append(f"device memory per rank needs {device_per_rank / GB:.1f} GB, "
                         f"{machine.device_available / GB:.1f} GB free on this GPU")
        host_needed = host_per_rank * local_ranks
    else:  # a CPU rank's device memory is host memory, shared by the node's ranks
        host_needed = (device_per_rank + host_per_rank) * local_ranks
    if host_needed > machine.host_available:
        ranks = f" for {local_ranks} ranks" if local_ranks > 1 else ""
        short.append(f"host memory needs {host_needed / GB:.1f} GB{ranks}, {machine.host_available / GB:.1f} GB "
                     "available")
    if not short:
        return None
    suggestions = _suggestions(cfg, machine, local_ranks)
    advice = (f"the planner suggests: {' | '.join(suggestions)}" if suggestions else
              "the planner finds no layout of this world size that fits (a smaller model or more devices)")
    return (f"does not fit in memory: {'; '.join(short)} (planner estimate for model={cfg.model.name}); {advice}; "
            "trainer.preflight=false skips this check")
