"""`python -m trainer.plot`: two runs overlaid in one PNG of loss, LR, throughput and gradient norm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from matplotlib.colors import to_rgb
from PIL import Image

from trainer.config import compose
from trainer.plot import labels, read_metrics
from trainer.run import train

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
        "trainer.seq_len=32", "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.max_steps=6",
        "trainer.log_every=1", "trainer.val_every=3", "trainer.val_batches=1", "lr_schedule.warmup_steps=2",
        "data.max_bytes=1000000", "callbacks=none", "trainer.peak_flops=1e11"]


def pixels_of(image: np.ndarray, color: str, tolerance: int = 40) -> int:
    """Pixels within `tolerance` (per channel, 0-255) of a matplotlib colour."""
    target = np.array([round(255 * c) for c in to_rgb(color)])
    return int((np.abs(image.astype(int) - target).max(axis=-1) <= tolerance).sum())


def test_plot_two_runs_writes_a_png_with_both_curves(tmp_path: Path) -> None:
    for name, lr in (("lr_high", "3e-3"), ("lr_low", "3e-4")):
        train(compose(TINY + [f"optimizer.lr={lr}"]), tmp_path / name)
    output = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, "-m", "trainer.plot", str(tmp_path / "lr_high"), str(tmp_path / "lr_low"),
                             "-o", str(output), "--size", "900x600"],
                            capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"2 run(s) plotted: {output}" in result.stdout

    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(output) as png:
        png.verify()  # a complete, uncorrupted PNG
    with Image.open(output) as png:
        assert png.format == "PNG" and png.size == (900, 600)
        image = np.asarray(png.convert("RGB"))
    # not blank: axes, text and curves cover a real part of the white canvas
    assert (image.min(axis=-1) < 200).mean() > 0.02
    # both runs are drawn, in the first two colours of the cycle, in each of the four panels
    height, width = image.shape[:2]
    for top, left in ((0, 0), (0, width // 2), (height // 2, 0), (height // 2, width // 2)):
        panel = image[top:top + height // 2, left:left + width // 2]
        assert pixels_of(panel, "C0") > 20 and pixels_of(panel, "C1") > 20, (top, left)


def test_metrics_with_several_rows_per_step_and_labels(tmp_path: Path) -> None:
    """Older metrics.csv files hold one row per logging call; sweep jobs are labelled by what differs."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("step,train_loss,val_loss,lr\n1,5.0,,0.1\n2,4.0,,0.2\n2,,4.5,\n3,nan,,0.3\n")
    series = read_metrics(run / "metrics.csv")
    assert series["train_loss"] == ([1, 2], [5.0, 4.0])
    assert series["val_loss"] == ([2], [4.5])
    assert series["lr"] == ([1, 2, 3], [0.1, 0.2, 0.3])

    jobs = []
    for number, lr in enumerate(("1e-3", "3e-4")):
        job = tmp_path / "sweep" / str(number)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- trainer.max_steps=3\n- optimizer.lr={lr}\n")
        jobs.append(job)
    assert labels(jobs) == ["optimizer.lr=1e-3", "optimizer.lr=3e-4"]
    assert labels([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]
