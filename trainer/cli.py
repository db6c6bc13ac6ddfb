"""`python -m trainer` / `trainer`: the Hydra application.

Before Hydra takes over, the overrides are composed and validated once here, so that a wrong key, type
or value, an unreadable data or checkpoint path or a run directory that cannot be written is one line on
stderr with exit status 2 and no traceback (set TRAINER_FULL_ERROR=1 for it), before any process is started
or any data is read. Then the memory preflight (trainer/planner/preflight.py) compares the planner's
estimate with this machine's free memory: one line and exit status 3 when the run cannot fit. A named
run directory is locked for the run (trainer/run_lock.py): a second run there is one line, exit status 2.
A run that diverges (trainer.loop.TrainingDiverged) ends with one line, exit status 4, status.json `diverged`.
A run stopped by a preemption signal (trainer/preemption.py) saves, writes status.json `preempted` with the
step, prints one line and exits 75 (EX_TEMPFAIL: requeue it). A checkpoint that does not fit on its disk
(trainer.checkpoint.CheckpointNoSpaceError) is one line, status.json `no_space`, exit status 5.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trainer.config import (CONF_DIR, ConfigError, DoesNotFitError, compose, describe_compose_error,
                            register_configs, validate)

log = logging.getLogger("trainer")
EXIT_CONFIG_ERROR = 2
EXIT_DOES_NOT_FIT = 3
EXIT_DIVERGED = 4  # the loss or gradients went non-finite for trainer.max_nonfinite_steps steps, or the stabilizer gave up
EXIT_NO_SPACE = 5  # a checkpoint did not fit on its disk (checked before the save, or ENOSPC while writing it)
# EXIT_PREEMPTED = 75 (trainer/preemption.py): stopped by a signal after saving; resume=auto continues
# The run directory Hydra makes when `hydra.run.dir` is not given (conf/config.yaml), up to its first
# interpolation: what must be writable.
DEFAULT_RUN_ROOT = "outputs"


def _fail(message: str, status: int = EXIT_CONFIG_ERROR) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def _full_errors() -> bool:
    return bool(os.environ.get("TRAINER_FULL_ERROR") or os.environ.get("HYDRA_FULL_ERROR"))


def preflight(overrides: list[str]) -> DictConfig:
    """Compose and validate the overrides the way the run will; exit 2 with one line on any error."""
    user_overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        cfg = compose(user_overrides)
        validate(cfg)
    except ConfigError as error:
        if _full_errors():
            raise
        _fail(str(error))
    except Exception as error:  # noqa: BLE001 - Hydra/OmegaConf raise many types for one cause
        if _full_errors():
            raise
        _fail(describe_compose_error(error, user_overrides))
    return cfg


def _override_value(overrides: list[str], key: str) -> str | None:
    for override in overrides:
        name, _, value = override.lstrip("+").partition("=")
        if name == key:
            return value
    return None


def check_run_dir(overrides: list[str]) -> None:
    """`hydra.run.dir` (or the default `outputs/...`) must be a directory this process can create and
    write; exit 2 with one line otherwise. The test writes a temporary directory beside where the run
    directory goes and removes it, so nothing is left there either way."""
    value = _override_value(overrides, "hydra.run.dir")
    template = value if value is not None else DEFAULT_RUN_ROOT
    literal = template.split("${", 1)[0] or "."  # the part before Hydra's interpolations (${now:...})
    path = Path(literal).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    key = "hydra.run.dir"
    if not existing.is_dir():
        _fail(f"{key}: {existing} is not a directory, cannot create the run directory {template}")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".trainer-write-test-").cleanup()
    except OSError as error:
        if _full_errors():
            raise
        _fail(f"{key}: cannot create the run directory {template} ({error.strerror or error} in {existing})")


def settle_auto(args: list[str]) -> list[str]:
    """`strategy=auto` (trainer/planner/auto.py): the concrete command line of the layout chosen for this
    machine (or, under mode=plan, for the `hardware` profile), which Hydra then composes as if the user had
    written it; the choice waits in `auto.PENDING` for `run_job` to log and record. Any other command line
    comes back as it is. An impossible pin or a bad value is one line and exit status 2."""
    if not any(arg.lstrip("+") == "strategy=auto" for arg in args):
        return args
    from trainer.planner import auto

    value = _override_value(args, "hydra.run.dir")
    run_dir = Path(value).expanduser() if value is not None and "${" not in value else None
    try:
        choice = auto.settle(args, run_dir, run_on_workers=on_workers)
    except DoesNotFitError as error:
        if _full_errors():
            raise
        _fail(str(error), EXIT_DOES_NOT_FIT)
    except ConfigError as error:
        if _full_errors():
            raise
        _fail(str(error))
    except Exception as error:  # noqa: BLE001 - composing the fixed part raises Hydra's many types
        if _full_errors():
            raise
        _fail(describe_compose_error(error, args))
    auto.PENDING = choice
    concrete = choice.command_line()
    sys.argv = [sys.argv[0], *concrete]  # what Hydra's app composes
    return concrete


def check_memory(cfg: DictConfig) -> None:
    """Raise DoesNotFitError when the planner's estimate does not fit this machine (trainer.preflight)."""
    if cfg.mode != "train" or not cfg.trainer.preflight:
        return
    from trainer.launch import needs_launch
    from trainer.planner.preflight import memory_preflight

    verdict = memory_preflight(cfg, launching=needs_launch(cfg))
    if verdict is not None:
        raise DoesNotFitError(verdict)


def on_workers(cfg: DictConfig, run_dir: Path, work: Callable[[DictConfig, Path], Any]) -> None:
    """Run `work(cfg, run_dir)` (a module-level function) on every process of the run: launched here, or on
    this process when it already is one of torchrun's or srun's workers (or the only one)."""
    from trainer.launch import (adopt_slurm_environment, configure_worker_logging, distributed_environment, launch,
                                needs_launch)

    if needs_launch(cfg):
        launch(cfg, run_dir, work)
        return
    if distributed_environment() == "slurm":
        adopt_slurm_environment()
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 or distributed_environment() == "slurm":
        configure_worker_logging(rank, run_dir)
    work(cfg, run_dir)


def run_job(cfg: DictConfig, run_dir: Path) -> dict | None:
    """Validate, then train here or in launched workers: the run's summary, None if it was skipped."""
    from trainer.launch import (adopt_slurm_environment, configure_worker_logging, distributed_environment,
                                launch, needs_launch)
    from trainer.sweep import read_summary, unfit_reason, write_status

    validate(cfg)  # again: multirun jobs skip the preflight
    work = record_auto_choice(cfg)
    if cfg.mode == "plan" and cfg.plan.calibrate:  # a few steps of the config on this machine, then the comparison
        from trainer.planner.calibrate import report, run_config
        from trainer.planner.calibration_run import calibration_worker

        on_workers(run_config(cfg), run_dir, calibration_worker)
        if int(os.environ.get("RANK", "0")) == 0:
            report(cfg, run_dir, list(HydraConfig.get().overrides.task))
        return None
    if cfg.mode == "plan":  # a sweep of plans: each job prints its report, nothing runs
        from trainer.planner.report import run as run_plan

        run_plan(cfg, list(HydraConfig.get().overrides.task))
        return None
    reason = unfit_reason(cfg)  # before any worker starts
    if reason is not None:
        log.warning(f"skipped: {reason}")
        if int(os.environ.get("RANK", "0")) == 0:
            write_status(run_dir, "skipped_unfit", reason)
        return None
    check_memory(cfg)  # before any worker starts and any weight is materialized (sweep jobs, torchrun ranks)
    if cfg.mode == "check":  # bandwidth and latency of the run's groups (trainer/commcheck.py), no training
        from trainer.commcheck import check

        on_workers(cfg, run_dir, check)
        return None
    if needs_launch(cfg):
        launch(cfg, run_dir, work)
        return read_summary(run_dir)
    if distributed_environment() == "slurm":
        adopt_slurm_environment()
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # under torchrun/srun every rank runs this app: only rank 0 speaks
        configure_worker_logging(rank, run_dir)
    return work(cfg, run_dir)


def record_auto_choice(cfg: DictConfig) -> Callable[[DictConfig, Path], Any]:
    """What a worker runs: `trainer.run.train`, or with `strategy=auto plan.trials=K` the trials first
    (trainer/planner/trials.py). A `strategy=auto` choice settled by `main` goes into `cfg.auto` (config.yaml
    records it) and into the log."""
    from trainer.planner import auto

    choice, auto.PENDING = auto.PENDING, None  # this job's: a later job of the process settles its own
    if choice is not None and cfg.get("auto", None) is None:
        cfg.auto = choice.record()
        if int(os.environ.get("RANK", "0")) == 0 and cfg.mode == "train":
            for line in choice.lines():
                log.info(line)
    from trainer.planner.trials import has_trials

    if cfg.mode == "train" and has_trials(cfg):
        from trainer.planner.trials import train_auto

        return train_auto
    from trainer.run import train

    return train


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_app(cfg: DictConfig) -> float | None:
    """One run (or one job of a sweep); returns the final val_loss, the objective of an Optuna sweep.

    In a multirun a failing job records `failed` and its error line in status.json and returns None,
    so the sweep goes on; a single run exits 2 on an invalid config and 1 when a rank failed.
    """
    from hydra.types import RunMode
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from trainer.checkpoint.manifest import CheckpointError, CheckpointNoSpaceError
    from trainer.launch import describe_failure
    from trainer.loop import TrainingDiverged
    from trainer.preemption import EXIT_PREEMPTED, TrainingPreempted
    from trainer.sweep import error_line, wandb_group, write_status

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    writes_status = int(os.environ.get("RANK", "0")) == 0
    if in_sweep and "wandb" in cfg.logger and cfg.logger.wandb.get("group") is None:
        cfg.logger.wandb.group = wandb_group(hydra_cfg.sweep.dir)  # the runs of one sweep share a group
    try:
        summary = run_job(cfg, run_dir)
    except TrainingPreempted as stopped:  # saved and flushed: not a failure, a job to start again
        if writes_status:
            write_status(run_dir, "preempted", str(stopped), step=stopped.step, signal=stopped.signal_name,
                         checkpoint=str(stopped.checkpoint))
        if _full_errors():
            raise
        if writes_status:  # rank 0 speaks (under torchrun every rank runs this app)
            print(str(stopped), file=sys.stderr, flush=True)
        sys.exit(EXIT_PREEMPTED)  # also in a sweep: the machine is going away
    except CheckpointNoSpaceError as error:  # a full disk: one line naming it and the sizes
        if writes_status:
            write_status(run_dir, "no_space", str(error))
        if in_sweep:
            log.error(f"job failed: {error}")
            return None
        if _full_errors():
            raise
        _fail(str(error), EXIT_NO_SPACE)
    except Exception as error:  # noqa: BLE001 - every failure of a job is recorded the same way
        message = describe_failure(error) if isinstance(error, ChildFailedError) else error_line(error)
        diverged = isinstance(error, TrainingDiverged) or "TrainingDiverged" in message
        no_space = "CheckpointNoSpaceError" in message  # a worker's full disk (launched workers)
        if writes_status:
            write_status(run_dir, "diverged" if diverged else "no_space" if no_space else "failed", message)
        if in_sweep:  # the sweep goes on with the next job
            log.error(f"job {'diverged' if diverged else 'failed'}: {message}", exc_info=not isinstance(
                error, (ConfigError, DoesNotFitError, CheckpointError, ChildFailedError, TrainingDiverged)))
            return None
        if isinstance(error, (ConfigError, DoesNotFitError, CheckpointError)):  # found once data/checkpoints are read
            if _full_errors():
                raise
            # a damaged or mismatched checkpoint is a bad input like a bad path: one line, exit 2
            _fail(str(error).splitlines()[0] if str(error).strip() else type(error).__name__,
                  EXIT_DOES_NOT_FIT if isinstance(error, DoesNotFitError) else EXIT_CONFIG_ERROR)
        if diverged:  # a run's outcome, not a bug: one line, its own status
            if _full_errors():
                raise
            _fail(str(error).splitlines()[0] if isinstance(error, TrainingDiverged) else message, EXIT_DIVERGED)
        if isinstance(error, ChildFailedError):
            log.error(f"error: {message}")
            sys.exit(EXIT_NO_SPACE if no_space else 1)
        raise
    if summary is None:
        return None
    if writes_status:
        write_status(run_dir, "ok")
    return summary.get("final_val_loss")


def main() -> None:
    register_configs()
    args = sys.argv[1:]
    settled = sys.modules.get("trainer.planner.auto")
    if settled is not None:  # an earlier command of this process (tests run main in-process) chose its own
        settled.PENDING = None  # type: ignore[attr-defined]
    with contextlib.ExitStack() as held:  # the run directory's lock, until the job ends
        # Flags (--multirun, --help, --cfg, -cn...) change what Hydra composes: leave those to Hydra.
        if not any(arg.startswith("-") for arg in args):
            args = settle_auto(args)  # strategy=auto: the concrete layout's command line
            cfg = preflight(args)
            if cfg.mode == "plan" and not cfg.plan.calibrate:  # a report, nothing runs: no run directory, no Hydra app
                from trainer.planner import auto
                from trainer.planner.report import run as run_plan

                if auto.PENDING is not None:
                    print("\n".join(auto.PENDING.lines()) + "\n")
                sys.exit(run_plan(cfg, args))
            check_run_dir(args)
            try:
                check_memory(cfg)
            except DoesNotFitError as error:
                if _full_errors():
                    raise
                _fail(str(error), EXIT_DOES_NOT_FIT)
            locked = locked_run_dir(args, cfg)
            if locked is not None:  # before Hydra writes anything into it
                from trainer.run_lock import run_directory_lock

                try:
                    held.enter_context(run_directory_lock(locked))
                except ConfigError as error:
                    _fail(str(error))
        hydra_app()


def locked_run_dir(overrides: list[str], cfg: DictConfig) -> Path | None:
    """The run directory this process locks (`trainer/run_lock.py`): a `hydra.run.dir` the user named without
    interpolations (the default `outputs/<date>/<time>` is new each time), by the process that runs the job or
    launches its workers (rank 0 of an external torchrun or srun launch). Not for a run over several nodes
    started by `python -m trainer` on each: they share the directory and learn which is node 0 only at the
    rendezvous."""
    from trainer.environment import distributed_environment

    value = _override_value(overrides, "hydra.run.dir")
    rank = os.environ.get("SLURM_PROCID" if distributed_environment() == "slurm" else "RANK", "0")
    if value is None or "${" in value or rank != "0" or int(cfg.trainer.num_nodes) > 1:
        return None
    return Path(value).expanduser().absolute()


if __name__ == "__main__":
    main()
