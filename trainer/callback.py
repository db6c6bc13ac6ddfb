"""The Callback base class, with Lightning's hook names.

The trainer is passed to every hook (it holds `model_parts`, the optimizer, `step`, `logged_metrics`),
so one signature serves single-process and pipeline-parallel runs alike. Every hook does nothing by
default: a callback overrides only what it needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from trainer.loop import Trainer


class Callback:
    """Base class of the callbacks; hooks are listed in the order a run calls them."""

    @staticmethod
    def check_config(node: Any) -> None:
        """Raise ValueError (or TypeError) for invalid options in the callback's config `node` (its
        `callbacks.NAME` node, `_target_` included). Called on the class by config validation before any
        process starts, so a bad option fails in one line before launch; the default accepts anything."""

    def on_fit_start(self, trainer: "Trainer") -> None:
        """After the model, optimizer and data are set up (and a checkpoint loaded), before step 1."""

    def on_train_batch_start(self, trainer: "Trainer", batch: Sequence[Any]) -> None:
        """Before the forward passes of one optimizer step; `batch` is this rank's micro-batches."""

    def on_before_backward(self, trainer: "Trainer", loss: torch.Tensor) -> None:
        """Before each micro-batch's backward (not called inside pipeline schedules)."""

    def on_after_backward(self, trainer: "Trainer") -> None:
        """Once per optimizer step, when every micro-batch's gradient has been accumulated."""

    def on_before_optimizer_step(self, trainer: "Trainer", optimizer: torch.optim.Optimizer) -> None:
        """After unscaling and clipping; the step so far is in trainer.step_outputs (loss, grad_norm,
        lr). Setting trainer.skip_step = True (the same decision on every rank) drops the update."""

    def on_train_batch_end(self, trainer: "Trainer", outputs: dict[str, Any]) -> None:
        """After the optimizer and schedule step; `outputs` holds loss, grad_norm, lr, skipped."""

    def on_validation_end(self, trainer: "Trainer") -> None:
        """After an evaluation; the result is in trainer.logged_metrics (val_loss, val_ppl)."""

    def on_save_checkpoint(self, trainer: "Trainer", checkpoint: dict[str, Any]) -> None:
        """Add to (or inspect) the checkpoint being written."""

    def on_load_checkpoint(self, trainer: "Trainer", checkpoint: dict[str, Any]) -> None:
        """Read back what on_save_checkpoint added."""

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        """The run is failing with `exception` (re-raised afterwards)."""

    def on_fit_end(self, trainer: "Trainer") -> None:
        """After the last step and the final evaluation."""

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what state_dict returned."""

    @property
    def state_key(self) -> str:
        """The key of this callback's state in checkpoints (as Lightning's): its class's qualified name
        by default; a callback used twice with different options should add them."""
        return type(self).__qualname__

    def resolve_directory(self, run_dir: Path | str) -> Path | None:
        """The directory checkpoints of the run in `run_dir` go to, when this callback decides it (the
        checkpoint manager); None otherwise."""
        del run_dir
        return None
