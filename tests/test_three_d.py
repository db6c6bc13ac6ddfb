"""3D parallelism on 8 gloo processes: parity with the single-process run for every data-parallel flavour
(ddp, zero1, shard_grad_op, zero3 and fsdp at pp=2 x dp=2 x tp=2; hybrid_shard, which needs dp >= 4, at
pp=2 x dp=4 as 2 replicas x 2 shards) and for GPT blocks under an interleaved schedule (the other families'
3d runs are in their own modules' 4-process launch: tests/test_qwen3.py, tests/test_deepseek_v3.py), and
exact resume
(12 steps straight = 6 + a resume for 6, bitwise), all in one 8-process launch."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from tests.launch_pool import POOL
from tests.test_checkpoint import THREE_D, assert_exact_resume, exact_resume_runs
from trainer.config import compose
from trainer.run import build_trainer

pytestmark = pytest.mark.slow

# 4 layers split over 2 stages; heads, kv heads, MLP width, vocab and sequence divide by tp=2.
MODEL = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
# GPT at the same size (biases, learned positions, tied head; dropout off for parity), 4 layers over 2
# ranks x 2 virtual stages.
GPT = ["model=gpt2_small", "model.vocab_size=256", "model.max_seq_len=32", "model.dim=64", "model.n_layers=4",
       "model.n_heads=4", "model.ffn_hidden_dim=128", "model.dropout=0.0"]
INTERLEAVED = ["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"]
# STEPS steps of 16 sequences; micro-batch 4 on dp=2 gives 2 pipeline micro-batches = 2 stages.
STEPS = 6
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=16", "trainer.micro_batch_size=4", f"trainer.max_steps={STEPS}",
        "trainer.log_every=1", f"trainer.val_every={STEPS // 2}", "trainer.val_batches=1", "lr_schedule.warmup_steps=2",
        "data.max_bytes=1000000", "callbacks=none"]
FLAVOURS = ["ddp", "zero1", "shard_grad_op", "zero3", "fsdp"]
THREE_D_8 = ["strategy=3d", "tp=2", "pp=2", "trainer.devices=8"]
PARITY = {flavour: (MODEL, [*THREE_D_8, f"strategy.data_parallel={flavour}"]) for flavour in FLAVOURS}
# dp = 8 / (1 x 2) = 4 = 2 replicas x 2 shards; micro-batch 2 gives the 2 pipeline micro-batches
PARITY["hybrid_shard"] = (MODEL, ["strategy=3d", "tp=1", "pp=2", "trainer.devices=8", "trainer.micro_batch_size=2",
                                  "strategy.data_parallel=hybrid_shard", "strategy.dp_replicate=2"])
PARITY["gpt_interleaved"] = (GPT, [*THREE_D_8, "strategy.data_parallel=zero1", *INTERLEAVED])
REFERENCES = {"single": MODEL, "single_gpt": GPT}


def column(run_dir: Path, name: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name)]


def reference(out: Path, name: str, model: list[str]) -> None:
    trainer = build_trainer(compose(model + LOOP), out / name)
    trainer.fit()
    torch.save(trainer.strategy.full_state_dict(trainer.model_parts), out / name / "weights.pt")


POOL.add("three_d", 8, [
    *({"name": name, "overrides": model + LOOP + strategy} for name, (model, strategy) in PARITY.items()),
    *exact_resume_runs("3d", THREE_D, POOL.directory("three_d") / "np8"),
], count_collectives=True)


@pytest.fixture(scope="module")
def runs() -> Path:
    out = POOL.ensure(8, "three_d")
    for name, model in REFERENCES.items():
        reference(out, name, model)
    return out


@pytest.mark.parametrize("name", list(PARITY))
def test_3d_matches_single_process(runs: Path, name: str) -> None:
    run_dir = runs / "np8" / name
    model = PARITY[name][0]
    single = runs / next(reference for reference, overrides in REFERENCES.items() if overrides == model)
    assert len(column(single, "train_loss")) == STEPS
    assert column(run_dir, "train_loss") == pytest.approx(column(single, "train_loss"), rel=1e-4)
    assert column(run_dir, "grad_norm") == pytest.approx(column(single, "grad_norm"), rel=1e-4)
    assert column(run_dir, "val_loss") == pytest.approx(column(single, "val_loss"), rel=1e-4)
    reference_weights = torch.load(single / "weights.pt", weights_only=True)
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    assert weights.keys() == reference_weights.keys()
    for key, value in reference_weights.items():
        torch.testing.assert_close(weights[key], value, atol=1e-4, rtol=0, msg=f"3d/{name}: {key}")


@pytest.mark.parametrize("flavour", ["ddp", "shard_grad_op", "zero3", "fsdp"])
def test_3d_reduces_gradients_once_per_step(runs: Path, flavour: str) -> None:
    """The pipeline's 2 micro-batches are gradient accumulation: every data-parallel unit of rank 0's stage
    reduces its gradients over dp once per optimizer step (the schedule holds FSDP2's reduction back until
    the last micro-batch), not once per micro-batch."""
    summary = json.loads((runs / "np8" / flavour / "summary.json").read_text())
    reductions = sum(n for key, n in summary["collective_calls"].items() if key.startswith("all_reduce@dp"))
    assert summary["fsdp_units"] == 3  # stage 0: 2 blocks and the root (the embedding)
    assert reductions == summary["fsdp_units"] * STEPS


def test_3d_exact_resume_gives_the_same_losses(runs: Path) -> None:
    """pp=2 x dp=2 x tp=2: 12 steps straight vs 6, a save, and a resume for 6 more (tests/test_checkpoint.py)."""
    assert_exact_resume(runs / "np8", "3d")
