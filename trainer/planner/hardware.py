"""The `hardware` config group: what one device and one node of a target machine offer.

Figures come from the vendors' data sheets (dense, without sparsity). Memory is counted in GB = 1e9 bytes
everywhere in the planner, as in the ZeRO paper; `memory_gb` is the capacity the driver reports (e.g.
81,559 MiB = 85.5 GB for an H100 80GB), `reserved_gb` what the CUDA context, NCCL and the caching
allocator's own needs take before any tensor exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class HardwareConfig:
    """Schema of `conf/hardware/*.yaml` (`hardware=NAME`), read by `mode=plan` only."""

    # Name shown in the plan.
    name: str = "cpu"
    # cuda or cpu: on cpu, offloading has nothing to move (memory is host memory already).
    device_type: str = "cpu"
    # Dense peak FLOP/s of one device per compute dtype (data sheet; for the CPU a measured matmul peak).
    # The defaults are conf/hardware/cpu.yaml's: one of 8 processes on the 2-core development VM, measured
    # by `mode=plan plan.calibrate=true`.
    peak_flops_bf16: float = 4.2e10
    peak_flops_fp16: float = 4.3e8
    peak_flops_fp32: float = 2.1e10
    # Memory of one device in GB (1e9 bytes), as the driver reports it.
    memory_gb: float = 3.0
    # Taken before any tensor exists: CUDA context, NCCL buffers, allocator bookkeeping.
    reserved_gb: float = 0.3
    # Memory bandwidth of one device in GB/s (an optimizer step is memory-bound).
    memory_bandwidth_gbps: float = 6.5
    # Devices per node (processes per node on the CPU).
    devices_per_node: int = 8
    # Bandwidth per device in GB/s, one direction: inside a node (NVLink/NVSwitch, PCIe) and across nodes
    # (each device's share of the network: InfiniBand/RoCE NICs).
    intra_node_bandwidth_gbps: float = 0.24
    inter_node_bandwidth_gbps: float = 1.25
    # Latency of one message hop in microseconds, inside and across nodes.
    intra_node_latency_us: float = 2250.0
    inter_node_latency_us: float = 100.0
    # Host (CPU) memory of one node in GB and the host-device link per device in GB/s (offload traffic).
    host_memory_gb: float = 24.0
    host_to_device_bandwidth_gbps: float = 10.0
    # Host memory bandwidth of one node in GB/s (an offloaded optimizer step is memory-bound on it).
    host_memory_bandwidth_gbps: float = 20.0
    # Inside a node, per collective (all-reduce, all-gather, reduce-scatter, point-to-point), where one runs
    # at other figures than the link's: bytes per second one device sends (GB/s) and latency per ring hop
    # (us). Measured by `mode=plan plan.calibrate=true` (gloo on a CPU: all-gather and reduce-scatter
    # move their bytes at a third to a half of all-reduce's rate); an op not listed uses the link's figure.
    intra_node_op_bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    intra_node_op_latency_us: dict[str, float] = field(default_factory=dict)
    # The pipeline runtime's own time per compute action (a chunk's forward, full backward, input- or
    # weight-gradient pass) on its rank, in microseconds: torch's schedule walking its action list, issuing
    # and waiting on the batched sends and receives, a backward call's autograd start; beyond the stage's
    # compute and beyond its messages' latency and bytes (the point-to-point terms count those). Counted on
    # the pipeline's critical path (trainer/planner/timing.py). Measured by `mode=plan plan.calibrate=true`
    # on any run of 2 or more processes (trainer/planner/pipeline_overhead.py: a near-zero-compute ZBV
    # pipeline over pairs of ranks). The default is that probe on the 2-core development VM (210-390 us
    # with 2, 4 and 8 processes; 300 taken); the GPU profiles carry an estimate.
    pipeline_action_overhead_us: float = 300.0

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of one device for matmuls in `dtype`."""
        name = DTYPE_NAMES.get(dtype, "fp32")
        return float(getattr(self, f"peak_flops_{name}"))

    def group_bandwidth(self, spans_nodes: bool, op: str = "") -> float:
        """Bytes per second one device sends in a collective `op` of a group inside one node or across nodes."""
        if spans_nodes:
            return 1e9 * self.inter_node_bandwidth_gbps
        return 1e9 * self.intra_node_op_bandwidth_gbps.get(op, self.intra_node_bandwidth_gbps)

    def group_latency(self, spans_nodes: bool, op: str = "") -> float:
        """Seconds per ring hop of a collective `op` inside one node or across nodes."""
        if spans_nodes:
            return 1e-6 * self.inter_node_latency_us
        return 1e-6 * self.intra_node_op_latency_us.get(op, self.intra_node_latency_us)


# The `hardware` group has one schema, registered in Hydra's ConfigStore as `hardware_schema` by
# trainer.config.register_configs (every conf/hardware/*.yaml names it in its defaults list).
SCHEMAS: dict[str, type] = {"hardware": HardwareConfig}


def meminfo_bytes(field_name: str) -> float:
    """A /proc/meminfo field in bytes (`MemTotal`, `MemAvailable`: what can be allocated without swapping),
    else the total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field_name}:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
