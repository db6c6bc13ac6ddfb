"""Logger factories: Lightning's logger classes, configured for a run directory.

Each factory is a Hydra `_partial_` target; the trainer supplies `run_dir`. They return Lightning
loggers (`log_metrics`, `log_hyperparams`, `save`, `finalize`), so any Lightning logger can be added.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any


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

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            rows = self.experiment.metrics
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
