"""`python -m trainer.plot RUN_DIR [RUN_DIR ...]`: loss, LR, throughput and gradient-norm curves.

Reads each run's metrics.csv and draws the runs overlaid, one colour per run, into one PNG: train loss
(solid) and val loss (dashed, dots), learning rate, tokens/s and gradient norm against the step. A
sweep directory stands for all its jobs. Runs of a sweep are labelled by the overrides that differ
between them (from Hydra's `.hydra/overrides.yaml`), other runs by their directory.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, and no GUI toolkit is imported

import matplotlib.pyplot as plt  # noqa: E402

METRICS_FILE = "metrics.csv"
# (column, panel title, y label); loss has its own panel with train and val.
PANELS = (
    ("lr", "learning rate", "lr"),
    ("tokens_per_s", "throughput", "tokens/s"),
    ("grad_norm", "gradient norm", "norm (before clipping)"),
)
DEFAULT_SIZE = (1500, 1000)
DPI = 100


@dataclass
class RunCurves:
    """The (step, value) series of one run's metrics.csv, one per column."""

    run_dir: Path
    label: str = ""
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)


def read_metrics(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every numeric column as (steps, values), skipping empty cells (a row holds only what was
    logged in its call); a step logged twice keeps its last value."""
    points: dict[str, dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("step"):
                continue
            step = int(float(row["step"]))
            for key, cell in row.items():
                if key == "step" or cell in ("", None):
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    continue
                if math.isfinite(value):
                    points.setdefault(key, {})[step] = value
    return {key: (sorted(values), [values[s] for s in sorted(values)]) for key, values in points.items()}


def expand_run_dirs(paths: Sequence[Path]) -> list[Path]:
    """Run directories (holding metrics.csv); a directory without one stands for the runs below it."""
    from trainer.sweep import natural_key

    runs: list[Path] = []
    for path in paths:
        if (path / METRICS_FILE).exists():
            runs.append(path)
            continue
        found = sorted({p.parent for p in path.rglob(METRICS_FILE)}, key=lambda p: natural_key(str(p)))
        if not found:
            raise FileNotFoundError(f"{path}: no {METRICS_FILE} in it or below it")
        runs.extend(found)
    return runs


def _overrides(run_dir: Path) -> Optional[list[str]]:
    import yaml

    path = run_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in yaml.safe_load(path.read_text()) or []] if path.exists() else None


def labels(run_dirs: Sequence[Path]) -> list[str]:
    """The overrides that differ between the runs when all have them; else the shortest distinct path."""
    overrides = [_overrides(d) for d in run_dirs]
    if len(run_dirs) > 1 and all(o is not None for o in overrides):
        sets = [set(o or []) for o in overrides]
        common = set.intersection(*sets)
        distinct = [" ".join(o for o in (ov or []) if o not in common) for ov in overrides]
        if all(distinct) and len(set(distinct)) == len(distinct):
            return distinct
    for depth in range(1, max(len(d.parts) for d in run_dirs) + 1):
        names = ["/".join(d.parts[-depth:]) for d in run_dirs]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in run_dirs]


def load_runs(paths: Sequence[Path]) -> list[RunCurves]:
    run_dirs = expand_run_dirs(paths)
    return [RunCurves(d, label, read_metrics(d / METRICS_FILE)) for d, label in zip(run_dirs, labels(run_dirs))]


def plot_runs(runs: Sequence[RunCurves], output: Path, size: tuple[int, int] = DEFAULT_SIZE) -> Path:
    """Draw the runs into a PNG of exactly `size` pixels (width, height)."""
    fig, axes = plt.subplots(2, 2, figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI)
    loss_ax, *other_axes = axes.flat
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        if "train_loss" in run.series:
            loss_ax.plot(*run.series["train_loss"], color=color, label=f"{run.label} (train)")
        if "val_loss" in run.series:
            loss_ax.plot(*run.series["val_loss"], color=color, linestyle="--", marker="o", markersize=4,
                         label=f"{run.label} (val)")
        for ax, (column, _, _) in zip(other_axes, PANELS):
            if column in run.series:
                ax.plot(*run.series[column], color=color, label=run.label)
    loss_ax.set(title="loss", xlabel="step", ylabel="loss (nats per token)")
    loss_ax.legend(fontsize="small")
    for ax, (_, title, ylabel) in zip(other_axes, PANELS):
        ax.set(title=title, xlabel="step", ylabel=ylabel)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=DPI, format="png")
    plt.close(fig)
    return output


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, got {text!r}") from None
    if width < 200 or height < 200:
        raise argparse.ArgumentTypeError(f"{text}: at least 200x200 pixels")
    return width, height


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run or sweep directories")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="PNG path (default: DIR/curves.png for one directory, ./curves.png for several)")
    parser.add_argument("--size", type=_size, default=DEFAULT_SIZE, metavar="WxH",
                        help=f"image size in pixels (default {DEFAULT_SIZE[0]}x{DEFAULT_SIZE[1]})")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.runs)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    output = args.output or (args.runs[0] / "curves.png" if len(args.runs) == 1 else Path("curves.png"))
    plot_runs(runs, output, args.size)
    print(f"{len(runs)} run(s) plotted: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
