"""Peak FLOP/s of the device (for MFU) and peak memory of this process."""

from __future__ import annotations

import functools
import resource
import time

import torch

# Dense peak FLOP/s per GPU from the vendors' data sheets (without sparsity).
GPU_PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 494.7e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 494.7e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 156e12},
    "RTX 3090": {torch.bfloat16: 71e12, torch.float16: 71e12, torch.float32: 35.6e12},
}


def _time_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    torch.matmul(a, b)
    if a.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


@functools.lru_cache(maxsize=None)
def measure_matmul_flops(device_type: str = "cpu", dtype: torch.dtype = torch.float32,
                         min_seconds: float = 0.2, max_size: int = 4096, repeats: int = 3) -> float:
    """Best achieved FLOP/s of a square matmul on this device and thread count (the MFU reference).

    BLAS efficiency grows with the matrix size, so the size doubles until one product takes
    `min_seconds` (or reaches `max_size`): the figure is what the hardware sustains, not the
    overhead of a small call.
    """
    device = torch.device(device_type)
    size = 512
    while True:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        torch.matmul(a, b)  # warm-up: thread pool, kernels
        if size >= max_size or _time_matmul(a, b) >= min_seconds:
            break
        size *= 2
    best = min(_time_matmul(a, b) for _ in range(repeats))
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Data-sheet peak of a known GPU; otherwise (CPU, unknown GPU) the measured matmul peak."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name and dtype in table:
                return table[dtype]
    return measure_matmul_flops(device.type, dtype)


def reset_peak_memory(device: torch.device) -> None:
    """Start peak_memory_bytes afresh: runs that share a process (the jobs of a Hydra sweep run one
    after the other in it) each report their own peak, not the largest one so far.

    On Linux, writing 5 to /proc/self/clear_refs resets the resident-set high-water mark that
    getrusage's ru_maxrss reports; elsewhere the CPU figure stays the process's peak.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
