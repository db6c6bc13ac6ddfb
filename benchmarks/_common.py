"""Measurement helpers shared by the benchmark scripts."""

from __future__ import annotations

import time
from typing import Any

import torch

from trainer.callback import Callback


class StepClock(Callback):
    """Wall time at the start of the fit and at the end of every optimizer step (add it last).

    On a CUDA device the clock waits for the device first: kernels run asynchronously, so without the
    synchronize a step's end would be read when its last kernel was queued, not when it finished.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    @staticmethod
    def _now(trainer: Any) -> float:
        device = trainer.strategy.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def on_fit_start(self, trainer: Any) -> None:
        self.times = [self._now(trainer)]

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        self.times.append(self._now(trainer))
