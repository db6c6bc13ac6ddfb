"""`metrics.csv` that survives crashes: appended with fsync, rewritten atomically, read back tolerantly.

Lightning's CSVLogger buffers rows, deletes an existing file when it starts and rewrites the file in place
when a column appears; a process killed (SIGKILL, the OOM killer, a lost node) loses the buffered rows, and
a kill during a rewrite or before the first flush loses the whole file. This logger has the same interface
(`log_metrics`, `log_hyperparams`, `save`, `finalize`) with three guarantees:

- `save()` puts every logged row on disk (appended, flushed, fsynced). The trainer calls it before each
  checkpoint is committed, so a checkpoint's step and everything before it are on disk whenever the
  checkpoint exists.
- The file is only replaced whole (`os.replace` of a fsynced temporary): a rewrite (a new column, a row
  merged after it was written, a rollback or a resume dropping rows) leaves either the old or the new
  file, never a mix or nothing.
- A kill in the middle of an append leaves at most one torn last line (no newline at its end); reading
  drops it, so a resumed run never takes a fragment for a step.

Resume: the run starts from `start_step` (its checkpoint's step); rows of steps up to it are kept, later
ones (logged past the checkpoint by the run that stopped, and redone now) dropped, atomically, at start.
A stabilizer rollback (a step number smaller than the last one logged) drops the rows from that step on.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Optional

from trainer.durable_io import write_atomically

METRICS_FILE = "metrics.csv"


def read_metrics(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of a metrics file; a torn last line (a kill during an append) and rows without an
    integer step are dropped."""
    if not path.is_file():
        return [], []
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    fields = list(reader.fieldnames or [])
    rows = [row for row in reader if str(row.get("step", "")).lstrip("-").isdigit() and None not in row]
    return fields, rows


def _value(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


class DurableCSVLogger:
    """One row per logged step in `<run_dir>/metrics.csv`; the calls made for one step (the loop's, the
    monitors', validation's) are merged into its row. See the module docstring for what survives a crash."""

    def __init__(self, run_dir: Path, flush_every: int = 10, start_step: int = 0) -> None:
        self._root = Path(run_dir)
        self.path = self._root / METRICS_FILE
        self.flush_every = max(1, int(flush_every))
        self._pending: list[dict[str, Any]] = []  # rows not yet on disk
        self._last_written: Optional[dict[str, Any]] = None  # the file's last row
        self._replace_last = False  # the first pending row replaces the file's last row (same step)
        self.last_step: Optional[int] = None
        self._fields: list[str] = []
        fields, rows = read_metrics(self.path)
        kept = [row for row in rows if int(row["step"]) <= start_step]
        if self.path.exists() or kept:
            self._rewrite(fields if kept else [], kept)

    # ---- Lightning's logger interface -----------------------------------------------------------------
    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    @property
    def root_dir(self) -> str:
        return str(self._root)

    @property
    def log_dir(self) -> str:
        return str(self._root)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the resolved config is the run directory's config.yaml."""

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        step = int(step) if step is not None else (self.last_step + 1 if self.last_step is not None else 0)
        if self.last_step is not None and step < self.last_step:
            self._drop_rows_from(step)  # a rollback replays steps: their rows are redone
        self.last_step = step
        values = {key: _value(value) for key, value in metrics.items()}
        if self._pending and int(self._pending[-1]["step"]) == step:
            self._pending[-1].update(values)
            return
        if not self._pending and self._last_written is not None and int(self._last_written["step"]) == step:
            # This step's row was written already (a checkpoint flushed it; validation follows): merge it.
            self._pending.append({**self._last_written, **values})
            self._replace_last = True
            return
        # Flush only when a new step starts, so that no step is split over two rows.
        if len(self._pending) >= self.flush_every:
            self.save()
        self._pending.append({"step": step, **values})

    def save(self) -> None:
        """Put every logged row on disk (appended and fsynced, or the file replaced whole)."""
        if not self._pending:
            return
        keys = set().union(*(row.keys() for row in self._pending))
        if self._replace_last or not keys <= set(self._fields) or not self.path.is_file():
            fields, rows = read_metrics(self.path)
            if self._replace_last and rows:
                rows = rows[:-1]
            self._rewrite(fields, rows + self._pending)
        else:
            buffer = io.StringIO(newline="")
            csv.DictWriter(buffer, fieldnames=self._fields).writerows(self._pending)
            self._append(buffer.getvalue())
            self._last_written = dict(self._pending[-1])
        self._pending = []
        self._replace_last = False

    def finalize(self, status: str) -> None:
        del status
        self.save()

    # ---- the file ---------------------------------------------------------------------------------------
    def _append(self, text: str) -> None:
        with open(self.path, "a", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def _rewrite(self, fields: list[str], rows: list[dict[str, Any]]) -> None:
        keys = set(fields).union(*(row.keys() for row in rows)) if rows else set(fields)
        self._fields = sorted(keys | {"step"})
        buffer = io.StringIO(newline="")
        writer = csv.DictWriter(buffer, fieldnames=self._fields)
        writer.writeheader()
        writer.writerows(rows)
        self._root.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, buffer.getvalue())
        self._last_written = dict(rows[-1]) if rows else None

    def _drop_rows_from(self, step: int) -> None:
        """Forget the rows of `step` and later, buffered or already written (one atomic rewrite)."""
        fields, rows = read_metrics(self.path)
        if self._replace_last and rows:
            rows = rows[:-1]
        kept = [row for row in rows + self._pending if int(row["step"]) < step]
        self._pending = []
        self._replace_last = False
        self._rewrite(fields, kept)
