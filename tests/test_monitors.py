"""Throughput and memory monitors: MFU against the measured CPU peak in the progress bar and
metrics.csv, the monitors' figures consistent with the loop's, and every logger receiving them."""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path

import pytest
import torch

from trainer.plugins.callbacks.monitors import busy_seconds
from trainer.config import compose
from trainer.hardware import measure_matmul_flops
from trainer.run import train

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
        "trainer.seq_len=32", "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.max_steps=5",
        "trainer.log_every=2", "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=1",
        "data.max_bytes=1000000"]
MIB = 2**20


@pytest.mark.slow
def test_mfu_against_the_measured_cpu_peak_in_progress_bar_metrics_and_every_logger(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainer")
    # default callbacks (progress bar, throughput and memory monitors); csv and tensorboard loggers
    summary = train(compose(TINY + ["logger=[csv,tensorboard]", "trainer.peak_flops=null"]), tmp_path)

    # no trainer.peak_flops on CPU: the peak is this process's measured matmul peak (cached per process)
    peak = summary["peak_flops_per_device"]
    assert peak == measure_matmul_flops("cpu", torch.float32)

    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 4, 5]  # one row per logged step, the last one with val_loss
    assert rows[-1]["val_loss"]
    tokens_per_step, seq_len = 8 * 32, 32
    for row in rows:
        value = {k: float(v) for k, v in row.items() if v != ""}
        # the loop's MFU: model FLOP/s over the measured peak
        assert value["mfu"] == pytest.approx(value["tokens_per_s"] * summary["flops_per_token"] / peak, rel=1e-9)
        # the throughput monitor measured the same interval: its FLOP/s and samples/s agree with the loop
        assert value["flops_per_s"] / peak == pytest.approx(value["mfu"], rel=1e-6)
        assert value["samples_per_s"] * seq_len == pytest.approx(value["tokens_per_s"], rel=1e-6)
        # the step-time breakdown: its phases are part of the interval's wall-clock time per step (which
        # also holds the callbacks and logging)
        assert value["data_s"] > 0 and value["forward_backward_s"] > 0 and value["optimizer_s"] > 0
        assert value["data_s"] + value["forward_backward_s"] + value["optimizer_s"] < tokens_per_step / value["tokens_per_s"]
        assert value["peak_memory_mib/rank0"] == value["peak_memory_mib/max"] > 0
        assert value["grad_norm"] > 0 and value["lr"] > 0
        assert "comm_s" not in value  # profiling is off by default
    assert float(rows[-1]["peak_memory_mib/rank0"]) <= summary["peak_memory_bytes_per_rank"][0] / MIB

    # the progress bar (log lines off a terminal) shows the same MFU
    shown = [float(m) for m in re.findall(r"step \d+/5 \|.*\| mfu ([\d.]+)% \|", caplog.text)]
    assert shown == [round(100 * float(r["mfu"]), 1) for r in rows]

    # the tensorboard logger received the loop's and the monitors' metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"mfu", "tokens_per_s", "samples_per_s", "flops_per_s", "data_s", "forward_backward_s", "optimizer_s",
            "peak_memory_mib/rank0", "grad_norm", "lr", "train_loss", "val_loss"} <= tags
    assert [e.step for e in events.Scalars("flops_per_s")] == [2, 4, 5]
    assert [e.value for e in events.Scalars("mfu")] == pytest.approx([float(r["mfu"]) for r in rows], rel=1e-6)


def test_busy_seconds_is_the_union_of_overlapping_intervals() -> None:
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert busy_seconds([(3.0, 4.0), (0.0, 10.0), (2.0, 3.0)]) == pytest.approx(10.0)


def test_comm_every_must_not_be_negative() -> None:
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match="callbacks.throughput: comm_every must be >= 0"):
        validate(compose(TINY + ["callbacks.throughput.comm_every=-1"]))


def test_throughput_monitor_survives_a_rollback_to_an_earlier_step() -> None:
    """A rollback (the loss-spike stabilizer) restores an earlier step and train time: the interval
    restarts there instead of failing on counters that went backwards."""
    from types import SimpleNamespace

    from trainer.plugins.callbacks.monitors import ThroughputMonitor

    logged: list[dict[str, float]] = []
    trainer = SimpleNamespace(step=0, train_time_s=0.0, tokens_seen=0, peak_flops=1e9, flops_per_token=100,
                              config=SimpleNamespace(seq_len=4), strategy=SimpleNamespace(world_size=1),
                              is_global_zero=True, step_timings={"data_s": 0.1, "forward_backward_s": 0.5,
                                                                 "optimizer_s": 0.4})
    trainer.log = logged.append
    monitor = ThroughputMonitor()
    monitor.on_fit_start(trainer)

    def step(to: int, train_time: float) -> None:
        trainer.step, trainer.train_time_s, trainer.tokens_seen = to, train_time, to * 8
        trainer.logged_metrics = {"step": to, "train_loss": 1.0}
        monitor.on_train_batch_end(trainer, {})

    step(1, 1.0)
    step(2, 2.0)
    step(1, 1.0)  # rolled back to the checkpoint of step 1
    step(2, 1.5)
    assert [row.get("samples_per_s") for row in logged] == [2.0, 2.0, None, 4.0]
    assert logged[-1]["flops_per_s"] == 8 * 100 / 0.5 and logged[2]["forward_backward_s"] == 0.5


def test_metrics_csv_redoes_the_rows_of_steps_a_rollback_replays(tmp_path: Path) -> None:
    """A stabilizer rollback replays steps with smaller numbers than the last logged one: their earlier rows
    go, written or still buffered, so the file holds each step once (as after a resume)."""
    import csv

    from trainer.plugins.loggers import csv_logger

    logger = csv_logger(tmp_path, flush_logs_every_n_steps=2)
    for step in range(1, 6):
        logger.log_metrics({"train_loss": float(step)}, step=step)
    logger.log_metrics({"val_loss": 9.0}, step=5)
    for step in range(3, 7):  # rolled back to the step-2 checkpoint
        logger.log_metrics({"train_loss": 10.0 + step}, step=step)
    logger.finalize("success")
    with open(tmp_path / "metrics.csv") as f:
        rows = [(int(r["step"]), float(r["train_loss"]), r.get("val_loss") or None) for r in csv.DictReader(f)]
    assert rows == [(1, 1.0, None), (2, 2.0, None), (3, 13.0, None), (4, 14.0, None), (5, 15.0, None), (6, 16.0, None)]


def test_only_the_rank_that_logs_builds_the_throughput_meter() -> None:
    # Lightning's Throughput costs a 3 s import: the ranks that log nothing (all but rank 0) never build it.
    from types import SimpleNamespace

    from trainer.plugins.callbacks.monitors import ThroughputMonitor

    built = []
    for is_global_zero in (False, True):
        monitor = ThroughputMonitor()
        trainer = SimpleNamespace(is_global_zero=is_global_zero, peak_flops=1e9, strategy=SimpleNamespace(world_size=2),
                                  step=0, train_time_s=0.0, tokens_seen=0, config=SimpleNamespace(seq_len=32))
        monitor.on_fit_start(trainer)  # type: ignore[arg-type]
        built.append(monitor._throughput is not None)
    assert built == [False, True]
