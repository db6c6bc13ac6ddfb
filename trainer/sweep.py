"""Hydra multirun sweeps: each job's status, the planner's fit check, and the sweep summary.

`python -m trainer -m optimizer.lr=1e-3,3e-4 strategy=ddp,zero2 trainer.devices=2` runs every
combination as a full run (multi-process jobs start their workers as a single run does) in its own
directory `<sweep dir>/<job number>`. The Hydra task records in each job directory a `status.json`:

- `ok`: the run finished (its summary.json holds val_loss, tokens/s, peak memory);
- `failed`: the run raised (an invalid config, a failing rank...); `error` is one line; the sweep goes on;
- `skipped_unfit`: with `sweep.skip_unfit=true`, the planner said the job does not fit, so nothing ran.

When the sweep ends, the table is printed and written to `<sweep dir>/summary.csv` (the Hydra callback
below); `python -m trainer.sweep summarize SWEEP_DIR` prints and writes it again at any time, also for
a sweep still running or interrupted (jobs without a status are `incomplete`).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig

STATUS_FILE = "status.json"
SUMMARY_CSV = "summary.csv"
STATUSES = ("ok", "failed", "diverged", "preempted", "no_space", "skipped_unfit", "incomplete")
MIB = 2**20


# ---- inside a job (trainer/cli.py) ---------------------------------------------------------------------
def write_status(run_dir: Path, status: str, error: str | None = None, **details: Any) -> None:
    """Record how a job ended, next to its outputs (`details`: e.g. the step a preempted run saved)."""
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}; one of {', '.join(STATUSES)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STATUS_FILE).write_text(json.dumps({"status": status, "error": error, **details}) + "\n")


def error_line(error: BaseException) -> str:
    """The first line of an exception, prefixed with its type unless it already explains itself."""
    from trainer.config import ConfigError

    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, ConfigError):
        return f"invalid config: {text}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def unfit_reason(cfg: DictConfig) -> Optional[str]:
    """None when the job should run; otherwise why the planner says it does not fit.

    Only consulted with `sweep.skip_unfit=true`. The planner is `sweep.planner`, a function
    `config -> plan` whose plan has a boolean `.fits` (and, where it says why, `.shortfall`: a list of
    what is short, or a `.reason` string).
    """
    from hydra.utils import get_object

    from trainer.config import ConfigError

    if not cfg.sweep.skip_unfit:
        return None
    try:
        plan = get_object(cfg.sweep.planner)
    except Exception:  # noqa: BLE001 - any import failure means the same thing to the user
        raise ConfigError("sweep.skip_unfit", f"needs a planner, but '{cfg.sweep.planner}' (sweep.planner) cannot be "
                                              "imported; set sweep.skip_unfit=false to run every job") from None
    result = plan(cfg)
    if bool(result.fits):
        return None
    shortfall = getattr(result, "shortfall", None) or getattr(result, "reason", None)
    if isinstance(shortfall, (list, tuple)):
        shortfall = "; ".join(str(s) for s in shortfall)
    return f"the planner says it does not fit: {shortfall}" if shortfall else "the planner says it does not fit"


def read_summary(run_dir: Path) -> Optional[dict[str, Any]]:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def wandb_group(sweep_dir: str) -> str:
    """The wandb group of a sweep's runs: the sweep directory's last two parts (Hydra's default
    `multirun/<date>/<time>` gives `<date>/<time>`)."""
    return "/".join(Path(sweep_dir).parts[-2:])


# ---- after (or during) a sweep -------------------------------------------------------------------------
@dataclass
class JobResult:
    """One job of a sweep, as found in its directory."""

    name: str  # the job directory, relative to the sweep directory
    overrides: list[str]
    status: str
    error: Optional[str] = None
    final_val_loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_bytes_per_rank: list[int] = field(default_factory=list)

    @property
    def override_values(self) -> dict[str, str]:
        return dict(o.split("=", 1) if "=" in o else (o, "") for o in self.overrides)

    @property
    def peak_memory_mib(self) -> Optional[float]:
        return max(self.peak_memory_bytes_per_rank) / MIB if self.peak_memory_bytes_per_rank else None


def natural_key(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def load_job(sweep_dir: Path, job_dir: Path) -> JobResult:
    import yaml

    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in yaml.safe_load(overrides_file.read_text()) or []] if overrides_file.exists() else []
    summary = read_summary(job_dir)
    status_file = job_dir / STATUS_FILE
    if status_file.exists():
        recorded = json.loads(status_file.read_text())
        status, error = recorded["status"], recorded.get("error")
    else:  # still running, or the sweep was killed while it ran
        status, error = ("ok", None) if summary is not None else ("incomplete", None)
    result = JobResult(name=str(job_dir.relative_to(sweep_dir)) if job_dir != sweep_dir else ".",
                       overrides=overrides, status=status, error=error)
    if summary is not None:
        result.final_val_loss = summary.get("final_val_loss")
        result.tokens_per_s = summary.get("tokens_per_s")
        result.mfu = summary.get("mfu")
        result.peak_memory_bytes_per_rank = list(summary.get("peak_memory_bytes_per_rank") or [])
    return result


def collect(sweep_dir: Path) -> list[JobResult]:
    """Every job under a sweep directory (any directory holding Hydra's `.hydra/overrides.yaml`)."""
    job_dirs = {p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")}
    job_dirs |= {p.parent for p in sweep_dir.rglob(STATUS_FILE)}
    ordered = sorted(job_dirs, key=lambda d: natural_key(str(d.relative_to(sweep_dir))))
    return [load_job(sweep_dir, d) for d in ordered]


def swept_keys(jobs: Sequence[JobResult]) -> list[str]:
    """Override keys whose value is not the same in every job, in first-seen order."""
    keys: dict[str, None] = {}
    for job in jobs:
        keys.update(dict.fromkeys(job.override_values))
    return [k for k in keys if len({job.override_values.get(k) for job in jobs}) > 1]


def _number(value: Optional[float], spec: str) -> str:
    return "" if value is None else format(value, spec)


def rows(jobs: Sequence[JobResult]) -> tuple[list[str], list[dict[str, str]]]:
    """The CSV's header and rows: job, all overrides, one column per swept key, results, status."""
    keys = swept_keys(jobs)
    header = ["job", "overrides", *keys, "final_val_loss", "tokens_per_s", "mfu", "peak_memory_mib", "status",
              "error"]
    table = []
    for job in jobs:
        values = job.override_values
        table.append({
            "job": job.name,
            "overrides": " ".join(job.overrides),
            **{k: values.get(k, "") for k in keys},
            "final_val_loss": _number(job.final_val_loss, ".6g"),
            "tokens_per_s": _number(job.tokens_per_s, ".6g"),
            "mfu": _number(job.mfu, ".4g"),
            "peak_memory_mib": _number(job.peak_memory_mib, ".1f"),
            "status": job.status,
            "error": job.error or "",
        })
    return header, table


def format_table(jobs: Sequence[JobResult], max_error: int = 80) -> str:
    """A fixed-width table of the swept keys, results and status (the full overrides are in the CSV)."""
    keys = swept_keys(jobs)
    header = ["job", *keys, "val_loss", "tokens/s", "peak MiB", "status", "error"]
    lines = []
    for job in jobs:
        values = job.override_values
        error = job.error or ""
        lines.append([job.name, *(values.get(k, "-") for k in keys), _number(job.final_val_loss, ".4f"),
                      _number(job.tokens_per_s, ",.0f"), _number(job.peak_memory_mib, ",.0f"), job.status,
                      error if len(error) <= max_error else error[:max_error - 3] + "..."])
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]

    def render(row: Sequence[str]) -> str:
        return "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()

    counts = {s: sum(job.status == s for job in jobs) for s in STATUSES}
    footer = f"{len(jobs)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return "\n".join([render(header), render(["-" * w for w in widths]), *map(render, lines), footer])


def write_csv(jobs: Sequence[JobResult], path: Path) -> None:
    header, table = rows(jobs)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(table)


def summarize(sweep_dir: Path, csv_path: Optional[Path] = None) -> tuple[list[JobResult], str, Path]:
    """Collect the jobs, write the CSV (default `<sweep dir>/summary.csv`) and return the table."""
    jobs = collect(sweep_dir)
    csv_path = csv_path or sweep_dir / SUMMARY_CSV
    write_csv(jobs, csv_path)
    return jobs, format_table(jobs), csv_path


class SweepSummary(HydraCallback):
    """Hydra callback (conf/hydra/callbacks/sweep_summary.yaml): the summary when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists() or config.get("mode") == "plan":  # plans print their own reports
            return
        jobs, table, csv_path = summarize(sweep_dir)
        if jobs:
            print(f"\nsweep {sweep_dir}\n{table}\nwritten: {csv_path}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.sweep", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    summarize_cmd = commands.add_parser("summarize", help="print a table of a sweep's jobs and write it as CSV")
    summarize_cmd.add_argument("sweep_dir", type=Path, help="the sweep directory (hydra.sweep.dir)")
    summarize_cmd.add_argument("--csv", type=Path, default=None, help=f"CSV path (default: SWEEP_DIR/{SUMMARY_CSV})")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    jobs, table, csv_path = summarize(args.sweep_dir, args.csv)
    if not jobs:
        print(f"error: no jobs under {args.sweep_dir} (no .hydra/overrides.yaml or {STATUS_FILE})", file=sys.stderr)
        return 2
    print(table)
    print(f"written: {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
