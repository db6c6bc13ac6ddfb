"""Builds a run from a validated config and trains it: the one place where the pieces meet."""

from __future__ import annotations

import gc
import json
import logging
import os
import random
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from hydra.utils import instantiate
from lightning_utilities.core.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from trainer.checkpoint import checkpoint_directory, resume, save_checkpoint
from trainer.checkpoint.manifest import is_checkpoint, remove_partial_saves, step_dirname
from trainer.config import ConfigError, tokens_per_step, total_steps, validate, world_size
from trainer.data import build_loaders
from trainer.data.config import source_config
from trainer.collectives import enable_flight_recorder
from trainer.hang import HangWatchdog
from trainer.hardware import peak_flops_with_note, reset_peak_memory
from trainer.launch import agree_on_run_dir
from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
from trainer.interfaces.precision import Precision
from trainer.interfaces.strategy import DEFAULT_COLLECTIVE_TIMEOUT_S, Strategy, resolve_device
from trainer.loop import Trainer
from trainer.preemption import TrainingPreempted
from trainer.models import build_meta_model, family_of
from trainer.models.qk_clip import QKClip
from trainer.planner.accumulation import AccumulationChoice, choose_grad_sync, this_machine
from trainer.planner.core import hardware_from_config
from trainer.plugins.strategies.distributed import all_ranks_agree, init_process_group

log = logging.getLogger("trainer")


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators as Lightning's `seed_everything` does (the same calls,
    so the same streams). Not Lightning's own: importing `lightning` pulls torchmetrics, scipy and
    torch._dynamo and costs every process about three times torch's own import (measured with
    `python -X importtime`), seconds per rank at every start; `rank_zero_only` comes from
    lightning_utilities, the package Lightning re-exports it from, for the same reason."""
    os.environ["PL_GLOBAL_SEED"] = str(seed)  # what Lightning's spawned subprocesses read
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's default generator, CUDA's included


def build_loggers(cfg: DictConfig, run_dir: Path, start_step: int = 0) -> list[Any]:
    """Every configured logger; metrics.csv is always written. Built once the run knows where it starts
    (`start_step`: 0, or the step of the checkpoint it resumed), so each logger continues its record from
    there (metrics.csv keeps the rows up to it, TensorBoard purges later events, wandb resumes its run)."""
    logger_cfgs = dict(cfg.logger)
    if "csv" not in logger_cfgs:
        logger_cfgs["csv"] = OmegaConf.create({"_target_": "trainer.plugins.loggers.csv_logger", "_partial_": True})
    return [instantiate(node)(run_dir=run_dir, start_step=start_step) for node in logger_cfgs.values()]


def build_data(cfg: DictConfig, vocab_size: int, dp_rank: int, dp_size: int,
               strategy: Strategy | None = None) -> tuple[Any, Any]:
    """The training loader and validation set (each rank its slice); under document masking the
    `strategy` learns the source's end-of-document id (it derives each micro-batch's documents)."""
    from hydra.errors import InstantiationException

    try:
        source = instantiate(source_config(cfg.data))
    except (OSError, ValueError, InstantiationException) as error:  # validation checked it; files can change
        cause = error.__cause__ if isinstance(error, InstantiationException) and error.__cause__ else error
        raise ConfigError("data", str(cause).splitlines()[0]) from error
    if source.vocab_size > vocab_size:
        raise ConfigError("data", f"the data has {source.vocab_size} token ids but model.vocab_size is "
                                  f"{vocab_size}: pick a model whose vocabulary covers the data")
    if cfg.data.document_masking:
        if getattr(source, "eos_id", None) is None:
            raise ConfigError("data.document_masking", f"the data ({type(source).__name__}) has no "
                                                       "end-of-document token, so its documents cannot be told apart")
        if strategy is not None:
            strategy.document_eos_id = int(source.eos_id)
    t = cfg.trainer
    # The validation set is val_batches global batches whatever the parallelism, so val losses of
    # different strategies and world sizes are comparable; each rank evaluates its slice (per source
    # for a mixture).
    return build_loaders(source, t.seq_len, t.global_batch_size, t.micro_batch_size, t.val_batches, t.seed,
                         dp_rank=dp_rank, dp_size=dp_size)


def settle_grad_sync(cfg: DictConfig, precision: Precision, activation_checkpointing: ActivationCheckpointing,
                     device: torch.device, agree: Callable[[bool], bool]) -> AccumulationChoice | None:
    """`strategy.grad_sync=auto`, settled before the strategy is built: the planner's choice for this machine
    (trainer/planner/accumulation.py, with the run's own precision and checkpointing plugins and the memory of
    `device`), agreed by every rank (`agree(flag)`: True when the flag holds on all of them, so a rank whose
    memory is short makes them all reduce per micro-batch), then written into `cfg.strategy` (grad_sync and
    reshard_after_backward), from which the strategy is built and config.yaml is written. Returns the choice
    (for the log), None when there was none to make; every rank takes the same branches, as `agree` is a
    collective."""
    if cfg.strategy.get("grad_sync", None) != "auto":
        return None
    machine = this_machine(hardware_from_config(cfg), device, int(cfg.trainer.devices))
    local = choose_grad_sync(cfg, machine, precision, activation_checkpointing)
    if local is None:  # a strategy (flavour) without the choice: nothing is written, it keeps "auto"
        return None
    per_step = agree(local.grad_sync == "step")
    if per_step == (local.grad_sync == "step"):
        chosen = local
    else:  # this rank fits, another one does not
        chosen = AccumulationChoice("microbatch", True, local.reason, note=" (another rank's memory decided)")
    cfg.strategy.grad_sync, cfg.strategy.reshard_after_backward = chosen.grad_sync, chosen.reshard_after_backward
    return chosen


def collective_timeout_s(t: DictConfig) -> float:
    """The process group's timeout: the default, or above the hang watchdog's longest deadline when it is on,
    so that its diagnosis comes before the collective's own timeout."""
    if t.hang_timeout_s <= 0:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    longest = t.hang_timeout_s * max(t.hang_first_step_factor, t.hang_save_factor)
    return max(DEFAULT_COLLECTIVE_TIMEOUT_S, longest + 120.0)


def join_process_group(cfg: DictConfig, device: torch.device, timeout_s: float) -> bool:
    """A multi-process run joins its process group before any plugin is built, so that what every rank must
    choose alike (grad_sync=auto) is agreed before the strategy is built with it. The same group the strategy
    would make (`init_process_group`); returns whether this call made it, in which case the strategy adopts
    it (`setup_environment(adopt_process_group=True)`) and destroys it at teardown. A program that made the
    group itself keeps it."""
    if world_size(cfg) < 2:
        return False  # one process: nothing to agree on, and the strategy makes its group of one as before
    return init_process_group(device, timeout_s)


def build_trainer(cfg: DictConfig, run_dir: Path) -> Trainer:
    """Everything a run needs, in the order it needs it, handed to the loop."""
    validate(cfg)
    t = cfg.trainer
    if t.record_collectives:
        enable_flight_recorder()  # before the process groups are made
    timeout_s = collective_timeout_s(t)
    device = resolve_device(t.accelerator, int(os.environ.get("LOCAL_RANK", "0")))
    made_group = join_process_group(cfg, device, timeout_s)
    # The plugins the strategy's settings depend on come first, and the planner settles grad_sync with them.
    precision = instantiate(cfg.precision)
    activation_checkpointing = instantiate(cfg.activation_checkpointing)
    settled = settle_grad_sync(cfg, precision, activation_checkpointing, device,
                               agree=partial(all_ranks_agree, device=device))
    strategy = instantiate(cfg.strategy)  # with grad_sync settled
    strategy.collective_timeout_s = timeout_s
    strategy.setup_environment(t.accelerator, t.num_threads, cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.cp_method,
                               ep=cfg.ep, adopt_process_group=made_group)
    reset_peak_memory(strategy.device)  # this run's peak, also when a sweep runs jobs in one process
    run_dir = agree_on_run_dir(strategy, run_dir)
    rank_zero_only.rank = strategy.rank  # type: ignore[attr-defined]
    strategy.connect_precision(precision)
    if settled is not None and strategy.is_global_zero:
        log.info(f"{strategy.label}: {settled.describe()}")
    seed_everything(t.seed)

    # Built on the meta device: nothing is allocated until the strategy has placed it.
    model = build_meta_model(OmegaConf.to_object(cfg.model))
    num_params = model.num_params()
    num_active_params = model.num_active_params()
    flops_per_token = model.flops_per_token(t.seq_len)
    model_parts = strategy.setup_model(model, activation_checkpointing, t.compile)

    optimizer = strategy.build_optimizer(cfg.optimizer, model_parts)
    # QK-clip (Muon's `qk_clip_tau`): the attention layers record their logit maxima, the loop clips after steps
    tau = cfg.optimizer.get("qk_clip_tau", None)
    qk_clip = None if tau is None else QKClip(float(tau), model_parts, family_of(model_parts[0]))
    steps = total_steps(cfg)
    schedule = instantiate(cfg.lr_schedule)(total_steps=steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    warmup_note = schedule.warmup_note()
    if warmup_note is not None and strategy.is_global_zero:
        log.warning(f"warning: {warmup_note}")
    train_loader, val_set = build_data(cfg, model.config.vocab_size, strategy.dp_rank, strategy.dp_size, strategy)

    if strategy.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    peak, peak_note = (float(t.peak_flops), None) if t.peak_flops else peak_flops_with_note(
        strategy.device, strategy.precision.compute_dtype)  # the dtype the matmuls run in
    if peak_note is not None and strategy.is_global_zero:
        log.info(peak_note)
    active = f" ({num_active_params:,} active per token)" if num_active_params != num_params else ""
    log.info(f"model {cfg.model.name}: {num_params:,} parameters{active}; {steps} steps of "
             f"{tokens_per_step(cfg):,} tokens; run dir {run_dir}")

    trainer = Trainer(
        config=OmegaConf.to_object(t),
        strategy=strategy,
        model_parts=model_parts,
        optimizer=optimizer,
        scheduler=scheduler,
        train_loader=train_loader,
        val_set=val_set,
        total_steps=steps,
        tokens_per_step=tokens_per_step(cfg),
        num_params=num_params,
        num_active_params=num_active_params,
        flops_per_token=flops_per_token,
        peak_flops=peak,
        # the watchdog last: its step-end deadline starts after the other callbacks (a checkpoint save)
        callbacks=[instantiate(node) for node in cfg.callbacks.values()] + watchdog(t, strategy),
        run_dir=run_dir,
        qk_clip=qk_clip,
    )
    # Continue from a checkpoint (resume=auto|PATH), or start from given weights (init_from).
    resume(trainer, str(cfg.resume), cfg.init_from)
    if strategy.is_global_zero:
        trainer.loggers = build_loggers(cfg, run_dir, start_step=trainer.step)
        for logger in trainer.loggers:
            try:
                logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
            except NotImplementedError:  # a logger without hyperparameters; the config is in config.yaml
                pass
    return trainer


def watchdog(t: DictConfig, strategy: Any) -> list[HangWatchdog]:
    """The hang watchdog and straggler report (trainer/hang.py) of a multi-process run, when either is on."""
    if strategy.world_size < 2 or (t.hang_timeout_s <= 0 and t.straggler_margin <= 0):
        return []
    return [HangWatchdog(timeout_s=t.hang_timeout_s, first_step_factor=t.hang_first_step_factor,
                         save_factor=t.hang_save_factor, straggler_margin=t.straggler_margin,
                         straggler_steps=t.straggler_steps, straggler_overhead=t.straggler_overhead,
                         record_pipeline=t.record_collectives)]


def save_final_checkpoint(trainer: Trainer) -> Path:
    """The checkpoint of the state training ended in (collective), in the run's checkpoint directory: the
    one a CheckpointManager wrote at this step (`save_last`, or a periodic save), else a new one. Holds the
    weights and everything a resume needs; `trainer.save_final=false` turns it off."""
    directory = checkpoint_directory(trainer)
    path = directory / step_dirname(trainer.step)
    # Rank 0's view decides: a save is collective, so every rank must take the same branch.
    if trainer.strategy.broadcast_object(is_checkpoint(path)):
        return path
    if trainer.is_global_zero and directory.is_dir():
        for leftover in remove_partial_saves(directory):  # a final save killed earlier in this directory
            log.warning(f"removed an incomplete save (a process stopped while writing it): {leftover}")
    save_checkpoint(trainer, path, reason="end")
    return path


def throughput_line(summary: dict[str, Any]) -> str:
    """The run's throughput for its final log line: the steady-state figure (after the warm-up) with the
    average over the whole training beside it, named, or the whole-run figure when there was no steady
    window."""
    first, last = summary["throughput_window_steps"]
    line = f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.1f}%"
    if summary["throughput_window"] == "steady":
        return (f"{line} (steady state, steps {first}-{last}; wall average over all training "
                f"{summary['tokens_per_s_wall_average']:,.0f} tokens/s, MFU {100 * summary['mfu_wall_average']:.1f}%)")
    if summary["throughput_window"] == "none":
        return "no training step in this run"
    return f"{line} (whole run, steps {first}-{last}: too short for a steady state after the warm-up)"


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train the configured model; write summary.json into run_dir and return the summary."""
    # What exists before the run (the imported modules, torch's and Hydra's state: some 300,000 objects) is
    # moved out of the collector's reach: a full collection over it took 1.2 s, and a run collects at its end
    # and again in a pipeline's teardown. The previous job of a sweep was collected at its end, so little
    # garbage is frozen with it.
    gc.freeze()
    trainer = build_trainer(cfg, run_dir)
    preempted: TrainingPreempted | None = None
    try:
        summary = trainer.fit()
    except TrainingPreempted as stopped:
        # Saved and flushed at a step boundary: leave quickly but cleanly (the teardown below, so that no
        # rank waits for another at exit), then the CLI records `preempted` and exits 75. Its traceback
        # would keep fit()'s frame, hence the model, alive past the teardown.
        preempted, summary = stopped.with_traceback(None), {}
    if preempted is None:
        watchdogs = [callback for callback in trainer.callbacks if isinstance(callback, HangWatchdog)]
        for dog in watchdogs:
            dog.watch_final_save(trainer)
        final = save_final_checkpoint(trainer) if cfg.trainer.save_final else None
        for dog in watchdogs:
            dog.stop()
        if trainer.is_global_zero:
            path = trainer.run_dir / "summary.json"
            path.write_text(json.dumps(summary, indent=2) + "\n")
            log.info(f"final val_loss {summary['final_val_loss']:.4f}, {throughput_line(summary)}")
            log.info(f"summary: {path}")
            if final is not None:  # the run's last line: where its result is
                log.info(f"final checkpoint: {final} (resume=auto in this run directory continues from it)")
    strategy = trainer.strategy
    # The model goes before the process group: DDP's C++ reducer holds a reference to the gloo group,
    # and a group destroyed through it runs its destructor with the GIL held while gloo's worker
    # threads wait for the GIL to free finished work, a deadlock at exit (pytorch/pytorch#56297).
    del trainer
    gc.collect()
    strategy.teardown()
    # What of the run is still in a reference cycle is collected now: the next job of a sweep starts with
    # gc.freeze(), which would keep it (the model, the optimizer's copies) for the rest of the sweep.
    del strategy
    gc.collect()
    if preempted is not None:
        raise preempted
    return summary
