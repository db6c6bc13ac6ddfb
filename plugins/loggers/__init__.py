"""Logger factories: Lightning's logger classes, configured for a run directory.

Each factory is a Hydra `_partial_` target; the trainer supplies `run_dir`. They return Lightning
loggers (`log_metrics`, `log_hyperparams`, `save`, `finalize`), so any Lightning logger can be added.
"""

from __future__ import annotations

import netrc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


def csv_logger(run_dir: str | Path, flush_logs_every_n_steps: int = 10) -> Any:
    """`<run_dir>/metrics.csv`, one row per logged step; new columns (val_loss) are added as they appear.

    A run resumed in its own directory continues the file: the rows of the steps before the first step
    this run logs are kept (those after it were logged past the checkpoint by the run that stopped, and
    are redone), so the file holds the whole curve. A fresh run in a used directory starts a new file.
    """
    import csv
    import warnings

    from lightning.fabric.loggers import CSVLogger

    metrics_file = Path(run_dir) / "metrics.csv"
    previous_rows: list[dict[str, Any]] = []
    if metrics_file.is_file():  # read now: Lightning deletes it when its writer starts
        with open(metrics_file, newline="") as f:
            previous_rows = list(csv.DictReader(f))

    class StepRowCSVLogger(CSVLogger):
        """Lightning's CSVLogger writes one row per call; the loop, the monitors and validation each log
        a step's metrics in their own call, so calls for the step of the last row are merged into it."""

        last_step: int | None = None

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            rows = self.experiment.metrics
            if step is not None and self.last_step is not None and step < self.last_step:
                self._drop_rows_from(step)  # a rollback replays steps: their rows are redone
            if step is not None:
                self.last_step = step
            if previous_rows:
                first_step = step if step is not None else 0
                rows[:0] = [row for row in previous_rows if row.get("step", "").isdigit()
                            and int(row["step"]) < first_step]
                previous_rows.clear()
            if step is not None and rows and rows[-1].get("step") == step:
                rows[-1].update({k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()})
                return
            # Flush only when a new step starts, so that no step is split over two rows.
            if len(rows) >= self._flush_logs_every_n_steps:
                self.save()
            self.experiment.log_metrics(metrics, step)

        def _drop_rows_from(self, step: int) -> None:
            """Forget the rows of `step` and later, in memory and in the file already written."""
            writer = self.experiment
            writer.metrics[:] = [row for row in writer.metrics if int(row.get("step", -1)) < step]
            path = Path(writer.metrics_file_path)
            if not path.is_file():
                return
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                fields, kept = reader.fieldnames or [], [row for row in reader if int(row["step"]) < step]
            with open(path, "w", newline="") as f:
                out = csv.DictWriter(f, fieldnames=fields)
                out.writeheader()
                out.writerows(kept)

    # The run directory already holds config.yaml and the log; Lightning would warn about that.
    warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
    return StepRowCSVLogger(root_dir=str(run_dir), name="", version="",
                            flush_logs_every_n_steps=flush_logs_every_n_steps)


def tensorboard_logger(run_dir: str | Path, subdir: str = "tensorboard") -> Any:
    from lightning.fabric.loggers import TensorBoardLogger

    return TensorBoardLogger(root_dir=str(Path(run_dir) / subdir), name="", version="")


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
) -> Any:
    """Weights & Biases through Lightning's WandbLogger; never needs the network unless a key exists."""
    from lightning.pytorch.loggers import WandbLogger

    if offline is None:
        offline = not wandb_api_key_configured() or os.environ.get("WANDB_MODE") == "offline"
    run_dir = Path(run_dir)
    return WandbLogger(
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
    # Rows are buffered and written every N logged steps (and at the end).
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
