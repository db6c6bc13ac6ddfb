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
    return peak_flops_with_note(device, dtype)[0]


def peak_flops_with_note(device: torch.device, dtype: torch.dtype) -> tuple[float, str | None]:
    """The MFU reference of matmuls in `dtype` (the dtype they actually run in: the precision's compute
    dtype) and, when it is not that dtype's own peak, a note saying which it is.

    A known GPU's data-sheet peak of the dtype. Otherwise the measured matmul peak of the dtype, unless the
    fp32 peak measures higher: a CPU without fp16/bf16 units (no AMX, no AVX512-FP16) runs 16-bit matmuls
    through slow generic kernels, and the model's own matmuls can then beat that figure (an MFU of 589%
    was seen), so the larger fp32 peak is the reference and the note says so.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name and dtype in table:
                return table[dtype], None
    measured = measure_matmul_flops(device.type, dtype)
    if dtype == torch.float32:
        return measured, None
    fp32 = measure_matmul_flops(device.type, torch.float32)
    if fp32 > measured:
        name = str(dtype).removeprefix("torch.")
        return fp32, (f"MFU is against the fp32 matmul peak ({fp32 / 1e9:.1f} GFLOP/s): {name} matmuls measure "
                      f"slower here ({measured / 1e9:.1f} GFLOP/s)")
    return measured, None


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
