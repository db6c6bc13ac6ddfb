"""Peak FLOP/s of the device (for MFU) and peak memory of this process."""

from __future__ import annotations

import functools
import resource
import time

import torch

# Dense peak FLOP/s per GPU from the vendors' data sheets (without sparsity). The float32 figure is the
# TF32 tensor cores', what fp32 matmuls run at when TF32 is allowed (`torch.backends.cuda.matmul.allow_tf32`).
GPU_PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 494.7e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 494.7e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 156e12},
    "RTX 3090": {torch.bfloat16: 71e12, torch.float16: 71e12, torch.float32: 35.6e12},
}
# fp32 matmuls without TF32 (PyTorch's default) run on the CUDA cores: the data sheets' FP32 figure.
GPU_FP32_PEAK_FLOPS: dict[str, float] = {"H200": 66.9e12, "H100": 66.9e12, "A100": 19.5e12, "RTX 3090": 35.6e12}


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
                         min_seconds: float = 0.01, max_size: int = 4096, repeats: int = 5) -> float:
    """Best achieved FLOP/s of a square matmul on this device and thread count (the MFU reference),
    measured once per process (`matmul_flops` measures again on every call)."""
    return matmul_flops(device_type, dtype, min_seconds, max_size, repeats)


def matmul_flops(device_type: str = "cpu", dtype: torch.dtype = torch.float32,
                 min_seconds: float = 0.01, max_size: int = 4096, repeats: int = 5) -> float:
    """Best achieved FLOP/s of a square matmul on this device and thread count, measured now.

    BLAS efficiency grows with the matrix size, so the size doubles until one product takes
    `min_seconds` (or reaches `max_size`): the figure is what the hardware sustains, not the
    overhead of a small call. 10 ms is enough: on a 2-core EPYC (2 threads) the best of 5 products at
    that size (1024) measured 139-162 GFLOP/s over four fresh processes, the best of 3 at 4096 (0.2 s
    each) 129-161, at 1/35 of the CPU time (0.25 s against 9 s, paid by every process of a run).
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


def shapes_matmul_flops(shapes: list[tuple[int, int, int, int]], device_type: str = "cpu",
                        dtype: torch.dtype = torch.float32, repeats: int = 3) -> float:
    """Achieved FLOP/s over matmuls of the given sizes, measured now: each (m, k, n, count) is a forward
    product [m, k] x [k, n] and its two backward ones ([m, n] x [n, k] for the input's gradient, [k, m] x
    [m, n] for the weight's), each timed as the best of `repeats` after a warm-up, weighted by count."""
    device = torch.device(device_type)
    flops = seconds = 0.0
    for m, k, n, count in shapes:
        for (rows, inner), (_, cols) in (((m, k), (k, n)), ((m, n), (n, k)), ((k, m), (m, n))):
            a = torch.randn(rows, inner, device=device, dtype=dtype)
            b = torch.randn(inner, cols, device=device, dtype=dtype)
            torch.matmul(a, b)
            best = min(_time_matmul(a, b) for _ in range(repeats))
            flops += count * 2 * rows * inner * cols
            seconds += count * best
    return flops / seconds if seconds > 0 else 0.0


def attention_flops(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, causal: bool = True,
                    device_type: str = "cpu", dtype: torch.dtype = torch.float32, repeats: int = 3) -> float:
    """Achieved FLOP/s of SDPA's fused attention, forward and backward, at one shape, measured now (the best
    of `repeats` after a warm-up). FLOPs are what the kernel runs: 4 b h s^2 d forward and twice that
    backward, halved when causal (the kernel skips the key blocks above the diagonal)."""
    import torch.nn.functional as F

    device = torch.device(device_type)
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    once()
    best = min(once() for _ in range(repeats))
    return 12 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0) / best


def memory_bandwidth(device_type: str = "cpu", size_mb: float = 64.0, repeats: int = 5) -> float:
    """Bytes per second this process moves through memory, measured now: the best of `repeats` copies of
    a `size_mb` MiB fp32 tensor (each reads and writes it: 2 x its bytes). Large enough to leave the caches,
    so it is what a memory-bound step (the optimizer's) sees; run it on every process at once to measure a
    device's share of a shared memory bus."""
    device = torch.device(device_type)
    source = torch.ones(int(size_mb * 2**20) // 4, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Data-sheet peak of a known GPU; otherwise (CPU, unknown GPU) the measured matmul peak."""
    return peak_flops_with_note(device, dtype)[0]


def peak_flops_with_note(device: torch.device, dtype: torch.dtype) -> tuple[float, str | None]:
    """The MFU reference of matmuls in `dtype` (the dtype they actually run in: the precision's compute
    dtype) and, when it is not that dtype's own peak, a note saying which it is.

    A known GPU's data-sheet peak of the dtype (fp32: TF32's when TF32 is allowed, else the CUDA cores').
    Otherwise the measured matmul peak of the dtype, unless the
    fp32 peak measures higher: a CPU without fp16/bf16 units (no AMX, no AVX512-FP16) runs 16-bit matmuls
    through slow generic kernels, and the model's own matmuls can then beat that figure (an MFU of 589%
    was seen), so the larger fp32 peak is the reference and the note says so.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name and dtype in table:
                if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
                    return GPU_FP32_PEAK_FLOPS[key], ("MFU is against the fp32 CUDA-core peak: fp32 matmuls run "
                                                      "without TF32 (torch.backends.cuda.matmul.allow_tf32 is off)")
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
