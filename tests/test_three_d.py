"""3D parallelism (pp=2 x dp=2 x tp=2 on 8 gloo processes) against the single-process run."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.test_strategies import launch_harness
from trainer.config import compose
from trainer.run import build_trainer

# 4 layers split over 2 stages; heads, kv heads, MLP width, vocab and sequence divide by tp=2.
MODEL = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
# 10 steps of 16 sequences; micro-batch 4 on dp=2 gives 2 pipeline micro-batches = 2 stages.
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=16", "trainer.micro_batch_size=4", "trainer.max_steps=10",
        "trainer.log_every=1", "trainer.val_every=5", "trainer.val_batches=1", "lr_schedule.warmup_steps=2",
        "data.max_bytes=1000000", "callbacks=none"]
FLAVOURS = ["ddp", "zero1", "fsdp"]


def column(run_dir: Path, name: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("three_d")
    launch_harness(out, 8, [
        {"name": flavour, "overrides": MODEL + LOOP + [
            "strategy=3d", f"strategy.data_parallel={flavour}", "tp=2", "pp=2", "trainer.devices=8"]}
        for flavour in FLAVOURS
    ])
    reference = build_trainer(compose(MODEL + LOOP), out / "single")
    reference.fit()
    torch.save(reference.strategy.full_state_dict(reference.model_parts), out / "single" / "weights.pt")
    return out


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_3d_matches_single_process(runs: Path, flavour: str) -> None:
    run_dir = runs / "np8" / flavour
    assert column(run_dir, "train_loss") == pytest.approx(column(runs / "single", "train_loss"), rel=1e-4)
    assert column(run_dir, "grad_norm") == pytest.approx(column(runs / "single", "grad_norm"), rel=1e-4)
    assert column(run_dir, "val_loss") == pytest.approx(column(runs / "single", "val_loss"), rel=1e-4)
    reference = torch.load(runs / "single" / "weights.pt", weights_only=True)
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=1e-4, rtol=0, msg=f"3d/{flavour}: {key}")
