"""Callbacks the multi-process tests point `+callbacks.NAME._target_` at (importable by the workers)."""

from __future__ import annotations

import os
from typing import Any

from trainer.callback import Callback


class FailOnRank(Callback):
    """Raise on one rank at one step, to check that the whole job ends with that rank's error."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank = rank
        self.step = step

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if trainer.strategy.rank == self.rank and trainer.step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class RecordPid(Callback):
    """Write each rank's pid, so a test can see which processes took part."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_fit_start(self, trainer: Any) -> None:
        with open(os.path.join(self.directory, f"rank{trainer.strategy.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
