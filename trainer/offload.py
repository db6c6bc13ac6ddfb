"""ZeRO-Offload's optimizer step: states and master weights in host memory, the step on the CPU.

Reference: Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training" (DeepSpeed's
`offload_optimizer`): the device keeps the parameters and gradients in the training dtype and runs the
forward and backward; the host keeps the fp32 master weights and the optimizer's states (12 bytes per
parameter for Adam) and runs the update with a fused CPU kernel; gradients go down and updated parameters
come back up over PCIe each step.

`HostSteppedCopies` is that step for whatever tensors a strategy hands the optimizer (parameters, FSDP or
tensor-parallel DTensor shards, ZeRO-1's row views). Its device memory is two pinned staging buffers of
`bucket_bytes` each; host memory holds the copies and the optimizer's states (pageable: only the CPU
touches them) plus one fp32 gradient bucket. The step runs bucket by bucket, a bucket being whole tensors:

    copy stream:  D2H grads(0)  D2H grads(1)  H2D params(0)  D2H grads(2)  H2D params(1) ...
    host:                 [convert, step, round](0)   [convert, step, round](1)   ...

so the transfer of the next bucket's gradients and of the previous bucket's parameters overlap the CPU
step of this one. The optimizer is stepped once per bucket with only that bucket's copies holding a
gradient (torch's optimizers skip tensors without one), which keeps its per-tensor semantics: any
optimizer whose update of a tensor depends on that tensor alone (AdamW, SGD, Muon) is stepped exactly as
in one call. The compute stream waits for the copy stream at the end, so the next forward reads the
updated parameters while the host is already free.
"""

from __future__ import annotations

import torch

from trainer.optim import SteppedCopies, _local

# Bytes per staging buffer (two of them, pinned host memory): large enough that a transfer runs at PCIe
# speed, small enough to pin in a moment. A tensor larger than this is moved in slices.
DEFAULT_BUCKET_BYTES = 256 * 2**20


def _host_like(tensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (host memory) as a tensor of `tensor`'s layout: a DTensor built around it without moving it
    to the mesh's device (`DTensor.from_local` would), as FSDP2's CPU offload holds its shards."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not isinstance(tensor, DTensor):
        return local
    spec = DTensorSpec(tensor.device_mesh, tensor.placements,
                       tensor_meta=TensorMeta(tensor.shape, tensor.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


class _Transfers:
    """Copies between device tensors and the pinned staging buffers on a side stream (CUDA), or at once
    (a CPU device: the "host" is the same memory, there is nothing to overlap)."""

    def __init__(self, device: torch.device, staging_numel: int, dtype: torch.dtype) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging = [torch.empty(staging_numel, dtype=dtype, pin_memory=self.cuda) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]

    def begin(self) -> None:
        if self.stream is not None:  # the gradients were produced on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def end(self) -> None:
        if self.stream is not None:  # the next forward must read the updated parameters
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, temporary: bool = False) -> None:
        """dst <- src on the copy stream. `temporary`: `src` is a device tensor freed when the caller drops
        it (a contiguous copy of a gradient), so the allocator is told to wait for the copy before reusing
        its memory. Not for the gradients themselves: a recorded stream keeps a freed block allocated until
        the copy stream has drained, i.e. after the last upload, so the next forward would allocate beside
        the step's freed gradients (measured: the device peak of an offloaded run rose by most of them).
        They need nothing: they are freed after `end()`, which orders the compute stream after the copies."""
        if self.stream is None:
            dst.copy_(src)
            return
        # after whatever the compute stream has queued so far (the gradients, a reshape of one)
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            if temporary and src.device.type == "cuda":
                src.record_stream(self.stream)

    def record(self, slot: int) -> None:
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            self.events[slot] = event

    def wait(self, slot: int) -> None:
        event = self.events[slot]
        if event is not None:
            event.synchronize()
            self.events[slot] = None


class HostSteppedCopies(SteppedCopies):
    """The optimizer steps host-memory copies of its tensors (fp32 masters when `dtype` is float32) in
    buckets of whole tensors, overlapping transfers with the CPU step (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if optimizer.state:
            raise RuntimeError("stepped copies must be installed before the optimizer's first step")
        tensors = [tensor for group in optimizer.param_groups for tensor in group["params"]]
        locals_ = [_local(tensor.detach()) for tensor in tensors]
        device = next((t.device for t in locals_ if t.device.type != "meta"), torch.device("cpu"))
        self.device = device
        self.copy_dtype = dtype
        # Staging in the device tensors' dtype (bf16 under bf16_true: half the PCIe bytes of fp32).
        stage_dtype = locals_[0].dtype if locals_ else torch.float32
        if any(t.dtype != stage_dtype for t in locals_):
            raise ValueError("optimizer offload needs the tensors it steps in one dtype, got "
                             f"{sorted({str(t.dtype) for t in locals_})}")
        self.bucket_numel = max(1, bucket_bytes // torch.empty((), dtype=stage_dtype).element_size())
        self.transfers = _Transfers(device, self.bucket_numel if device.type != "meta" else 0, stage_dtype)
        self.pairs = []
        for group in optimizer.param_groups:
            copies = []
            for tensor in group["params"]:
                copy = _host_like(tensor, self._host_copy(_local(tensor.detach()), dtype or tensor.dtype))
                self.pairs.append((tensor, copy))
                copies.append(copy)
            group["params"] = copies
        self.buckets = self._bucket_pairs()
        largest = max((sum(_local(c).numel() for _, c in bucket) for bucket in self.buckets), default=0)
        # fp32 gradients of one bucket, for the optimizer (its kernels take gradients in the copies' dtype)
        grad_dtype = dtype or stage_dtype
        self.grad_buffer = torch.empty(largest if device.type != "meta" else 0, dtype=grad_dtype)
        # The copies were just made from the tensors; whatever writes the tensors later (a checkpoint,
        # init_from) calls `weights_written`, and the next step compares them (a full download: not every step).
        self.verify = False

    def _host_copy(self, local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host copy of a device tensor in `dtype`, moved through the pinned staging buffers (a pageable
        device-to-host copy runs at a fraction of PCIe speed)."""
        if local.device.type == "meta":  # the planner's exact mode counts shapes: nothing to move
            return torch.empty_like(local, dtype=dtype)
        out = torch.empty(local.shape, dtype=dtype)
        self._download(local, out)
        return out

    def _download(self, local: torch.Tensor, out: torch.Tensor) -> None:
        """out (host) <- local (device), in staging-buffer slices, synchronously."""
        flat, target = local.reshape(-1), out.view(-1)
        stage = self.transfers.staging[0]
        for start in range(0, flat.numel(), self.bucket_numel):
            end = min(start + self.bucket_numel, flat.numel())
            self.transfers.begin()
            self.transfers.copy(stage[:end - start], flat[start:end])
            self.transfers.record(0)
            self.transfers.wait(0)
            target[start:end].copy_(stage[:end - start])

    def _bucket_pairs(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        buckets: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
        size = 0
        for pair in self.pairs:
            numel = _local(pair[1]).numel()
            if buckets[-1] and size + numel > self.bucket_numel:
                buckets.append([])
                size = 0
            buckets[-1].append(pair)
            size += numel
        return [bucket for bucket in buckets if bucket]

    def weights_written(self) -> None:
        self.verify = True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.verify:
            self._refresh_written_copies()
            self.verify = False
        transfers = self.transfers
        transfers.begin()
        oversized = [sum(_local(c).numel() for _, c in bucket) > self.bucket_numel for bucket in self.buckets]
        staged: set[int] = set()
        for index, bucket in enumerate(self.buckets):
            if oversized[index]:  # one tensor larger than a staging buffer: moved in slices, not overlapped
                self._step_sliced(optimizer, bucket[0])
                continue
            slot = index % 2
            if index not in staged:
                self._stage_grads(bucket, slot)
            following = index + 1
            if following < len(self.buckets) and not oversized[following]:
                self._stage_grads(self.buckets[following], 1 - slot)  # overlaps this bucket's CPU step
                staged.add(following)
            transfers.wait(slot)
            self._step_bucket(optimizer, bucket, transfers.staging[slot])
            self._upload(bucket, slot)
        transfers.end()

    def _stage_grads(self, bucket: list[tuple[torch.Tensor, torch.Tensor]], slot: int) -> None:
        stage, offset = self.transfers.staging[slot], 0
        for tensor, copy in bucket:
            numel = _local(copy).numel()
            if tensor.grad is not None:
                grad = _local(tensor.grad)
                self.transfers.copy(stage[offset:offset + numel], grad.reshape(-1), temporary=not grad.is_contiguous())
            offset += numel
        self.transfers.record(slot)

    def _step_bucket(self, optimizer: torch.optim.Optimizer, bucket: list[tuple[torch.Tensor, torch.Tensor]],
                     stage: torch.Tensor) -> None:
        """Gradients from `stage` into the fp32 bucket, one optimizer step over the bucket's copies, and
        the updated values rounded back into `stage` (the gradients there are consumed by then)."""
        offset = 0
        for tensor, copy in bucket:
            local = _local(copy)
            numel = local.numel()
            if tensor.grad is not None:
                grad = self.grad_buffer[offset:offset + numel]
                grad.copy_(stage[offset:offset + numel])
                copy.grad = _host_like(copy, grad.view_as(local))
            offset += numel
        optimizer.step()
        offset = 0
        for tensor, copy in bucket:
            local = _local(copy)
            stage[offset:offset + local.numel()].copy_(local.reshape(-1))  # rounds to the tensors' dtype
            copy.grad = None
            offset += local.numel()

    def _upload(self, bucket: list[tuple[torch.Tensor, torch.Tensor]], slot: int) -> None:
        stage, offset = self.transfers.staging[slot], 0
        for tensor, copy in bucket:
            local = _local(tensor)
            self.transfers.copy(local.view(-1), stage[offset:offset + local.numel()])
            offset += local.numel()
        self.transfers.record(slot)

    def _step_sliced(self, optimizer: torch.optim.Optimizer, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A tensor larger than a staging buffer: its gradient downloaded slice by slice into the fp32
        buffer, one step, its values uploaded slice by slice."""
        tensor, copy = pair
        local_copy = _local(copy)
        for slot in (0, 1):
            self.transfers.wait(slot)
        if tensor.grad is not None:
            grad = self.grad_buffer[:local_copy.numel()].view_as(local_copy)
            self._download(_local(tensor.grad), grad)
            copy.grad = _host_like(copy, grad)
        optimizer.step()
        copy.grad = None
        flat, source = _local(tensor).view(-1), local_copy.reshape(-1)
        stage = self.transfers.staging[0]
        for start in range(0, flat.numel(), self.bucket_numel):
            end = min(start + self.bucket_numel, flat.numel())
            self.transfers.wait(0)
            stage[:end - start].copy_(source[start:end])
            self.transfers.copy(flat[start:end], stage[:end - start])
            self.transfers.record(0)

    def _refresh_written_copies(self) -> None:
        """Restart a copy from its tensor when the tensor is no longer the copy's rounding: weights were
        written from outside (init_from, a checkpoint saved without the copies). Local shards only, so
        no collective is needed. Run on the first step and after `weights_written`, not every step: it
        moves every tensor to the host once."""
        for tensor, copy in self.pairs:
            local, local_copy = _local(tensor), _local(copy)
            if local.device.type == "meta":
                continue
            on_host = torch.empty(local.shape, dtype=local.dtype)
            self._download(local, on_host)
            if not torch.equal(local_copy.to(local.dtype), on_host):
                local_copy.copy_(on_host)

