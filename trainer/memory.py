"""Bytes of training state this rank holds: its local shards of parameters, gradients, optimizer states."""

from __future__ import annotations

import gc
from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's bytes: a DTensor's local shard, and inside wrapper subclasses
    (torchao's float8 weight wrapper under FSDP2) the tensor they wrap."""
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        tensor = getattr(tensor, inner[0])
    return tensor


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum over distinct memory, so a tensor seen twice (tied weights) counts once."""
    seen: dict[tuple[int, int], int] = {}
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta" or local.numel() == 0:
            continue
        # keyed by address, not id(): to_local() returns a new Python object each time
        seen[(local.data_ptr(), local.numel())] = local.numel() * local.element_size()
    return sum(seen.values())


def storage_address(tensor: torch.Tensor) -> int:
    """Address of the storage holding this rank's bytes of `tensor` (0 on the meta device): two tensors
    with the same address share memory (a view, not a copy)."""
    local = _local(tensor)
    return 0 if local.device.type == "meta" else local.untyped_storage().data_ptr()


def state_bytes(model_parts: Iterable[nn.Module], optimizer: torch.optim.Optimizer,
                stand_ins: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """{params, grads, optimizer} bytes held by this rank (measured while gradients exist).

    `optimizer` counts the states and the tensors the optimizer steps in place of parameters that are
    copies, not views, of them (bf16_true's fp32 master weights); ZeRO-1's sharded views share their
    parameter's storage and are not counted again. `grads` counts the parameters' gradients and those the
    stepped tensors or the strategy's `stand_ins` hold in storage of their own (ZeRO-2's partition). On a
    GPU, `host` is the part of those bytes in host memory (offloaded), and `<kind>_host` each kind's part."""
    params = [p for part in model_parts for p in part.parameters()]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    param_storages = {storage_address(p) for p in params}
    stepped = [t for group in optimizer.param_groups for t in group["params"]]
    copies = [t for t in stepped if storage_address(t) not in param_storages]
    grads = [p.grad for p in params if p.grad is not None]
    # gradients the optimizer's tensors hold in storage of their own (ZeRO-2's reduce-scattered rows)
    grad_storages = {storage_address(g) for g in grads}
    grads += [t.grad for t in [*stepped, *stand_ins] if t.grad is not None and storage_address(t.grad) not in grad_storages]
    kinds = {"params": params, "grads": grads,
             # scalar step counters are bookkeeping, not the states the ZeRO formulas count
             "optimizer": [v for v in states if v.dim() > 0] + copies}
    held = {kind: _bytes(tensors) for kind, tensors in kinds.items()}
    if any(_local(p).device.type == "cuda" for p in params):
        # offloaded states (FSDP's CPUOffloadPolicy, ZeRO-Offload's optimizer) sit in host memory
        on_host = {f"{kind}_host": _bytes(t for t in tensors if _local(t).device.type == "cpu")
                   for kind, tensors in kinds.items()}
        held["host"] = sum(on_host.values())
        held.update(on_host)
    return held


def describe_state_bytes(held: dict[str, int]) -> str:
    """`state_bytes`' figures for the log: each kind in MiB, and where it lives when any is offloaded."""
    parts = []
    for kind in ("params", "grads", "optimizer"):
        text = f"{kind} {held[kind] / 2**20:.2f} MiB"
        host = held.get(f"{kind}_host", 0)
        if host:
            text += " (all in host memory)" if host == held[kind] else f" ({host / 2**20:.2f} MiB in host memory)"
        parts.append(text)
    if "host" in held:
        parts.append(f"on the device {(held['params'] + held['grads'] + held['optimizer'] - held['host']) / 2**20:.2f} MiB")
    return ", ".join(parts)


def live_tensor_bytes() -> int:
    """Bytes of every distinct CPU storage a live Python tensor holds (parameters, gradients, optimizer
    states, buffers, the batch; a DTensor's local shard, a wrapper subclass's inner tensor), after a garbage
    collection. What only C++ holds (a collective's buffers) is not seen; at a step boundary that is nothing
    the planner counts."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): isinstance would read deprecated proxies
            continue
        try:
            local = _local(obj)
            if local.device.type != "cpu" or local.numel() == 0:
                continue
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # meta, fake or freed storages
            continue
    return sum(storages.values())


class TensorPeakMeter:
    """The peak of the bytes this process's tensors hold on the CPU during one window (a training step).

    On a GPU the figure the planner's per-device total compares with is `torch.cuda.max_memory_allocated`:
    the peak of live tensor bytes. The CPU has no such counter, and the resident set (what `peak_memory_bytes`
    reports there) also holds the interpreter, torch's libraries, the data and the allocator's free lists,
    hundreds of MB the planner does not model. So the peak is counted in two parts:
    - at `start`, the live tensors' bytes (`live_tensor_bytes`: weights, gradients, optimizer states,
      buffers, the batch);
    - during the window, the rise above that: with memory profiling on, torch's CPU allocator reports every
      allocation and free of this thread (and of the autograd and intra-op threads it hands its state to),
      and the running sum of those reports peaks where the live tensor bytes do.
    Two kinds of frees are never reported: of memory allocated before `start`, and by a thread the profiler
    does not follow (gloo's worker, when it drops a collective's input last: tensor parallelism's
    redistributions, some 13 MB a step for the tiny model at tp=2), so the running sum drifts up. A step
    ends holding what it started with (its gradients freed or replaced, no new states after the first
    step), so what the sum still counts at `stop` is that drift (`unseen_free_bytes`); spread evenly over
    the step, its share before the peak comes off. Hence one window of one step, not a sum over the run.
    The profiler records every operator (a few microseconds each), so a run measures a warm-up step and
    times the others.
    """

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.start_bytes = 0
        self.unseen_free_bytes = 0  # still counted live at `stop`: freed where the records could not see it
        self.peak_bytes: int | None = None
        self.running = False

    def start(self) -> None:
        self.start_bytes = live_tensor_bytes()
        self._profile.start()
        self.running = True

    def stop(self) -> int:
        """Stop recording; the peak of live tensor bytes in the window (also kept as `peak_bytes`)."""
        self._profile.stop()
        self.running = False
        results = self._profile.profiler.kineto_results  # type: ignore[union-attr]
        events = sorted((e for e in results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"),
                        key=lambda e: e.start_ns())
        live = rise = 0
        peak_ns = first_ns = events[0].start_ns() if events else 0
        for event in events:
            live += event.nbytes()
            if live > rise:
                rise, peak_ns = live, event.start_ns()
        # the drift the records end with, spread evenly over the window: its share before the peak comes off
        self.unseen_free_bytes = max(0, live)
        span = (events[-1].start_ns() - first_ns) if events else 0
        unseen = self.unseen_free_bytes * (peak_ns - first_ns) / span if span > 0 else 0.0
        self.peak_bytes = int(self.start_bytes + rise - unseen)
        return self.peak_bytes
