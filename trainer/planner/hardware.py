"""The `hardware` config group: what one device and one node of a target machine offer.

Figures come from the vendors' data sheets (dense, without sparsity). Memory is counted in GB = 1e9 bytes
everywhere in the planner, as in the ZeRO paper; `memory_gb` is the capacity the driver reports (e.g.
81,559 MiB = 85.5 GB for an H100 80GB), `reserved_gb` what the CUDA context, NCCL and the caching
allocator's own needs take before any tensor exists.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    peak_flops_bf16: float = 6.25e9
    peak_flops_fp16: float = 6.25e9
    peak_flops_fp32: float = 2.5e10
    # Memory of one device in GB (1e9 bytes), as the driver reports it.
    memory_gb: float = 3.0
    # Taken before any tensor exists: CUDA context, NCCL buffers, allocator bookkeeping.
    reserved_gb: float = 0.3
    # Memory bandwidth of one device in GB/s (an optimizer step is memory-bound).
    memory_bandwidth_gbps: float = 2.5
    # Devices per node (processes per node on the CPU).
    devices_per_node: int = 8
    # Bandwidth per device in GB/s, one direction: inside a node (NVLink/NVSwitch, PCIe) and across nodes
    # (each device's share of the network: InfiniBand/RoCE NICs).
    intra_node_bandwidth_gbps: float = 5.0
    inter_node_bandwidth_gbps: float = 1.25
    # Latency of one message hop in microseconds, inside and across nodes.
    intra_node_latency_us: float = 30.0
    inter_node_latency_us: float = 100.0
    # Host (CPU) memory of one node in GB and the host-device link per device in GB/s (offload traffic).
    host_memory_gb: float = 24.0
    host_to_device_bandwidth_gbps: float = 10.0
    # Host memory bandwidth of one node in GB/s (an offloaded optimizer step is memory-bound on it).
    host_memory_bandwidth_gbps: float = 20.0

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of one device for matmuls in `dtype`."""
        name = DTYPE_NAMES.get(dtype, "fp32")
        return float(getattr(self, f"peak_flops_{name}"))

    def group_bandwidth(self, spans_nodes: bool) -> float:
        """Bytes per second one device sends in a collective of a group inside one node or across nodes."""
        return 1e9 * (self.inter_node_bandwidth_gbps if spans_nodes else self.intra_node_bandwidth_gbps)

    def group_latency(self, spans_nodes: bool) -> float:
        return 1e-6 * (self.inter_node_latency_us if spans_nodes else self.intra_node_latency_us)


# The `hardware` group has one schema, registered in Hydra's ConfigStore as `hardware_schema` by
# trainer.config.register_configs (every conf/hardware/*.yaml names it in its defaults list).
SCHEMAS: dict[str, type] = {"hardware": HardwareConfig}
