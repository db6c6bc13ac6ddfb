"""`python -m trainer` / `trainer`: the Hydra application.

Before Hydra takes over, the overrides are composed and validated once here, so that a wrong key, type
or value is one line on stderr with exit status 2 and no traceback (set TRAINER_FULL_ERROR=1 for it),
before any process is started or any data is read.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trainer.config import CONF_DIR, ConfigError, compose, describe_compose_error, register_configs, validate

log = logging.getLogger("trainer")
EXIT_CONFIG_ERROR = 2


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_CONFIG_ERROR)


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


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_app(cfg: DictConfig) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from trainer.launch import (adopt_slurm_environment, configure_worker_logging, describe_failure,
                                distributed_environment, launch, needs_launch)
    from trainer.run import train

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)  # again: multirun jobs skip the preflight
        if needs_launch(cfg):
            launch(cfg, run_dir)
            return
        if distributed_environment() == "slurm":
            adopt_slurm_environment()
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0:  # under torchrun/srun every rank runs this app: only rank 0 speaks
            configure_worker_logging(rank, run_dir)
        train(cfg, run_dir)
    except ConfigError as error:  # also raised once the data is read (vocabulary, too little text)
        if _full_errors():
            raise
        _fail(str(error))
    except ChildFailedError as error:
        log.error(f"error: {describe_failure(error)}")
        sys.exit(1)


def main() -> None:
    register_configs()
    args = sys.argv[1:]
    # Flags (--multirun, --help, --cfg, -cn...) change what Hydra composes: leave those to Hydra.
    if not any(arg.startswith("-") for arg in args):
        preflight(args)
    hydra_app()


if __name__ == "__main__":
    main()
