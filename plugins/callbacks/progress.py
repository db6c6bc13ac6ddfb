"""Rank-0 progress reporting: loss, learning rate, tokens/s, MFU and the time left."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.callback import Callback

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class ProgressBar(Callback):
    """A live tqdm bar on a terminal; one log line per logged step otherwise (CI logs, files)."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._start = 0.0

    def on_fit_start(self, trainer: "Trainer") -> None:
        if not trainer.is_global_zero:
            return
        self._start = time.perf_counter()
        if sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=trainer.total_steps, initial=trainer.step, dynamic_ncols=True, unit="step")

    def on_train_batch_end(self, trainer: "Trainer", outputs: dict[str, Any]) -> None:
        if not trainer.is_global_zero:
            return
        if self._bar is not None:
            self._bar.update(trainer.step - self._bar.n)
        metrics = trainer.logged_metrics
        if metrics.get("step") != trainer.step:
            return
        postfix = {
            "loss": f"{metrics['train_loss']:.4f}",
            "lr": f"{metrics['lr']:.2e}",
            "tok/s": f"{metrics['tokens_per_s']:,.0f}",
            "mfu": f"{100 * metrics['mfu']:.1f}%",
        }
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            return
        elapsed = time.perf_counter() - self._start
        done = max(trainer.step - trainer.start_step, 1)
        eta = elapsed / done * (trainer.total_steps - trainer.step)
        fields = " | ".join(f"{k} {v}" for k, v in postfix.items())
        log.info(f"step {trainer.step}/{trainer.total_steps} | {fields} | eta {format_duration(eta)}")

    def on_validation_end(self, trainer: "Trainer") -> None:
        if not trainer.is_global_zero:
            return
        message = (f"step {trainer.step}: val_loss {trainer.logged_metrics['val_loss']:.4f} "
                   f"(ppl {trainer.logged_metrics['val_ppl']:.2f})")
        if self._bar is not None:
            self._bar.write(message)
        else:
            log.info(message)

    def on_fit_end(self, trainer: "Trainer") -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclass
class ProgressBarConfig:
    """Rank-0 progress: a live bar on a terminal, one line per logged step otherwise."""

    _target_: str = "trainer.plugins.callbacks.ProgressBar"
