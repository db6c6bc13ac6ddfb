"""The training loop: Lightning-style `Trainer.fit`, short enough to read top to bottom.

Everything that depends on the topology (how the forward/backward runs, how losses and norms are
reduced) is the strategy's; the number format is the precision plugin's, which the strategy owns and
calls. The loop only sequences the strategy's hooks and the callbacks, and reports.
"""

from __future__ import annotations

import logging
import math
import time
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
from trainer.memory import state_bytes
from trainer.models.moe import collect_moe_stats, update_router_biases

log = logging.getLogger("trainer")
MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]


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
        self.val_set = val_set
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.num_params = num_params  # of the whole model, whatever this rank holds
        # used per token (a Mixture of Experts uses top_k of n_experts experts); = num_params when dense
        self.num_active_params = num_params if num_active_params is None else num_active_params
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops  # per device; raised to what the run achieves if it measures below it
        self._peak_raised = False
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
        self.train_time_s = 0.0  # time spent in training steps only (no validation, no logging I/O)
        self._start_tokens = 0
        self.state_bytes: dict[str, int] | None = None
        self._interval = (0.0, 0)  # train time and tokens at the last log
        # Per-step scratch shared with callbacks: the step's outputs before the optimizer step, the
        # veto flag, and the wall time of each phase (data, forward_backward, optimizer).
        self.step_outputs: dict[str, Any] = {}
        self.skip_step = False
        self.step_timings: dict[str, float] = {}
        # Set by a callback (the checkpoint manager after a SIGTERM) to end fit() after this step.
        self.should_stop = False
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
        self._interval = (self.train_time_s, self.tokens_seen)  # throughput is measured from here on

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    # ---- the loop -----------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end and return the run summary."""
        self.start_step = self.step
        self._start_tokens = self.tokens_seen
        self._interval = (self.train_time_s, self.tokens_seen)
        wall_start = time.perf_counter()
        # Each callback receives the implementations of the interfaces it requires (the stabilizer's
        # rollback: the checkpoint provider); here rather than at construction, so that callbacks added
        # after it take part, and before the try: nothing has started that on_exception would clean up.
        connect_callbacks(self.callbacks)
        try:
            self._call("on_fit_start")
            while self.step < self.total_steps and not self.should_stop:
                data_start = time.perf_counter()
                microbatches = self.strategy.local_batches(next(self.train_loader))
                self.step_timings["data_s"] = time.perf_counter() - data_start
                self.training_step(microbatches)
                if self.config.val_every and self.step % self.config.val_every == 0:
                    self.validate()
            if not self.val_history or self.val_history[-1][0] != self.step:
                self.validate()  # the summary always reports the final model
            self._call("on_fit_end")
        except BaseException as exception:
            self._call("on_exception", exception)
            raise
        finally:
            for logger in self.loggers:
                logger.finalize("success")
        return self.summary(time.perf_counter() - wall_start)

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
        # Mixture-of-Experts layers: the step's aux loss and expert loads, averaged over the data-parallel
        # ranks (one small all-reduce; nothing for a dense model), before the callbacks see the step.
        moe_metrics, moe_loads = collect_moe_stats(self.model_parts, self.strategy.reduce_mean)
        # A callback (the loss-spike stabilizer) may veto this update by setting skip_step; it must
        # decide the same on every rank.
        self.step_outputs = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        if moe_metrics:
            self.step_outputs["moe"] = moe_metrics
        self.skip_step = False
        self._call("on_before_optimizer_step", self.optimizer)
        stepped = not self.skip_step and self.strategy.optimizer_step(self.optimizer)
        if stepped:
            # A skipped update (fp16 overflow, a callback's veto) is no optimizer step: the schedule
            # stays where it is and the state report waits for an update that created the states.
            self.scheduler.step()
            self.optimizer_steps += 1
            update_router_biases(self.model_parts, moe_loads)  # auxiliary-loss-free balancing, when on
            if self.state_bytes is None:
                stand_ins = [stand_in for _, stand_in in self.strategy.optimizer_tensor_pairs()]
                self.state_bytes = state_bytes(self.model_parts, self.optimizer, stand_ins)
                log.info("state held per rank: " + ", ".join(f"{k} {v / 2**20:.2f} MiB"
                                                            for k, v in self.state_bytes.items()))
        self.strategy.zero_grad(self.model_parts, self.optimizer)

        self.step += 1
        self.tokens_seen += self.tokens_per_step
        self._loader_state = self.train_loader.state_dict()
        end = time.perf_counter()
        self.train_time_s += end - start
        # Host-side wall times of this step's phases (on CUDA, without a synchronize they show launch
        # time; a monitor that wants device time synchronizes before reading them).
        self.step_timings.update(forward_backward_s=backward_end - start, optimizer_s=end - backward_end)
        outputs = {**self.step_outputs, "skipped": not stepped}
        if self.step % self.config.log_every == 0 or self.step == self.total_steps:
            self.log_step(outputs)
        self._call("on_train_batch_end", outputs)

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
        """Tokens/s over all ranks and model FLOP utilization against the per-device peak (at most 1)."""
        tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        achieved = tokens_per_s * self.flops_per_token / self.strategy.world_size  # FLOP/s per device
        if achieved > self.peak_flops:
            # A peak is an upper bound: a run that beats it shows the peak was measured too low (a short
            # start-up measurement, turbo clocks, a faster kernel than the benchmark's). The achieved rate is
            # a truer lower bound of the peak, so MFU never reads above 100%.
            if not self._peak_raised and self.is_global_zero:
                log.warning(f"the model ran at {achieved / 1e9:.1f} GFLOP/s per device, above the MFU peak of "
                            f"{self.peak_flops / 1e9:.1f} GFLOP/s: the peak is raised to it (set trainer.peak_flops "
                            "for a fixed one)")
            self._peak_raised = True
            self.peak_flops = achieved
        mfu = achieved / self.peak_flops if self.peak_flops > 0 else 0.0
        return tokens_per_s, mfu

    def log_step(self, outputs: dict[str, Any]) -> None:
        # .item() synchronizes with the device, so it happens only on logged steps.
        self.last_train_loss = self.strategy.reduce_mean(outputs["loss"]).item()
        last_time, last_tokens = self._interval
        tokens_per_s, mfu = self.throughput(self.tokens_seen - last_tokens, self.train_time_s - last_time)
        self._interval = (self.train_time_s, self.tokens_seen)
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

    def summary(self, wall_s: float) -> dict[str, Any]:
        tokens = self.tokens_seen - self._start_tokens
        tokens_per_s, mfu = self.throughput(tokens, self.train_time_s)
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
            "train_s": self.train_time_s,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "peak_flops_per_device": self.peak_flops,
            "flops_per_token": self.flops_per_token,
            "world_size": self.strategy.world_size,
            "peak_memory_bytes_per_rank": self.strategy.all_gather_object(peak_memory_bytes(self.strategy.device)),
            # parameters, gradients and optimizer states held by each rank (its shards), after step 1
            "state_bytes_per_rank": self.strategy.all_gather_object(self.state_bytes),
        }
