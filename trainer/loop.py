"""The training loop: Lightning-style `Trainer.fit`, short enough to read top to bottom.

Everything that depends on the topology (how the forward/backward runs, how losses and norms are
reduced) is the strategy's; the number format is the precision plugin's, which the strategy owns and
calls. The loop only sequences the strategy's hooks and the callbacks, and reports.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from trainer.callback import Callback, connect_callbacks
from trainer.config.schema import TrainerConfig
from trainer.data.loader import SourceValidation, TrainLoader
from trainer.interfaces.precision import Precision
from trainer.interfaces.strategy import Strategy
from trainer.hardware import peak_memory_bytes
from trainer.memory import describe_state_bytes, state_bytes
from trainer.models import family_of
from trainer.models.qk_clip import QKClip
from trainer.preemption import PreemptionSignals, TrainingPreempted, save_on_preemption
from trainer.throughput import ThroughputMeter

log = logging.getLogger("trainer")
MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class TrainingDiverged(RuntimeError):
    """The run stopped because training diverged: `trainer.max_nonfinite_steps` steps in a row with a
    non-finite gradient norm, or the loss-spike stabilizer gave up (exit status 4, status.json `diverged`)."""


class Trainer:
    """Runs optimizer steps until max_steps/max_tokens, validating and logging on the way."""

    def __init__(
        self,
        *,
        config: TrainerConfig,
        strategy: Strategy,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        train_loader: TrainLoader,
        val_set: MicroBatches | SourceValidation,
        total_steps: int,
        tokens_per_step: int,
        num_params: int,
        flops_per_token: int,
        peak_flops: float,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Any] = (),
        run_dir: Path = Path("."),
        num_active_params: int | None = None,
        qk_clip: QKClip | None = None,
    ) -> None:
        self.config = config
        self.strategy = strategy
        self.model_parts = model_parts
        self.optimizer = optimizer  # built by the strategy, which also handed it to the precision plugin
        self.scheduler = scheduler
        if not isinstance(train_loader, TrainLoader):
            # the loop checkpoints its position and the stabilizer skips batches: a plain iterator cannot
            raise TypeError(f"train_loader must be a trainer.data.TrainLoader, got {type(train_loader).__name__}")
        self.train_loader = train_loader
        self.model_family = family_of(model_parts[0])  # its per-step hooks (router statistics, bias updates)
        # QK-clip (MuonClip): the attention logits' per-head maxima of each step, clipped after its update
        self.qk_clip = qk_clip
        self.val_set = val_set
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.num_params = num_params  # of the whole model, whatever this rank holds
        # used per token (a Mixture of Experts uses top_k of n_experts experts); = num_params when dense
        self.num_active_params = num_params if num_active_params is None else num_active_params
        self.flops_per_token = flops_per_token
        # Per device, fixed for the run: a run that measures above it reports MFU above 1 (and one warning).
        self.peak_flops = peak_flops
        self._peak_warned = False
        self.callbacks = list(callbacks)
        self.loggers = list(loggers)
        self.run_dir = run_dir  # shared by all ranks

        self.step = 0  # training steps taken, skipped updates included (restored by a checkpoint)
        self.optimizer_steps = 0  # of which the optimizer really updated the weights
        self.start_step = 0
        self.tokens_seen = 0
        self.logged_metrics: dict[str, float] = {}
        self.val_history: list[tuple[int, float]] = []
        self.last_train_loss = math.nan
        self.state_bytes: dict[str, int] | None = None
        # The time throughput is measured over (trainer/throughput.py): wall-clock between logged steps,
        # read after the device has finished them, validation and checkpoints left out.
        self.throughput_meter = ThroughputMeter(config.throughput_warmup_steps,
                                                synchronize=lambda: self.strategy.synchronize())
        # Per-step scratch shared with callbacks: the step's outputs before the optimizer step, the
        # veto flag, and the wall time of each phase (data, forward_backward, optimizer).
        self.step_outputs: dict[str, Any] = {}
        self.skip_step = False
        self.nonfinite_steps = 0  # consecutive steps with a non-finite gradient norm (never applied)
        self.step_timings: dict[str, float] = {}
        # Set by a callback to end fit() after this step.
        self.should_stop = False
        # Preemption (trainer/preemption.py): the loop owns trainer.preemption_signals, whatever the callbacks;
        # `preempted_by` is the agreed signal's name once the ranks stopped for it.
        self.preemption = PreemptionSignals(config.preemption_signals)
        self.preempted_by: str | None = None
        # After a restart by the elastic agent: the fault-to-resume timeline (trainer/recovery.py), set by
        # resume on rank 0 and completed at the first step; in summary.json as `recovery`.
        self.recovery: dict[str, Any] | None = None
        # What the run's disk saves and in-memory snapshots cost the loop (each save's stall, the medians),
        # set by the checkpoint manager at the end of fit; in summary.json as `checkpoints`.
        self.checkpoint_figures: dict[str, Any] | None = None
        # The loader's position at the last step boundary: a checkpoint written while a step is under
        # way (on an exception) must not count the batch that step has already drawn.
        self._loader_state: dict[str, Any] = self.train_loader.state_dict()

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def precision(self) -> Precision:
        """The strategy's precision plugin (callbacks and checkpoints read its state)."""
        return self.strategy.precision

    # ---- checkpointed state (tensors are the checkpoint module's; this is the rest) -------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, history and the data position as of the last completed step (timings are per process:
        a resumed run reports its own throughput)."""
        return {
            "step": self.step,
            "optimizer_steps": self.optimizer_steps,
            "tokens_seen": self.tokens_seen,
            "last_train_loss": self.last_train_loss,
            "val_history": [list(entry) for entry in self.val_history],
            "loader": self._loader_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.optimizer_steps = int(state.get("optimizer_steps", self.step))
        self.tokens_seen = int(state["tokens_seen"])
        self.last_train_loss = float(state.get("last_train_loss", math.nan))
        self.val_history = [(int(step), float(loss)) for step, loss in state.get("val_history", [])]
        if state.get("loader") is not None:  # absent from a checkpoint saved without a loader position
            self.train_loader.load_state_dict(state["loader"])
        self._loader_state = self.train_loader.state_dict()

    @property
    def train_time_s(self) -> float:
        """Training time of this fit up to its last logged step (seconds, warm-up included): wall-clock,
        the device's work included, validation and checkpoints excluded. The interval of each logged step's
        `tokens_per_s` is the difference of two readings at logged steps."""
        return self.throughput_meter.total.seconds

    def untimed(self) -> AbstractContextManager[None]:
        """A block whose time is not training time: validation, checkpoint saves and loads (they use it),
        or a callback's own measurements. Nests."""
        return self.throughput_meter.paused()

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    # ---- the loop -----------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end and return the run summary."""
        self.start_step = self.step
        wall_start = time.perf_counter()
        # Each callback receives the implementations of the interfaces it requires (the stabilizer's
        # rollback: the checkpoint provider); here rather than at construction, so that callbacks added
        # after it take part, and before the try: nothing has started that on_exception would clean up.
        connect_callbacks(self.callbacks)
        self.preempted_by = None
        self.preemption.install()
        preempted: TrainingPreempted | None = None
        try:
            self._call("on_fit_start")
            self.throughput_meter.start(self.step)  # after the callbacks' set-up: training starts here
            while self.step < self.total_steps and not self.should_stop:
                data_start = time.perf_counter()
                microbatches = self.strategy.local_batches(next(self.train_loader))
                self.step_timings["data_s"] = time.perf_counter() - data_start
                self.training_step(microbatches)
                if self.config.val_every and self.step % self.config.val_every == 0:
                    with self.untimed():
                        self.validate()
                if self._preempted():  # after the step's scheduled validation: the record is the same
                    break
            if self.throughput_meter.open_steps:  # stopped (should_stop) after unlogged steps: count them
                self.throughput_meter.close(self.step)
            if self.preempted_by is not None:
                # Saved at this step boundary, metrics flushed; no final validation (time is short).
                # (the CLI prints its one line and exits 75)
                preempted = TrainingPreempted(self.preempted_by, self.step, save_on_preemption(self))
            elif not self.val_history or self.val_history[-1][0] != self.step:
                self.validate()  # the summary always reports the final model
            self._call("on_fit_end")
        except BaseException as exception:
            self._call("on_exception", exception)
            raise
        finally:
            self.preemption.restore()
            for logger in self.loggers:
                logger.finalize("success")
        if preempted is not None:
            raise preempted
        return self.summary(time.perf_counter() - wall_start)

    def _preempted(self) -> bool:
        """At a step boundary: whether any rank received a preemption signal (all agree; one all-reduce per
        step when distributed). The save follows in fit()."""
        name = self.preemption.agreed(self.strategy.device)
        if name is None:
            return False
        self.preempted_by = name
        if self.is_global_zero:
            log.warning(f"{name}: saving a checkpoint at step {self.step} and stopping")
        return True

    def training_step(self, microbatches: MicroBatches) -> None:
        """One optimizer step over this rank's micro-batches."""
        self._call("on_train_batch_start", microbatches)
        start = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]  # the LR this update uses

        loss = self.strategy.forward_backward(
            self.model_parts, microbatches, on_before_backward=lambda loss: self._call("on_before_backward", loss),
        )
        self._call("on_after_backward")
        backward_end = time.perf_counter()
        # fp16: unscale, check for inf/nan on every rank and agree whether this step is skipped.
        self.strategy.unscale_gradients(self.optimizer, self.model_parts)
        grad_norm = self.strategy.clip_grad_norm(self.model_parts, self.config.grad_clip)
        # A non-finite gradient norm (the same on every rank: NaN or Inf anywhere reaches it) is never applied,
        # whatever the callbacks decide; a loss scaler's overflow skips are its own. One host sync a step.
        nonfinite = not self.precision.skips_nonfinite_steps and not math.isfinite(float(grad_norm))
        # What the model family accumulated over the step (an MoE's aux loss and expert loads), averaged
        # over the data-parallel ranks (one small all-reduce; nothing for a dense model), before the
        # callbacks see the step.
        moe_metrics, family_state = self.model_family.step_statistics(self.model_parts, self.strategy.reduce_mean)
        # A callback (the loss-spike stabilizer) may veto this update by setting skip_step; it must
        # decide the same on every rank.
        self.step_outputs = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        if moe_metrics:
            self.step_outputs["moe"] = moe_metrics
        self.skip_step = False
        self._call("on_before_optimizer_step", self.optimizer)
        stepped = not self.skip_step and not nonfinite and self.strategy.optimizer_step(self.optimizer)
        if stepped:
            # A skipped update (fp16 overflow, a callback's veto) is no optimizer step: the schedule
            # stays where it is and the state report waits for an update that created the states.
            self.scheduler.step()
            self.optimizer_steps += 1
            self.model_family.after_optimizer_step(self.model_parts, family_state)  # e.g. router bias updates
            if self.state_bytes is None:
                stand_ins = [stand_in for _, stand_in in self.strategy.optimizer_tensor_pairs()]
                self.state_bytes = state_bytes(self.model_parts, self.optimizer, stand_ins)
                log.info(f"state held per rank: {describe_state_bytes(self.state_bytes)}")
        if self.qk_clip is not None:  # every rank, every step (its reductions are collectives); clips after updates
            self.step_outputs["qk_clip"] = self.qk_clip.after_optimizer_step(
                self.strategy.reduce_max, self.strategy.reduce_over_model_parallel, stepped)
        self.strategy.zero_grad(self.model_parts, self.optimizer)
        self._count_nonfinite(nonfinite, loss, grad_norm)

        self.step += 1
        self.tokens_seen += self.tokens_per_step
        self._loader_state = self.train_loader.state_dict()
        self.throughput_meter.add_step(self.tokens_per_step)
        end = time.perf_counter()
        # Host-side wall times of this step's phases (on CUDA, without a synchronize they show launch
        # time; a monitor that wants device time synchronizes before reading them).
        self.step_timings.update(forward_backward_s=backward_end - start, optimizer_s=end - backward_end)
        outputs = {**self.step_outputs, "skipped": not stepped}
        if self.step % self.config.log_every == 0 or self.step == self.total_steps:
            self.log_step(outputs)
        self._call("on_train_batch_end", outputs)

    def _count_nonfinite(self, nonfinite: bool, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Say so for a skipped non-finite step; stop the run after `max_nonfinite_steps` in a row."""
        if not nonfinite:
            self.nonfinite_steps = 0
            return
        self.nonfinite_steps += 1
        step, limit = self.step + 1, self.config.max_nonfinite_steps
        if self.is_global_zero:
            log.warning(f"step {step}: gradient norm {float(grad_norm):g}, loss {float(loss):g} (this rank's): the "
                        f"update is skipped ({self.nonfinite_steps} such step(s) in a row"
                        + (f"; the run stops at {limit})" if limit else ")"))
        if limit and self.nonfinite_steps >= limit:
            raise TrainingDiverged(f"training diverged: the gradient norm was not finite for {self.nonfinite_steps} "
                                   f"steps in a row (steps {step - self.nonfinite_steps + 1}-{step}; "
                                   f"trainer.max_nonfinite_steps={limit}); no update of those steps was applied "
                                   "and the last checkpoint holds finite weights: lower the learning rate or resume "
                                   "from an earlier checkpoint")

    def validate(self) -> float:
        per_source: dict[str, float] = {}
        if isinstance(self.val_set, SourceValidation):  # a mixture: each source, and their weighted mean
            for name, batches in self.val_set.sets.items():
                per_source[f"val_loss/{name}"] = self.strategy.evaluate(self.model_parts,
                                                                        self.strategy.local_batches(batches))
            val_loss = sum(self.val_set.weights[key.split("/", 1)[1]] * loss for key, loss in per_source.items())
        else:
            val_loss = self.strategy.evaluate(self.model_parts, self.strategy.local_batches(self.val_set))
        self.val_history.append((self.step, val_loss))
        self.log({"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), **per_source})
        self._call("on_validation_end")
        return val_loss

    # ---- reporting ----------------------------------------------------------------------------------
    def throughput(self, tokens: int, seconds: float) -> tuple[float, float]:
        """Tokens/s over all ranks and model FLOP utilization against the run's fixed per-device peak."""
        tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        achieved = tokens_per_s * self.flops_per_token / self.strategy.world_size  # FLOP/s per device
        mfu = achieved / self.peak_flops if self.peak_flops > 0 else 0.0
        if mfu > 1.0 and not self._peak_warned:
            # Reported as measured: a peak moved to what the run achieves would make MFU incomparable
            # between the intervals of one run, and hide that the reference is wrong (a short start-up
            # measurement on a busy CPU, turbo clocks, a GPU missing from the table).
            self._peak_warned = True
            if self.is_global_zero:
                log.warning(f"MFU {100 * mfu:.1f}%: the model ran at {achieved / 1e9:.1f} GFLOP/s per device, above "
                            f"the peak of {self.peak_flops / 1e9:.1f} GFLOP/s MFU is measured against; that peak "
                            "looks too low (set trainer.peak_flops to the device's peak)")
        return tokens_per_s, mfu

    def log_step(self, outputs: dict[str, Any]) -> None:
        # .item() synchronizes with the device, so it happens only on logged steps; so does the interval's
        # close, which waits for the whole device (all streams) before it reads the clock.
        self.last_train_loss = self.strategy.reduce_mean(outputs["loss"]).item()
        interval = self.throughput_meter.close(self.step)
        tokens_per_s, mfu = self.throughput(interval.tokens, interval.seconds)
        self.log({
            "train_loss": self.last_train_loss,
            "lr": outputs["lr"],
            "grad_norm": float(outputs["grad_norm"]),
            "tokens": self.tokens_seen,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "skipped": int(outputs["skipped"]),
            **self.precision.metrics(),  # fp16: loss_scale
            **outputs.get("moe", {}),  # MoE: aux loss, expert load, dropped tokens
            **{name: float(value) for name, value in outputs.get("qk_clip", {}).items()},  # max logit, clipped heads
        })

    def flush_loggers(self) -> None:
        """Put everything logged so far on disk (rank 0's loggers); called before a checkpoint is committed,
        so the record of a run is never behind its last checkpoint."""
        for logger in self.loggers:
            logger.save()

    def log(self, metrics: dict[str, float]) -> None:
        metrics = {"step": self.step, **metrics}
        if metrics["step"] == self.logged_metrics.get("step"):
            self.logged_metrics.update(metrics)
        else:
            self.logged_metrics = metrics
        if self.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=self.step)

    def throughput_figures(self) -> dict[str, Any]:
        """The run's throughput for the summary: `tokens_per_s` and `mfu` in the steady state (after the
        warm-up, trainer/throughput.py), or over the whole training when the run ended before a steady
        window (`throughput_window`: steady, whole_run, or none when this process trained no step;
        `throughput_window_steps`: the first and last step it covers); beside them the averages over the
        whole training (`*_wall_average`: warm-up included, validation and checkpoints not), and that
        training time (`train_s`)."""
        meter = self.throughput_meter
        whole_tokens_per_s, whole_mfu = self.throughput(meter.total.tokens, meter.total.seconds)
        if meter.steady.steps > 0 and meter.steady_after is not None:
            window, first = "steady", meter.steady_after
            tokens_per_s, mfu = self.throughput(meter.steady.tokens, meter.steady.seconds)
            seconds = meter.steady.seconds
        else:  # too short: no logged step after the warm-up with steps after it (or no step at all)
            window, first = "whole_run" if meter.total.steps else "none", meter.first_step
            tokens_per_s, mfu, seconds = whole_tokens_per_s, whole_mfu, meter.total.seconds
        return {
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "throughput_window": window,
            "throughput_window_steps": [first + 1, meter.last_step],  # first and last step, inclusive
            "throughput_window_s": seconds,
            "tokens_per_s_wall_average": whole_tokens_per_s,
            "mfu_wall_average": whole_mfu,
            "train_s": meter.total.seconds,
        }

    def summary(self, wall_s: float) -> dict[str, Any]:
        """The run's record (summary.json). Throughput: see `throughput_figures`."""
        val_losses = [loss for _, loss in self.val_history]
        return {
            "num_params": self.num_params,
            "num_active_params": self.num_active_params,
            "final_val_loss": val_losses[-1] if val_losses else None,
            "best_val_loss": min(val_losses) if val_losses else None,
            "final_train_loss": self.last_train_loss,
            "steps": self.step,
            "optimizer_steps": self.optimizer_steps,  # steps minus skipped updates
            "tokens": self.tokens_seen,
            "wall_s": wall_s,
            **self.throughput_figures(),
            "peak_flops_per_device": self.peak_flops,
            "flops_per_token": self.flops_per_token,
            "world_size": self.strategy.world_size,
            "peak_memory_bytes_per_rank": self.strategy.all_gather_object(peak_memory_bytes(self.strategy.device)),
            # parameters, gradients and optimizer states held by each rank (its shards), after step 1
            "state_bytes_per_rank": self.strategy.all_gather_object(self.state_bytes),
            **({"recovery": self.recovery} if self.recovery is not None else {}),
            **({"checkpoints": self.checkpoint_figures} if self.checkpoint_figures is not None else {}),
        }
