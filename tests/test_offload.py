"""ZeRO-Offload's bucketed host step (trainer.offload.HostSteppedCopies) against the optimizer stepped
whole: on a CPU the staging buffers are plain memory, so what is checked here is the bookkeeping - the
buckets, the slices of a tensor larger than a staging buffer, the rounding back, the refresh after weights
are written from outside. The transfers' overlap and the device peak are the gpu tier's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from trainer.offload import HostSteppedCopies
from trainer.optim import SteppedCopies


def _params(dtype: torch.dtype) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (300, 16), (8, 8), (5,)]  # 300 x 16 = 4800 elements: larger than a bucket
    return [nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]


def _train(copies_class: type, dtype: torch.dtype, steps: int = 4, **options: object) -> list[torch.Tensor]:
    params = _params(dtype)
    optimizer = torch.optim.AdamW([{"params": params[:3], "weight_decay": 0.1},
                                   {"params": params[3:], "weight_decay": 0.0}], lr=1e-2, fused=True)
    copies = copies_class(optimizer, torch.float32 if dtype != torch.float32 else None, **options)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for index, param in enumerate(params):
            # one parameter without a gradient on one step: its copy must not move
            param.grad = None if (step, index) == (1, 3) else torch.randn(param.shape, generator=generator).to(dtype)
        copies.step(optimizer)
    return [p.detach().clone() for p in params]


def test_the_bucketed_host_step_equals_one_step_of_the_whole_optimizer() -> None:
    # 1 KiB buckets of bf16 (512 elements): several buckets, and one tensor moved in slices
    for dtype in (torch.bfloat16, torch.float32):
        whole = _train(SteppedCopies, dtype) if dtype != torch.float32 else _train(_PlainStep, dtype)
        bucketed = _train(HostSteppedCopies, dtype, bucket_bytes=1024)
        for a, b in zip(whole, bucketed, strict=True):
            assert torch.equal(a, b), (dtype, (a.float() - b.float()).abs().max())


def test_buckets_hold_whole_tensors_and_an_oversized_tensor_alone() -> None:
    params = _params(torch.bfloat16)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    copies = HostSteppedCopies(optimizer, torch.float32, bucket_bytes=1024)
    sizes = [[copy.numel() for _, copy in bucket] for bucket in copies.buckets]
    assert sizes == [[2048], [32], [4800], [64, 5]]
    assert all(copy.dtype == torch.float32 for _, copy in copies.pairs)
    assert [group["params"][0] is copies.pairs[0][1] for group in optimizer.param_groups[:1]] == [True]


def test_weights_written_from_outside_restart_their_copies() -> None:
    params = _params(torch.bfloat16)
    optimizer = torch.optim.AdamW(params, lr=0.0)
    copies = HostSteppedCopies(optimizer, torch.float32, bucket_bytes=1024)
    for param in params:
        param.grad = torch.zeros_like(param)
    copies.step(optimizer)
    with torch.no_grad():
        params[2].fill_(3.0)  # a checkpoint's weights, loaded in place
    copies.weights_written()
    copies.step(optimizer)  # lr 0: the step keeps whatever the copies hold
    assert torch.equal(params[2], torch.full_like(params[2], 3.0))
    assert torch.equal(copies.pairs[2][1], torch.full((300, 16), 3.0))


class _PlainStep:
    """The reference for fp32 tensors: the optimizer stepping the parameters themselves."""

    def __init__(self, optimizer: torch.optim.Optimizer, dtype: object = None) -> None:
        del dtype

    @staticmethod
    def step(optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


@pytest.mark.parametrize("offload", ["false", "true"])
def test_zero1_views_drop_their_gradients_between_steps(tmp_path: Path, offload: str) -> None:
    """ZeRO-1 with copies stepped in the views' place (bf16_true's masters, offloaded or not): after a step
    no row view keeps a gradient. One that did held the step's gradient memory through the next step; on a
    GPU, after DDP rebuilt its buckets, that was a whole extra set of gradients at the peak."""
    from trainer.config import compose
    from trainer.run import build_trainer

    cfg = compose(["strategy=zero1", "trainer.devices=1", "precision=bf16_true", f"strategy.offload_optimizer={offload}",
                   "trainer.seq_len=32", "trainer.global_batch_size=2", "trainer.micro_batch_size=2",
                   "trainer.max_steps=2", "trainer.val_every=0", "trainer.val_batches=1", "data.max_bytes=100000",
                   "callbacks=none", "model.n_layers=1", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=1",
                   "model.ffn_hidden_dim=64", "lr_schedule.warmup_steps=0"])
    trainer = build_trainer(cfg, tmp_path)
    strategy = trainer.strategy
    try:
        trainer.fit()
        views = [view for _, view in strategy.optimizer_tensor_pairs()]
        assert views and all(view.grad is None for view in views)
        copies = trainer.precision.optimizer_tensor_pairs()
        assert copies and type(trainer.precision.copies).__name__ == ("HostSteppedCopies" if offload == "true"
                                                                       else "SteppedCopies")
    finally:
        del trainer
        strategy.teardown()
