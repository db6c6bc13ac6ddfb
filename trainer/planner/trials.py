"""`strategy=auto plan.trials=K`: measure the K best predicted layouts on the run's own processes, run the fastest.

The launcher process chose and ranked the layouts (trainer/planner/auto.py) and handed the workers the
candidates in the config's `auto` record. Every worker then, in the same process group:
1. for each candidate in turn: composes its config, builds a trainer (`trainer.run.build_trainer`), trains
   `plan.trial_warmup + plan.trial_steps` steps into `<run dir>/auto_trials/<i>` (no checkpoint, no resume),
   times each step after the warm-up, and tears the trainer down (the process group stays: this module
   made it, so no trial's strategy owns it);
2. gathers every rank's step times (one object all-gather per trial): a step takes as long as its slowest
   rank, the trial's figure is the median over its steps; every rank computes the same figures from the
   same gathered lists, so all of them agree on the fastest without a further collective (ties: the better
   predicted, which comes first);
3. trains the fastest as the run (`trainer.run.train`), with the measured figures in its config.yaml's
   `auto` record, and destroys the process group at the end.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from trainer.callback import Callback
from trainer.collectives import enable_flight_recorder
from trainer.config import compose, world_size
from trainer.hang import HangWatchdog
from trainer.interfaces.strategy import resolve_device
from trainer.planner.auto import concrete_overrides
from trainer.plugins.strategies.distributed import init_process_group
from trainer.run import build_trainer, collective_timeout_s, train

log = logging.getLogger("trainer")
TRIALS_DIR = "auto_trials"


class StepTimes(Callback):
    """Wall time of each step after `warmup` steps, from the end of one step to the end of the next (its data
    and callbacks count, as in training)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._last = 0.0

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        now = time.perf_counter()
        if trainer.step > self.warmup:
            self.times.append(now - self._last)
        self._last = now


def has_trials(cfg: DictConfig) -> bool:
    """Whether the run's `auto` record holds candidates still to measure."""
    record = cfg.get("auto", None)
    return record is not None and bool(record.get("trials")) and not record.get("measured_step_time_s")


def trial_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config of one candidate: the run's fixed part with the candidate's layout (`shortened`)."""
    record = cfg.auto
    trial = compose(concrete_overrides(record.base_overrides, overrides, record.after))
    return shortened(trial, int(cfg.plan.trial_warmup), int(cfg.plan.trial_steps))


def shortened(trial: DictConfig, warmup: int, steps: int) -> DictConfig:
    """`trial` trained for `warmup + steps` steps only: no periodic validation (the final one is one batch), no
    checkpoint, no resume, no callbacks but the loop's own."""
    OmegaConf.set_readonly(trial, False)
    t = trial.trainer
    t.max_steps = warmup + steps
    t.max_tokens = None
    t.val_every = 0
    t.val_batches = 1
    t.save_final = False
    trial.resume = "none"
    trial.callbacks = {}
    return trial


def measure(cfg: DictConfig, run_dir: Path, warmup: int) -> float:
    """Train `cfg` on this process group and return its step time (median over the timed steps of the
    slowest rank's); the same figure on every rank."""
    trainer = build_trainer(cfg, run_dir)
    clock = StepTimes(warmup)
    watchdogs = sum(isinstance(c, HangWatchdog) for c in trainer.callbacks)
    trainer.callbacks.insert(len(trainer.callbacks) - watchdogs, clock)  # the watchdog stays last
    trainer.fit()
    strategy = trainer.strategy
    gathered = strategy.all_gather_object(clock.times)
    # as trainer.run.train: the model goes before the process group (DDP's reducer holds the gloo group)
    del trainer
    gc.collect()
    strategy.teardown()
    return statistics.median(max(times) for times in zip(*gathered, strict=True))


def train_auto(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """A worker of a `strategy=auto plan.trials=K` run: measure the candidates, train the fastest."""
    record = cfg.auto
    candidates = [list(o) for o in record.trials]
    descriptions = list(record.trial_descriptions)
    predicted = [float(s) for s in record.trial_predicted_step_time_s]
    t = cfg.trainer
    made_group = False
    if world_size(cfg) > 1:
        if t.record_collectives:
            enable_flight_recorder()  # before the process group is made
        device = resolve_device(t.accelerator, int(os.environ.get("LOCAL_RANK", "0")))
        made_group = init_process_group(device, collective_timeout_s(t))
    try:
        warmup = int(cfg.plan.trial_warmup)
        measured: list[float] = []
        for i, overrides in enumerate(candidates):
            step = measure(trial_config(cfg, overrides), run_dir / TRIALS_DIR / str(i), warmup)
            measured.append(step)
            log.info(f"strategy=auto: trial {i + 1}/{len(candidates)} {descriptions[i]}: {step * 1e3:.1f} ms per "
                     f"step measured, {predicted[i] * 1e3:.1f} ms predicted")
        best = min(range(len(candidates)), key=lambda i: (measured[i], i))
        ranked = sorted(range(len(candidates)), key=lambda i: (measured[i], i))
        runner = ranked[1] if len(ranked) > 1 else None
        final = compose(concrete_overrides(record.base_overrides, candidates[best], record.after))
        OmegaConf.set_readonly(final, False)
        chosen = copy.deepcopy(OmegaConf.to_container(record, resolve=True))
        assert isinstance(chosen, dict)
        chosen["measured_step_time_s"] = dict(zip(descriptions, measured, strict=True))
        chosen["overrides"], chosen["chosen"] = candidates[best], descriptions[best]
        reason = (f"the fastest measured of {len(candidates)} trials ({int(cfg.plan.trial_steps)} steps each): "
                  f"{measured[best] * 1e3:.1f} ms per step (predicted {predicted[best] * 1e3:.1f} ms)")
        if runner is not None:
            chosen["runner_up"], chosen["runner_up_overrides"] = descriptions[runner], candidates[runner]
            chosen["runner_up_predicted_step_time_s"] = predicted[runner]
            reason += f"; runner-up {measured[runner] * 1e3:.1f} ms ({measured[runner] / measured[best] - 1:+.1%})"
        chosen["reason"] = f"{reason}; the planner's pick was {descriptions[0]}, {chosen['reason']}"
        chosen["predicted_step_time_s"] = predicted[best]
        final.auto = chosen
        log.info(f"strategy=auto -> {' '.join(candidates[best])}")
        log.info(f"strategy=auto: chosen {descriptions[best]}; {reason}")
        if runner is not None:
            log.info(f"strategy=auto: runner-up {descriptions[runner]}")
        return train(final, run_dir)
    finally:
        if made_group and dist.is_initialized():
            dist.destroy_process_group()
