"""Logger factories: Lightning's logger classes, configured for a run directory.

Each factory is a Hydra `_partial_` target; the trainer supplies `run_dir` and `start_step` (the step the
run starts from: 0, or the checkpoint's step on a resume), after the checkpoint is loaded. They return
Lightning loggers (`log_metrics`, `log_hyperparams`, `save`, `finalize`), so any Lightning logger can be
added. `save()` is called before every checkpoint is committed: what a checkpoint's step logged is on
disk when the checkpoint exists.
"""

from __future__ import annotations

import netrc
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trainer.plugins.loggers.durable_csv import DurableCSVLogger, write_atomically

# The file that keeps a run directory's wandb run id (so that a resume continues that run).
WANDB_ID_FILE = "wandb_run_id"


def csv_logger(run_dir: str | Path, flush_logs_every_n_steps: int = 10, start_step: int = 0) -> Any:
    """`<run_dir>/metrics.csv`, one row per logged step (see `DurableCSVLogger`).

    `start_step` is the step the run starts from (the checkpoint's on a resume, 0 for a new run): the rows
    of the steps up to it are kept, the later ones (logged past the checkpoint by the run that stopped, and
    redone now) are dropped, so the file holds every step once. A fresh run in a used directory starts a
    new file.
    """
    return DurableCSVLogger(Path(run_dir), flush_every=flush_logs_every_n_steps, start_step=start_step)


def tensorboard_logger(run_dir: str | Path, subdir: str = "tensorboard", start_step: int = 0) -> Any:
    """TensorBoard event files under `<run_dir>/<subdir>`; a resumed run writes into the same directory and
    purges the events the stopped run logged after the checkpoint (`purge_step`), so each step shows once."""
    from lightning.fabric.loggers import TensorBoardLogger

    purge = {"purge_step": start_step + 1} if start_step > 0 else {}
    return TensorBoardLogger(root_dir=str(Path(run_dir) / subdir), name="", version="", **purge)


def wandb_api_key_configured() -> bool:
    """True when wandb could log online without asking: an env key or a `wandb login` netrc entry."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_logger(
    run_dir: str | Path,
    project: str = "trainer",
    group: str | None = None,
    name: str | None = None,
    entity: str | None = None,
    offline: bool | None = None,
    tags: list[str] | None = None,
    start_step: int = 0,
) -> Any:
    """Weights & Biases through Lightning's WandbLogger; never needs the network unless a key exists.

    The wandb run id is kept in `<run_dir>/wandb_run_id`, so a run resumed in its directory continues the
    same wandb run (`resume="allow"`) instead of starting another one.
    """
    from lightning.pytorch.loggers import WandbLogger

    del start_step  # wandb continues its run from its own last step
    if offline is None:
        offline = not wandb_api_key_configured() or os.environ.get("WANDB_MODE") == "offline"
    run_dir = Path(run_dir)
    id_file = run_dir / WANDB_ID_FILE
    if id_file.is_file() and id_file.read_text().strip():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:16]
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(id_file, run_id + "\n")
    return WandbLogger(
        id=run_id,
        resume="allow",
        project=project,
        group=group or run_dir.parent.name,
        name=name or run_dir.name,
        entity=entity,
        offline=offline,
        tags=list(tags or []),
        save_dir=str(run_dir),
    )


# ---- schemas (the `logger` group) ----------------------------------------------------------------------
@dataclass
class CSVLoggerConfig:
    """`metrics.csv` in the run directory (always written, whatever else is configured)."""

    _target_: str = "trainer.plugins.loggers.csv_logger"
    _partial_: bool = True
    # Rows are buffered and written every N logged steps, before every checkpoint and at the end.
    flush_logs_every_n_steps: int = 10


@dataclass
class WandbLoggerConfig:
    """Weights & Biases; offline (files under the run directory) unless an API key is configured."""

    _target_: str = "trainer.plugins.loggers.wandb_logger"
    _partial_: bool = True
    project: str = "trainer"
    # Runs of one sweep share a group (the sweep directory name by default).
    group: Optional[str] = None
    # Run name (default: the run directory name).
    name: Optional[str] = None
    entity: Optional[str] = None
    # None: online only when WANDB_API_KEY or a netrc login exists; true/false forces it.
    offline: Optional[bool] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class TensorBoardLoggerConfig:
    """TensorBoard event files under `<run_dir>/tensorboard`."""

    _target_: str = "trainer.plugins.loggers.tensorboard_logger"
    _partial_: bool = True
    subdir: str = "tensorboard"


# Schema of each logger option, registered in Hydra's ConfigStore as `<name>_schema` under the package
# `logger.<name>` (`logger=[csv,wandb]` composes them side by side).
SCHEMAS: dict[str, type] = {
    "csv": CSVLoggerConfig,
    "wandb": WandbLoggerConfig,
    "tensorboard": TensorBoardLoggerConfig,
}
