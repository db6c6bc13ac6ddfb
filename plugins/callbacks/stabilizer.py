"""The loss-spike stabilizer: detect a bad step before it is applied, agree on it across ranks, act.

Detection (each rank, on its own values, before the optimizer step):
  - a loss spike: the loss is `loss_ratio` times the running median (or mean) of the last `window`
    accepted losses, or `loss_zscore` standard deviations above their mean;
  - a gradient-norm spike: the same two tests on the global gradient norm;
  - NaN/Inf in the loss or the gradients (a non-finite global gradient norm means a non-finite gradient);
  - with `aux_loss_ratio` / `aux_loss_zscore` (off by default), the same tests on a Mixture of Experts'
    load-balancing loss (`moe/aux_loss`, the mean over layers): a jump means the routing is collapsing.
Nothing is declared during the warm-up (`warmup_steps` accepted values in the history): early losses
fall too fast for a running statistic to mean anything. Only accepted steps enter the history, so a
spike does not raise the bar for the next one.

Agreement: every step one flag is max-reduced over the whole world, so a spike seen by any rank is an
event for every rank (a data-parallel rank stepping alone would silently desynchronize the replicas); on
an event the ranks exchange what each saw, so every rank records the same event and takes the same action.

Actions, escalating: the n-th event within `escalation_window` step attempts takes `actions[n-1]` (the
last one repeats). Every action drops the step's update (`trainer.skip_step`); `cooldown` also multiplies
the learning rate of every optimizer group by `cooldown_factor` for the next `cooldown_steps` applied
steps; `rollback` restores the run's latest complete checkpoint from before the spike (asked of its
`CheckpointProvider`, the checkpoint manager, which the stabilizer declares it needs when rollback is
among its actions: validation refuses a config without one) and skips the data window that caused it
(the spiking global batch and the `rollback_skip_batches - 1` before it; a batch is named by its absolute
position in the data order, the same on every rank and world size); `abort` ends the run with
`TrainingDiverged`, as does exceeding `max_events` events in all.

The ledger (events and skipped batch positions) is this callback's `state_dict`, saved with checkpoints;
on resume the skipped positions are handed to the data loader again. Every event is logged through
`trainer.log` (`spike_value`, `spike_action`, `spike_events`), the python logger and, on rank 0,
`<run_dir>/stabilizer_events.jsonl`. A rollback's metrics go with the first step completed after it: the
rows of the steps it abandons are redone (metrics.csv holds every step once, as after a resume).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from trainer.loop import TrainingDiverged  # noqa: F401 - raised here, re-exported
from trainer.callback import Callback, CheckpointProvider, Providers, Requirement

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")

ACTIONS = ("skip", "cooldown", "rollback", "abort")
# Numeric codes of the actions in the logged metrics (loggers take numbers only).
ACTION_CODES = {"skip": 1, "cooldown": 2, "rollback": 3, "abort": 4}
STATISTICS = ("median", "mean")
# What a rank can detect, in the order of the max-reduced flag vector.
KINDS = ("nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_norm_spike", "aux_loss_spike")
# A z-score is measured against at least this fraction of the mean: over a flat history, rounding noise
# would otherwise be many standard deviations away.
MIN_RELATIVE_STD = 1e-3
# What the rollback action needs from the run's other callbacks.
ROLLBACK_NEEDS: Requirement[CheckpointProvider] = Requirement(
    CheckpointProvider,
    reason="actions include rollback, which restores the latest checkpoint",
    remedy="add the checkpoint manager (callbacks=[default,stabilizer,checkpoint]) or drop rollback from "
           "callbacks.stabilizer.actions")


@dataclass
class Detection:
    """The outcome of one detector test: what fired, the value, and what it was compared against."""

    value: float
    reference: float = math.nan  # running centre (ratio test) or mean (z-score test)
    score: float = math.nan  # the ratio or the z-score that exceeded its threshold
    test: str = ""  # "ratio" or "zscore"


class SpikeDetector:
    """Running-window spike test of one scalar series (the loss, or the gradient norm).

    `check` compares a new value with the last `window` accepted values; `accept` appends it. A value
    is a spike when value / centre > `ratio` (centre: the median or the mean) or when
    (value - mean) / std > `zscore`; a threshold of 0 disables its test. Below `warmup` values in the
    history nothing is a spike.
    """

    def __init__(self, window: int, warmup: int, statistic: str = "median", ratio: float = 0.0,
                 zscore: float = 0.0) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not 0 <= warmup <= window:
            raise ValueError(f"warmup_steps must be in [0, window={window}], got {warmup}")
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
        if ratio < 0 or (0 < ratio <= 1):
            raise ValueError(f"a ratio threshold must be > 1 (or 0 to disable), got {ratio}")
        if zscore < 0:
            raise ValueError(f"a z-score threshold must be > 0 (or 0 to disable), got {zscore}")
        self.window = window
        self.warmup = max(warmup, 2)  # a standard deviation needs two values
        self.statistic = statistic
        self.ratio = ratio
        self.zscore = zscore
        self.history: list[float] = []

    @property
    def warmed_up(self) -> bool:
        return len(self.history) >= self.warmup

    def centre(self) -> float:
        if self.statistic == "median":
            return statistics.median(self.history)
        return statistics.fmean(self.history)

    def check(self, value: float) -> Detection | None:
        """The test that `value` fails, or None (also during the warm-up)."""
        if not self.warmed_up:
            return None
        if self.ratio > 0:
            centre = self.centre()
            if centre > 0 and value / centre > self.ratio:
                return Detection(value, centre, value / centre, "ratio")
        if self.zscore > 0:
            mean = statistics.fmean(self.history)
            std = max(statistics.stdev(self.history), MIN_RELATIVE_STD * abs(mean))
            if std > 0 and (value - mean) / std > self.zscore:
                return Detection(value, mean, (value - mean) / std, "zscore")
        return None

    def accept(self, value: float) -> None:
        self.history.append(float(value))
        del self.history[:-self.window]


class LossSpikeStabilizer(Callback):
    """Skips, cools down, rolls back or aborts on loss spikes, gradient-norm spikes and NaN/Inf.

    See the module docstring for the detectors and actions; the options are those of
    `LossSpikeStabilizerConfig`.
    """

    def __init__(
        self,
        window: int = 50,
        warmup_steps: int = 20,
        statistic: str = "median",
        loss_ratio: float = 2.0,
        loss_zscore: float = 6.0,
        grad_norm_ratio: float = 5.0,
        grad_norm_zscore: float = 0.0,
        check_nonfinite: bool = True,
        aux_loss_ratio: float = 0.0,
        aux_loss_zscore: float = 0.0,
        actions: tuple[str, ...] | list[str] = ("skip", "cooldown", "rollback"),
        escalation_window: int = 100,
        cooldown_steps: int = 20,
        cooldown_factor: float = 0.1,
        rollback_skip_batches: int = 1,
        max_events: Optional[int] = 20,
    ) -> None:
        actions = list(actions)
        unknown = [a for a in actions if a not in ACTIONS]
        if not actions or unknown:
            raise ValueError(f"actions must be a non-empty list of {', '.join(ACTIONS)}; got {actions}")
        if escalation_window < 1:
            raise ValueError(f"escalation_window must be >= 1, got {escalation_window}")
        if cooldown_steps < 1 or not 0 < cooldown_factor <= 1:
            raise ValueError(f"cooldown needs cooldown_steps >= 1 and 0 < cooldown_factor <= 1, got "
                             f"{cooldown_steps} and {cooldown_factor}")
        if rollback_skip_batches < 1:
            raise ValueError(f"rollback_skip_batches must be >= 1, got {rollback_skip_batches}")
        if max_events is not None and max_events < 0:
            raise ValueError(f"max_events must be >= 0 or null, got {max_events}")
        self.loss_detector = SpikeDetector(window, warmup_steps, statistic, loss_ratio, loss_zscore)
        self.grad_norm_detector = SpikeDetector(window, warmup_steps, statistic, grad_norm_ratio, grad_norm_zscore)
        self.aux_loss_detector = SpikeDetector(window, warmup_steps, statistic, aux_loss_ratio, aux_loss_zscore)
        self.check_nonfinite = check_nonfinite
        self.actions = actions
        self.escalation_window = escalation_window
        self.cooldown_steps = cooldown_steps
        self.cooldown_factor = cooldown_factor
        self.rollback_skip_batches = rollback_skip_batches
        self.max_events = max_events

        # The ledger: every event (plain values, checkpoint-safe) and the global batch positions the
        # data loader must never return again.
        self.events: list[dict[str, Any]] = []
        self.skipped_batches: set[int] = set()
        # Step attempts so far; unlike trainer.step it never goes back (a rollback rewinds the step),
        # so the escalation window stays meaningful across rollbacks.
        self.attempts = 0
        self.cooldown_left = 0
        self._pending: dict[str, Any] | None = None  # this step's event, acted on after the loop's step
        self._after_rollback: dict[str, float] | None = None  # a rollback's metrics, for the next step
        self._cooled: list[tuple[float, float]] = []  # (scheduled lr, cooled lr) per optimizer group
        self._trainer: Trainer | None = None
        self._checkpoints: CheckpointProvider | None = None  # connected by the trainer when rollback is on

    @staticmethod
    def check_config(node: Any) -> None:
        """Raise ValueError for invalid options (called by trainer.config.validate before launch)."""
        options = {k: v for k, v in dict(node).items() if not str(k).startswith("_")}
        LossSpikeStabilizer(**options)

    @classmethod
    def requires(cls, node: Any) -> tuple[Requirement[Any], ...]:
        """Rollback restores a checkpoint: it needs the run's CheckpointProvider."""
        actions = node.get("actions", LossSpikeStabilizerConfig().actions)
        return (ROLLBACK_NEEDS,) if "rollback" in list(actions) else ()

    def connect(self, providers: Providers) -> None:
        """Keep the run's checkpoint provider when rollback is among the actions (MissingCallbackError
        without one: a rollback could not happen)."""
        self._checkpoints = providers.require(ROLLBACK_NEEDS) if "rollback" in self.actions else None

    # ---- hooks ------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: "Trainer") -> None:
        self._trainer = trainer
        self._apply_ledger()

    def on_before_optimizer_step(self, trainer: "Trainer", optimizer: torch.optim.Optimizer) -> None:
        self.attempts += 1
        outputs = trainer.step_outputs
        loss, grad_norm = torch.stack([outputs["loss"].detach().float().reshape(()),
                                       torch.as_tensor(outputs["grad_norm"]).detach().float().reshape(())
                                       .to(outputs["loss"].device)]).tolist()
        # MoE: the step's load-balancing loss, the same on every rank (collect_moe_stats averaged it)
        aux = float(outputs.get("moe", {}).get("moe/aux_loss", math.nan))
        found = self._detect(trainer, loss, grad_norm, aux)
        if not found:
            self._accept(loss, grad_norm, aux)
            self._cool_down(trainer, optimizer)
            return
        trainer.skip_step = True
        self._pending = self._record(trainer, found)

    def on_train_batch_end(self, trainer: "Trainer", outputs: dict[str, Any]) -> None:
        self._restore_lr(trainer.optimizer)
        if self._after_rollback is not None:
            trainer.log(self._after_rollback)
            self._after_rollback = None
        event, self._pending = self._pending, None
        if event is None:
            return
        checkpoint = None
        if event["action"] == "rollback":
            checkpoint = self._latest_checkpoint(trainer, before_step=event["step"])
            if checkpoint is None:
                event["action"] = "skip"
                event["note"] = "no complete checkpoint to roll back to"
        metrics = {"spike_value": float(event["value"]), "spike_action": float(ACTION_CODES[event["action"]]),
                   "spike_events": float(len(self.events))}
        if checkpoint is None:
            trainer.log(metrics)  # at the step that spiked
        else:
            # the steps after the checkpoint are replayed (their metrics rows redone): the rollback's
            # metrics go with the first step completed after it
            self._rollback(trainer, event, checkpoint)
            self._after_rollback = metrics
        self._report(trainer, event)
        if event["action"] == "abort":
            too_many = self.max_events is not None and len(self.events) > self.max_events
            reason = (f"the event count {len(self.events)} exceeds max_events={self.max_events}" if too_many
                      else f"event {len(self.events)} escalated to abort")
            raise TrainingDiverged(f"loss-spike stabilizer gave up at step {event['step']}: {reason}; last: "
                                   f"{describe(event)} (the events are listed in the checkpoint's stabilizer "
                                   f"state and in stabilizer_events.jsonl)")

    # ---- detection and agreement ------------------------------------------------------------------------
    def _detect(self, trainer: "Trainer", loss: float, grad_norm: float,
                aux_loss: float = math.nan) -> dict[str, dict[str, Any]]:
        """What any rank found, the same on every rank: {kind: detection of the lowest such rank, plus
        the list of ranks that saw it}; empty when no rank found anything."""
        local: dict[str, Detection] = {}
        # With a loss scaler (fp16), overflowing gradients are routine: the precision plugin skips
        # that step and lowers the scale itself, so they are not events here.
        scaler_owns_overflow = trainer.precision.skips_nonfinite_steps
        if self.check_nonfinite and not math.isfinite(loss):
            local["nonfinite_loss"] = Detection(loss)
        if self.check_nonfinite and not math.isfinite(grad_norm) and not scaler_owns_overflow:
            local["nonfinite_grad"] = Detection(grad_norm)
        if math.isfinite(loss) and (spike := self.loss_detector.check(loss)) is not None:
            local["loss_spike"] = spike
        if math.isfinite(grad_norm) and (spike := self.grad_norm_detector.check(grad_norm)) is not None:
            local["grad_norm_spike"] = spike
        if math.isfinite(aux_loss) and (spike := self.aux_loss_detector.check(aux_loss)) is not None:
            local["aux_loss_spike"] = spike

        flagged = any(kind in local for kind in KINDS)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # One small max-reduction a step: a spike on any rank is an event for all.
            flag = torch.tensor([1.0 if flagged else 0.0], device=trainer.strategy.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            flagged = bool(flag.item())
        if not flagged:
            return {}
        # An event is rare: every rank can afford to learn what each rank saw, so all record the same.
        seen = trainer.strategy.all_gather_object({kind: asdict(d) for kind, d in local.items()})
        found: dict[str, dict[str, Any]] = {}
        for kind in KINDS:
            ranks = [rank for rank, detections in enumerate(seen) if kind in detections]
            if ranks:
                found[kind] = {**seen[ranks[0]][kind], "ranks": ranks}
        return found

    def _accept(self, loss: float, grad_norm: float, aux_loss: float = math.nan) -> None:
        if math.isfinite(loss):
            self.loss_detector.accept(loss)
        if math.isfinite(grad_norm):
            self.grad_norm_detector.accept(grad_norm)
        if math.isfinite(aux_loss):
            self.aux_loss_detector.accept(aux_loss)

    # ---- actions ----------------------------------------------------------------------------------------
    def _record(self, trainer: "Trainer", found: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Enter the event in the ledger (so a checkpoint written from now on holds it) and pick its action."""
        recent = [e for e in self.events if e["attempt"] > self.attempts - self.escalation_window]
        action = self.actions[min(len(recent) + 1, len(self.actions)) - 1]
        if self.max_events is not None and len(self.events) + 1 > self.max_events:
            action = "abort"
        kinds = list(found)
        event: dict[str, Any] = {
            "step": trainer.step + 1,  # the step this update would have completed, as the loop logs it
            "attempt": self.attempts,
            "batch": trainer.train_loader.last_position,  # absolute global batch index
            "action": action,
            "kinds": kinds,
            **found[kinds[0]],  # value, reference, score, test, ranks of the first kind
            "detections": found,
        }
        self.events.append(event)
        if action == "cooldown":
            self.cooldown_left = self.cooldown_steps
        return event

    def _cool_down(self, trainer: "Trainer", optimizer: torch.optim.Optimizer) -> None:
        """Multiply every group's LR for this applied step; the schedule's value comes back after it."""
        if self.cooldown_left <= 0:
            return
        self.cooldown_left -= 1
        self._cooled = []
        for group in optimizer.param_groups:
            cooled = group["lr"] * self.cooldown_factor
            self._cooled.append((group["lr"], cooled))
            group["lr"] = cooled
        trainer.step_outputs["lr"] = optimizer.param_groups[0]["lr"]  # the LR this update really used

    def _restore_lr(self, optimizer: torch.optim.Optimizer) -> None:
        # The trainer's LambdaLR recomputes each LR from the schedule after the step; a group whose LR
        # nobody recomputed still holds the cooled value, and gets the scheduled one back.
        for group, (scheduled, cooled) in zip(optimizer.param_groups, self._cooled):
            if group["lr"] == cooled:
                group["lr"] = scheduled
        self._cooled = []

    def _rollback(self, trainer: "Trainer", event: dict[str, Any], path: Path) -> None:
        """Restore the checkpoint at `path`, keep the ledger, and skip the spike's data window."""
        if event["batch"] is not None:
            last = int(event["batch"])
            window = range(max(0, last - self.rollback_skip_batches + 1), last + 1)
            self.skipped_batches.update(window)
            event["skipped_batches"] = [window.start, window.stop - 1]
        from trainer.checkpoint import load_checkpoint

        # The checkpoint holds this callback's older state: keep its loss/grad-norm history (the
        # statistics of the restored model), but not its ledger, which would forget this very event.
        # (load_state_dict replaces these objects rather than changing them.)
        ledger = (self.events, self.skipped_batches, self.attempts, self.cooldown_left)
        load_checkpoint(trainer, path)
        self.events, self.skipped_batches, self.attempts, self.cooldown_left = ledger
        event["rolled_back_to"] = {"path": str(path), "step": trainer.step}
        self._apply_ledger()

    def _latest_checkpoint(self, trainer: "Trainer", before_step: int) -> Optional[Path]:
        """The provider's latest complete checkpoint saved before `before_step` (one the manager wrote at
        the spike's own step already lies past the spiking batch); collective, the same on every rank."""
        if self._checkpoints is None:
            raise RuntimeError("the stabilizer rolls back, but was not connected to a checkpoint provider "
                               "(Trainer.fit connects the callbacks before on_fit_start)")
        return self._checkpoints.latest_checkpoint(trainer, before_step=before_step)

    def _apply_ledger(self) -> None:
        if self._trainer is not None and self.skipped_batches:
            self._trainer.train_loader.skip(self.skipped_batches)

    def _report(self, trainer: "Trainer", event: dict[str, Any]) -> None:
        if not trainer.is_global_zero:
            return
        log.warning(f"loss-spike stabilizer: {describe(event)}")
        with open(trainer.run_dir / "stabilizer_events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")

    # ---- checkpointing ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ledger, the escalation counters and the running histories, as plain values.

        The ledger and counters are the same on every rank. The loss history is this rank's own (each
        rank tests its local loss); checkpoints keep one copy of callback states, so after a resume every
        rank starts from rank 0's window, a sample of the same loss distribution.
        """
        return {
            "events": copy.deepcopy(self.events),
            "skipped_batches": sorted(self.skipped_batches),
            "attempts": self.attempts,
            "cooldown_left": self.cooldown_left,
            "loss_history": list(self.loss_detector.history),
            "grad_norm_history": list(self.grad_norm_detector.history),
            "aux_loss_history": list(self.aux_loss_detector.history),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = copy.deepcopy(list(state_dict.get("events", [])))
        self.skipped_batches = {int(p) for p in state_dict.get("skipped_batches", [])}
        self.attempts = int(state_dict.get("attempts", 0))
        self.cooldown_left = int(state_dict.get("cooldown_left", 0))
        self.loss_detector.history = [float(v) for v in state_dict.get("loss_history", [])][-self.loss_detector.window:]
        self.grad_norm_detector.history = [
            float(v) for v in state_dict.get("grad_norm_history", [])][-self.grad_norm_detector.window:]
        self.aux_loss_detector.history = [
            float(v) for v in state_dict.get("aux_loss_history", [])][-self.aux_loss_detector.window:]
        self._apply_ledger()  # the loader honours the restored ledger (a resume, or a rollback)


def describe(event: dict[str, Any]) -> str:
    """One line: step, what was seen (value against its reference), and the action taken."""
    def seen(kind: str) -> str:
        ranks = event.get("detections", {}).get(kind, {}).get("ranks", [])
        return f"{kind} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks else kind

    kinds = ", ".join(seen(kind) for kind in event["kinds"])
    value = f"{event['value']:.4g}"
    if event.get("test") == "ratio":
        value += f" = {event['score']:.2f} x the running centre {event['reference']:.4g}"
    elif event.get("test") == "zscore":
        value += f" (z = {event['score']:.1f} over the running mean {event['reference']:.4g})"
    action = event["action"]
    if "rolled_back_to" in event:
        action += f" to step {event['rolled_back_to']['step']}"
    if "skipped_batches" in event:
        first, last = event["skipped_batches"]
        action += f", skipping global batches {first}..{last}"
    if "note" in event:
        action += f" ({event['note']})"
    return f"step {event['step']}: {kinds}: {value}; action {action}"


@dataclass
class LossSpikeStabilizerConfig:
    """Schema of `callbacks.stabilizer`: the loss-spike stabilizer (plugins/callbacks/stabilizer.py)."""

    _target_: str = "trainer.plugins.callbacks.LossSpikeStabilizer"
    # Accepted steps the running statistics are taken over.
    window: int = 50
    # No spike is declared before this many accepted steps are in the history (early losses fall fast).
    warmup_steps: int = 20
    # Running centre of the ratio tests: median (robust to outliers in the window) or mean.
    statistic: str = "median"
    # A loss above loss_ratio x the running centre is a spike (0 disables the test).
    loss_ratio: float = 2.0
    # A loss more than loss_zscore standard deviations above the running mean is a spike (0 disables).
    loss_zscore: float = 6.0
    # The same two tests on the global gradient norm (before clipping).
    grad_norm_ratio: float = 5.0
    grad_norm_zscore: float = 0.0
    # NaN/Inf in the loss or the gradients is an event (gradient overflow is left to a loss scaler).
    check_nonfinite: bool = True
    # The same two tests on a Mixture of Experts' load-balancing loss (moe/aux_loss); 0 disables (default).
    aux_loss_ratio: float = 0.0
    aux_loss_zscore: float = 0.0
    # The escalation ladder: the n-th event within escalation_window step attempts takes actions[n-1],
    # the last one repeating; skip | cooldown | rollback | abort (every action drops the step's update).
    actions: list[str] = field(default_factory=lambda: ["skip", "cooldown", "rollback"])
    escalation_window: int = 100
    # cooldown: the LR is multiplied by cooldown_factor for the next cooldown_steps applied steps.
    cooldown_steps: int = 20
    cooldown_factor: float = 0.1
    # rollback: global batches skipped, ending with the one that spiked (PaLM skipped 200-500).
    rollback_skip_batches: int = 1
    # Abort when the run has more events than this (null: never for the count alone).
    max_events: Optional[int] = 20
