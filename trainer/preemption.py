"""Preemption, owned by the loop whatever the callbacks are: a signal (a scheduler's notice, Ctrl-C) sets a
flag; at the next step boundary every rank agrees (one int32 all-reduce per step when distributed), the
state is saved (through the run's `CheckpointProvider` when one is configured, else into
`<run_dir>/checkpoints/step_<N>` in the same format, so `resume=auto` continues exactly), metrics are
flushed, and `Trainer.fit` raises `TrainingPreempted`, which the CLI turns into status.json `preempted`,
one line and exit status 75 (EX_TEMPFAIL: "try again later", what a job wrapper requeues on).

The signals are `trainer.preemption_signals` (default SIGTERM, SIGINT, SIGUSR1). The same signal again
within `REPEAT_WINDOW_S` is the same notice (Ctrl-C in a terminal reaches the launcher and its workers, and
the launcher forwards it too; SLURM's scancel signals every process of the step); later, a second signal
acts as it would without the trainer (Ctrl-C twice interrupts a save).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from trainer.callback import CheckpointProvider, Providers
from trainer.checkpoint import checkpoint_directory, save_checkpoint
from trainer.checkpoint.manifest import is_checkpoint, remove_partial_saves, step_dirname
from trainer.environment import signal_numbers

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): the run stopped early, saved, and may be started again
REPEAT_WINDOW_S = 2.0
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class TrainingPreempted(Exception):
    """The run stopped at a step boundary on a preemption signal, after saving (exit status 75, status.json
    `preempted`). Not an error: `resume=auto` in the same run directory continues exactly."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(f"preempted by {signal_name} at step {step}: checkpoint {checkpoint} saved, metrics "
                         "flushed; resume=auto in this run directory continues from it")


# Every signal a PreemptionSignals handler took in this process (the launched worker asks after training
# ended in an error whether its launcher already stopped it: trainer.launch.worker_main).
SIGNALS_TAKEN: set[int] = set()


class PreemptionSignals:
    """The flag the handlers set; installed from the main thread only (elsewhere: nothing is watched)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.signals = signal_numbers(names)
        self.received: Optional[signal.Signals] = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        SIGNALS_TAKEN.add(signum)
        if self.received is None:
            self.received, self._first_at = signal.Signals(signum), time.monotonic()
            return
        if signum == self.received and time.monotonic() - self._first_at < REPEAT_WINDOW_S:
            return  # the same notice, delivered twice (terminal and launcher, scancel)
        # A second signal acts as usual: the previous handler takes it over and gets this one.
        previous = self._previous.pop(signum, signal.SIG_DFL)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    def agreed(self, device: torch.device) -> Optional[str]:
        """The signal's name when any rank received one (collective when distributed: one all-reduce)."""
        received = self.received is not None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(received)], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if not bool(flag.item()):
                return None
            return self.received.name if self.received is not None else "a signal on another rank"
        return self.received.name if self.received is not None else None


def save_on_preemption(trainer: "Trainer") -> Path:
    """Save the state of this step boundary (collective): through the checkpoint provider when the run has
    one (its retention applies), else into the run's checkpoint directory. The metrics are flushed first
    (save_checkpoint does it before the commit)."""
    providers = Providers(trainer.callbacks).all(CheckpointProvider)
    if providers:
        path = providers[0].save_for_preemption(trainer)
        if path is not None:
            return path
    directory = checkpoint_directory(trainer)
    path = directory / step_dirname(trainer.step)
    if trainer.strategy.broadcast_object(is_checkpoint(path)):
        return path
    if trainer.is_global_zero and directory.is_dir():
        for leftover in remove_partial_saves(directory):
            log.warning(f"removed an incomplete save (a process stopped while writing it): {leftover}")
    save_checkpoint(trainer, path, reason="signal")
    if trainer.is_global_zero:
        log.info(f"checkpoint saved: {path} (signal)")
    return path
