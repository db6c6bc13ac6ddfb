"""The run's throughput clock (trainer/throughput.py, issue 27 item 3): logged intervals include the wait for
the device, the summary's steady-state figure leaves the warm-up out while the wall average keeps it,
validation and checkpoints are not training time, MFU is against a fixed peak, and a GPU's fp32 peak is
the one its matmuls run at.

No test times real work: the meter's clock is a fake one that only the test moves (a simulated device's
queued work, a simulated compilation), so every figure is exact.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

from trainer.callback import Callback
from trainer.config import compose
from trainer.loop import Trainer
from trainer.run import build_trainer, throughput_line

TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden_dim=64",
        "trainer.seq_len=16", "trainer.micro_batch_size=2", "trainer.global_batch_size=2", "trainer.val_every=0",
        "trainer.val_batches=1", "lr_schedule.warmup_steps=1", "data.max_bytes=100000", "callbacks=none",
        "trainer.peak_flops=1e12", "trainer.save_final=false"]
TOKENS_PER_STEP = 2 * 16


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class OnHook(Callback):
    """Calls `action(trainer)` from one hook: what takes (fake) time in a test."""

    def __init__(self, hook: str, action: Callable[[Any], None]) -> None:
        self.hook, self.action = hook, action
        self.logged: list[tuple[int, float, float]] = []  # step, tokens_per_s, mfu of each logged step

    def on_after_backward(self, trainer: Any) -> None:
        if self.hook == "on_after_backward":
            self.action(trainer)

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        metrics = trainer.logged_metrics
        if metrics.get("step") == trainer.step and "tokens_per_s" in metrics:
            self.logged.append((trainer.step, metrics["tokens_per_s"], metrics["mfu"]))
        if self.hook == "on_train_batch_end":
            self.action(trainer)


def fit(tmp_path: Path, overrides: list[str], hook: Optional[OnHook] = None,
        prepare: Optional[Callable[[Trainer, FakeClock], None]] = None) -> tuple[dict[str, Any], FakeClock, Trainer]:
    """Build the tiny run, put the fake clock into its meter (and `hook` into its callbacks), train."""
    trainer = build_trainer(compose(TINY + overrides), tmp_path)
    clock = FakeClock()
    trainer.throughput_meter.now = clock
    if hook is not None:
        trainer.callbacks.append(hook)
    if prepare is not None:
        prepare(trainer, clock)
    return trainer.fit(), clock, trainer


@pytest.mark.parametrize("log_every", [2, 3])
def test_a_logged_interval_includes_the_wait_for_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             log_every: int) -> None:
    """A simulated asynchronous device: each step queues 1 s of work that only a synchronize waits for (as
    CUDA kernels do). The host takes no time at all, so an interval that closed before waiting would
    read 0 s; it reads exactly the work of its steps, whatever log_every, and the device is waited for
    only at the start and on logged steps."""
    queued = [0.0]
    syncs: list[int] = []

    def queue_work(trainer: Any) -> None:
        queued[0] += 1.0

    def prepare(trainer: Trainer, clock: FakeClock) -> None:
        def synchronize() -> None:
            syncs.append(trainer.step)
            clock.advance(queued[0])
            queued[0] = 0.0
        monkeypatch.setattr(trainer.strategy, "synchronize", synchronize)

    hook = OnHook("on_after_backward", queue_work)
    summary, _, _ = fit(tmp_path, [f"trainer.log_every={log_every}", "trainer.max_steps=6",
                                   "trainer.throughput_warmup_steps=0"], hook, prepare)
    logged_steps = list(range(log_every, 7, log_every))
    assert [step for step, _, _ in hook.logged] == logged_steps
    assert [tokens_per_s for _, tokens_per_s, _ in hook.logged] == [TOKENS_PER_STEP / 1.0] * len(logged_steps)
    assert syncs == [0] + logged_steps  # fit's start, then the logged steps only
    assert summary["train_s"] == 6.0 and summary["tokens_per_s"] == TOKENS_PER_STEP / 1.0
    assert summary["throughput_window"] == "steady" and summary["throughput_window_steps"] == [1, 6]


def test_the_steady_figure_leaves_the_warmup_out_and_the_wall_average_keeps_it(tmp_path: Path) -> None:
    """Every step takes 1 s and the first one 100 s more (compilation): with throughput_warmup_steps=2 and
    log_every=2 the steady window is steps 3-6; the wall average is over all six steps."""
    def step_time(trainer: Any) -> None:
        trainer.throughput_meter.now.advance(1.0 + (100.0 if trainer.step == 1 else 0.0))

    hook = OnHook("on_train_batch_end", step_time)
    summary, _, _ = fit(tmp_path, ["trainer.log_every=2", "trainer.max_steps=6", "trainer.throughput_warmup_steps=2"],
                        hook)

    # the per-interval figures: a logged step's interval closes before its callbacks run, so steps 1-2's
    # interval holds step 1's callback time (101 s) and the next one step 2's
    assert [tokens_per_s for _, tokens_per_s, _ in hook.logged] == [2 * TOKENS_PER_STEP / 101.0,
                                                                    2 * TOKENS_PER_STEP / 2.0,
                                                                    2 * TOKENS_PER_STEP / 2.0]
    assert summary["throughput_window"] == "steady" and summary["throughput_window_steps"] == [3, 6]
    assert summary["tokens_per_s"] == 4 * TOKENS_PER_STEP / 4.0
    assert summary["train_s"] == 105.0  # step 6's callback ran after the last interval closed
    assert summary["tokens_per_s_wall_average"] == 6 * TOKENS_PER_STEP / 105.0
    flops = summary["flops_per_token"]
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * flops / 1e12, rel=1e-12)
    assert summary["mfu_wall_average"] == pytest.approx(summary["tokens_per_s_wall_average"] * flops / 1e12, rel=1e-12)
    line = throughput_line(summary)
    assert line.startswith(f"{4 * TOKENS_PER_STEP / 4.0:,.0f} tokens/s") and "steady state, steps 3-6" in line
    assert f"wall average over all training {6 * TOKENS_PER_STEP / 105.0:,.0f} tokens/s" in line


def test_a_run_too_short_for_a_steady_window_reports_the_whole_run(tmp_path: Path) -> None:
    hook = OnHook("on_after_backward", lambda trainer: trainer.throughput_meter.now.advance(1.0))
    summary, _, _ = fit(tmp_path, ["trainer.log_every=2", "trainer.max_steps=3", "trainer.throughput_warmup_steps=3"],
                        hook)
    assert summary["throughput_window"] == "whole_run" and summary["throughput_window_steps"] == [1, 3]
    assert summary["tokens_per_s"] == summary["tokens_per_s_wall_average"] == TOKENS_PER_STEP / 1.0
    assert "whole run, steps 1-3" in throughput_line(summary)


def test_validation_and_checkpoints_are_not_training_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation (at step 2) and a checkpoint save and load (at step 3) take 50 s each; steps take 1 s.
    None of the 150 s is in any interval."""
    import trainer.checkpoint.io as io
    from trainer.checkpoint import load_checkpoint, save_checkpoint

    def slow(seconds: float, result: Any = None) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            clock.advance(seconds)
            return result
        return call

    def checkpoint(trainer: Any) -> None:
        if trainer.step == 3:
            save_checkpoint(trainer, tmp_path / "ckpt")
            load_checkpoint(trainer, tmp_path / "ckpt")

    monkeypatch.setattr(io, "_save_checkpoint", slow(50.0, tmp_path / "ckpt"))
    monkeypatch.setattr(io, "_load_checkpoint", slow(50.0, {}))
    trainer = build_trainer(compose(TINY + ["trainer.log_every=2", "trainer.max_steps=4", "trainer.val_every=2",
                                            "trainer.throughput_warmup_steps=0"]), tmp_path)
    clock = FakeClock()
    trainer.throughput_meter.now = clock
    monkeypatch.setattr(trainer.strategy, "evaluate", slow(50.0, 1.0))
    trainer.callbacks += [OnHook("on_after_backward", lambda t: clock.advance(1.0)),
                          OnHook("on_train_batch_end", checkpoint)]
    summary = trainer.fit()
    assert summary["train_s"] == 4.0 and summary["tokens_per_s"] == TOKENS_PER_STEP / 1.0
    assert clock.t - FakeClock().t == 4.0 + 2 * 50.0 + 50.0 + 50.0  # validations at steps 2 and 4, save, load


def test_mfu_above_the_peak_is_reported_as_measured_with_one_warning(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A peak below what the run achieves is not moved: MFU reads above 1, the peak stays the run's
    reference, and one warning says the peak looks too low."""
    hook = OnHook("on_after_backward", lambda trainer: trainer.throughput_meter.now.advance(1.0))
    with caplog.at_level(logging.WARNING, logger="trainer"):
        summary, _, trainer = fit(tmp_path, ["trainer.log_every=1", "trainer.max_steps=3", "trainer.peak_flops=1000"],
                                  hook)
    expected = TOKENS_PER_STEP * summary["flops_per_token"] / 1000.0  # FLOP/s per device over the peak
    assert expected > 1
    assert [mfu for _, _, mfu in hook.logged] == pytest.approx([expected] * 3, rel=1e-12)
    assert summary["mfu"] == pytest.approx(expected, rel=1e-12) and summary["mfu_wall_average"] == summary["mfu"]
    assert summary["peak_flops_per_device"] == trainer.peak_flops == 1000.0
    warnings = [r.getMessage() for r in caplog.records if "looks too low" in r.getMessage()]
    assert len(warnings) == 1 and "set trainer.peak_flops" in warnings[0]


def test_a_gpus_fp32_peak_is_the_one_its_matmuls_run_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 (and fp16, fp8's bf16 parts) against the tensor-core peak; fp32 against TF32's when TF32 is
    allowed, else against the CUDA cores' (PyTorch's default: TF32 off), with a note."""
    import trainer.hardware as hardware

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert hardware.peak_flops_with_note(cuda, torch.bfloat16) == (989.4e12, None)
    assert hardware.peak_flops_with_note(cuda, torch.float16) == (989.4e12, None)
    allowed = torch.backends.cuda.matmul.allow_tf32  # a property of torch's: monkeypatch cannot restore it
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert hardware.peak_flops_with_note(cuda, torch.float32) == (494.7e12, None)
        torch.backends.cuda.matmul.allow_tf32 = False
        peak, note = hardware.peak_flops_with_note(cuda, torch.float32)
        assert peak == 66.9e12 and note is not None and "without TF32" in note
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def test_the_warmup_setting_is_validated() -> None:
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match="trainer.throughput_warmup_steps"):
        validate(compose(TINY + ["trainer.throughput_warmup_steps=-1"]))
