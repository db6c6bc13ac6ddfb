"""Measurement helpers shared by the benchmark scripts."""

from __future__ import annotations

import time
from typing import Any

from trainer.callback import Callback


class StepClock(Callback):
    """Wall time at the start of the fit and at the end of every optimizer step (add it last)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_fit_start(self, trainer: Any) -> None:
        self.times = [time.perf_counter()]

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        self.times.append(time.perf_counter())
