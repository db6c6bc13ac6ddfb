"""A diverging run (issue 33: `optimizer.lr=1e9` trained NaN to the end, status "ok", a NaN checkpoint): a step
whose gradient norm is not finite is never applied, and `trainer.max_nonfinite_steps` of them in a row end
the run with one line, exit status 4 and status.json `diverged`."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import compose
from trainer.loop import TrainingDiverged
from trainer.run import build_trainer

REPO = Path(__file__).resolve().parent.parent
RUN = ["model=tiny", "model.n_layers=1", "trainer.seq_len=32", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
       "trainer.max_steps=12", "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1",
       "data.max_bytes=100000", "lr_schedule.warmup_steps=0", "callbacks=none", "trainer.peak_flops=1e12",
       "optimizer.lr=1e9"]


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("train_loss")]


def finite_weights(trainer: object) -> bool:
    return all(bool(torch.isfinite(p).all()) for part in trainer.model_parts for p in part.parameters())  # type: ignore[attr-defined]


def test_non_finite_steps_are_never_applied_and_three_in_a_row_end_the_run(tmp_path: Path) -> None:
    trainer = build_trainer(compose(RUN), tmp_path / "run")
    with pytest.raises(TrainingDiverged, match=r"^training diverged: the gradient norm was not finite for 3 steps in "
                                               r"a row \(steps \d+-\d+; trainer.max_nonfinite_steps=3\)"):
        trainer.fit()
    assert finite_weights(trainer)  # the updates of the non-finite steps were not applied
    assert trainer.nonfinite_steps == 3 and trainer.optimizer_steps == trainer.step - 2  # the third raised


def test_without_a_limit_the_run_goes_on_skipping_every_non_finite_step(tmp_path: Path) -> None:
    trainer = build_trainer(compose([*RUN, "trainer.max_nonfinite_steps=0"]), tmp_path / "run")
    trainer.fit()
    logged = rows(tmp_path / "run")
    assert len(logged) == 12
    skipped = [r for r in logged if r["skipped"] == "1"]
    assert skipped and all(not math.isfinite(float(r["grad_norm"])) for r in skipped)
    assert all(math.isfinite(float(r["grad_norm"])) for r in logged if r["skipped"] == "0")
    assert trainer.optimizer_steps == 12 - len(skipped) and finite_weights(trainer)


@pytest.mark.slow
@pytest.mark.beside
def test_a_diverging_run_exits_4_with_one_line_and_says_so_in_status_json(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "trainer", *RUN, f"hydra.run.dir={run_dir}"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 4, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: training diverged: the gradient norm was not finite for 3 steps in a row")
    assert "Traceback" not in result.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "diverged" and "training diverged" in status["error"]
    assert [r["skipped"] for r in rows(run_dir)][-2:] == ["1", "1"]  # the two logged before the third ended it
