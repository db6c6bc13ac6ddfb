"""The Callback base class, with Lightning's hook names, and the contracts between callbacks.

The trainer is passed to every hook (it holds `model_parts`, the optimizer, `step`, `logged_metrics`),
so one signature serves single-process and pipeline-parallel runs alike. Every hook does nothing by
default: a callback overrides only what it needs.

A callback that works with another one declares it instead of searching the trainer's list for an
object with the right attributes: it names an interface (an abstract Callback subclass such as
`CheckpointProvider`) in `Callback.requires`, config validation fails before launch when the run has no
callback implementing it, and the trainer hands the implementation over through `Callback.connect`
before `on_fit_start`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Optional, Sequence, TypeVar

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

    # ---- contracts with other callbacks ---------------------------------------------------------------
    @classmethod
    def requires(cls, node: Any) -> tuple["Requirement[Any]", ...]:
        """What this callback, configured by `node` (its `callbacks.NAME` node), needs another callback
        of the run to implement. Asked on the class by config validation, after `check_config`, which
        fails when the run's callbacks do not implement each requirement exactly once. The default needs
        nothing."""
        del node
        return ()

    def connect(self, providers: "Providers") -> None:
        """Called by the trainer once, before `on_fit_start`, with the run's callbacks: look up the
        implementations of what `requires` declared (`providers.require(REQUIREMENT)`) and keep them."""
        del providers


C = TypeVar("C", bound=Callback)


@dataclass(frozen=True)
class Requirement(Generic[C]):
    """A callback's need for another callback implementing `interface`.

    `reason` says which option needs it and `remedy` how to satisfy it; both go into the one-line error
    when the run has no implementation, or more than one (which one would it be?).
    """

    interface: type[C]
    reason: str
    remedy: str

    def problem(self, implementations: Sequence[str]) -> Optional[str]:
        """The error for a run whose callbacks implementing `interface` are `implementations` (names), or
        None when there is exactly one."""
        name = self.interface.__name__
        if not implementations:
            return f"{self.reason}, but no callback of the run is a {name}: {self.remedy}"
        if len(implementations) > 1:
            listed = ", ".join(implementations)
            return f"{self.reason}, but {len(implementations)} callbacks are {name}s ({listed}): keep one"
        return None


class MissingCallbackError(ValueError):
    """A callback's `Requirement` is not met by the run's callbacks (none, or several, implement it)."""


class Providers:
    """The run's callbacks, looked up by the interface they implement (what `Callback.connect` receives).

    The lookup is by `isinstance` on a declared interface: no attribute of another callback is probed.
    """

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self._callbacks = list(callbacks)

    def all(self, interface: type[C]) -> list[C]:
        """Every callback of the run implementing `interface`, in the run's order."""
        return [callback for callback in self._callbacks if isinstance(callback, interface)]

    def require(self, requirement: Requirement[C]) -> C:
        """The one callback implementing `requirement.interface`; MissingCallbackError when there is none
        or more than one."""
        found = self.all(requirement.interface)
        problem = requirement.problem([type(callback).__name__ for callback in found])
        if problem is not None:
            raise MissingCallbackError(problem)
        return found[0]


def connect_callbacks(callbacks: Sequence[Callback]) -> None:
    """Hand every callback the run's callbacks (`Callback.connect`); the trainer calls it before
    `on_fit_start`."""
    providers = Providers(callbacks)
    for callback in callbacks:
        callback.connect(providers)


class CheckpointProvider(Callback, ABC):
    """The interface of the callback that writes a run's checkpoints (the checkpoint manager).

    Resume asks it where the run's checkpoints are (`resolve_directory`); callbacks that restore one
    (the loss-spike stabilizer's rollback) declare `Requirement(CheckpointProvider, ...)` and ask it for
    the latest (`latest_checkpoint`), which is collective: the provider alone knows whether a save of
    its is still in flight and must be finished first.
    """

    @abstractmethod
    def resolve_directory(self, run_dir: Path | str) -> Path:
        """The directory the checkpoints of the run in `run_dir` go to."""

    @abstractmethod
    def latest_checkpoint(self, trainer: "Trainer", before_step: Optional[int] = None) -> Optional[Path]:
        """The newest complete checkpoint (of a step below `before_step` when given), or None.

        Collective: every rank calls it at the same point and gets the same answer (rank 0's listing
        decides, since a rank may see the shared file system a moment later); a save still in flight is
        finished first, so that it is listed.
        """

    def snapshot_root(self, run_dir: Path | str) -> Optional[Path]:
        """Where the run's in-memory snapshots are (trainer/checkpoint/memory.py), or None (the default)
        when it takes none; resume restores the newest of them when it is newer than the disk's."""
        return None

    def save_for_preemption(self, trainer: "Trainer") -> Optional[Path]:
        """Save the state of this step boundary now (collective, synchronous) because the run is being
        preempted (trainer/preemption.py owns the signals and calls this), and return the checkpoint; None
        (the default) lets the loop save into `resolve_directory(run_dir)` itself, in the same format."""
        return None
