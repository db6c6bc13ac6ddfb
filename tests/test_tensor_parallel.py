"""Tensor parallelism in 2 and 4 gloo processes against the single-process run.

Parity (fp32, same global batch and seed, 10 steps, every step logged): per-step losses and global
gradient norms within rtol 1e-4 and final full weights within atol 1e-4, for tp=2 and tp=4, with and
without sequence parallelism and loss parallelism, and with tied embeddings; for GPT (fused head-major
qkv, biases, learned positions, tied head) with and without sequence parallelism. GPT with dropout
cannot match a single process mask for mask; there the replicated weights must stay identical on both
ranks and the split dropouts must have per-rank streams. Each world size is one torchrun launch
(tests/distributed_harness.py); the references run in this process.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from trainer.config import compose
from trainer.run import build_trainer
from tests.launch_pool import POOL

pytestmark = pytest.mark.slow

# Grouped-query attention (8 query heads, 4 key/value heads) whose heads, kv heads, MLP width (128),
# vocabulary (256) and sequence (32) all split over 4 ranks: at tp=4 each rank runs 2 query heads on 1
# key/value head.
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden_dim=128"]
# 10 steps of 8 sequences x 32 tokens in 2 micro-batches (every tp rank reads the whole batch). A given
# peak_flops skips the matmul benchmark for MFU, seconds per process on a shared 2-core machine.
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.max_steps=10",
        "trainer.log_every=1", "trainer.val_every=5", "trainer.val_batches=1", "lr_schedule.warmup_steps=2",
        "data.max_bytes=200000", "callbacks=none", "trainer.peak_flops=1e12"]
TIED = ["model.tie_embeddings=true"]
# GPT-2's architecture at the same size (4 heads of 16), tied head, biases; dropout off unless asked.
GPT = ["model=gpt2_small", "model.vocab_size=256", "model.max_seq_len=32", "model.dim=64", "model.n_layers=2",
       "model.n_heads=4", "model.ffn_hidden_dim=128", "model.dropout=0.0"]
DROPOUT = GPT + ["model.dropout=0.1", "model.attn_impl=materialized"]
REPLICATED = ["+callbacks.replicated._target_=tests.helpers.RecordReplicated"]
RUNS = {  # name: (strategy overrides, model overrides); batched by world size
    2: {
        "tp": ([], []),
        "no_sequence_parallel": (["strategy.sequence_parallel=false"], []),
        "no_loss_parallel": (["strategy.loss_parallel=false"], []),
        "tied": ([], TIED),
        "sharded_init": (["strategy.init=sharded"], []),
        "gpt": ([], GPT),
        "gpt_no_sequence_parallel": (["strategy.sequence_parallel=false"], GPT),
        "gpt_dropout": ([], DROPOUT),
        "gpt_dropout_no_sequence_parallel": (["strategy.sequence_parallel=false"], DROPOUT),
    },
    4: {"tp": ([], [])},
}
# checked against the single-process run (sharded init draws other weights on the CPU)
PARITY = [(2, "tp"), (2, "no_sequence_parallel"), (2, "no_loss_parallel"), (2, "tied"), (4, "tp"), (2, "gpt"),
          (2, "gpt_no_sequence_parallel")]
REFERENCE = {"tied": "single_tied", "gpt": "single_gpt", "gpt_no_sequence_parallel": "single_gpt"}


def column(run_dir: Path, name: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name)]


def model_overrides(model: list[str]) -> list[str]:
    """The Llama MODEL with `model` on top, or `model` alone when it picks another model config."""
    return model if model[:1] == ["model=gpt2_small"] else MODEL + model


def reference(out: Path, name: str, model: list[str]) -> None:
    trainer = build_trainer(compose(model_overrides(model) + LOOP), out / name)
    trainer.fit()
    torch.save(trainer.strategy.full_state_dict(trainer.model_parts), out / name / "weights.pt")


_OUT = POOL.directory("tensor_parallel")
for _nproc, _named in RUNS.items():
    POOL.add("tensor_parallel", _nproc, [
        {"name": name, "overrides": model_overrides(model) + LOOP + strategy
         + ["strategy=tp", f"tp={_nproc}", f"trainer.devices={_nproc}"]
         + (REPLICATED + [f"+callbacks.replicated.directory={_OUT / name}"] if "dropout" in name else [])}
        for name, (strategy, model) in _named.items()
    ])


@pytest.fixture(scope="module")
def runs() -> Path:
    for nproc in RUNS:
        out = POOL.ensure(nproc, "tensor_parallel")
    reference(out, "single", [])
    reference(out, "single_tied", TIED)
    reference(out, "single_gpt", GPT)
    return out


@pytest.mark.parametrize(("nproc", "name"), PARITY, ids=[f"tp{n}-{s}" for n, s in PARITY])
def test_losses_grad_norms_and_weights_match_single_process(runs: Path, nproc: int, name: str) -> None:
    run_dir = runs / f"np{nproc}" / name
    single = runs / REFERENCE.get(name, "single")
    expected = column(single, "train_loss")
    assert len(expected) == 10
    # one row per step: the loss is replicated over the tp ranks and logged once (rank 0)
    assert column(run_dir, "train_loss") == pytest.approx(expected, rel=1e-4)
    # the global norm covers every shard (clipping at 1.0 is active: the norms are above it)
    assert column(run_dir, "grad_norm") == pytest.approx(column(single, "grad_norm"), rel=1e-4)
    assert max(column(single, "grad_norm")) > 1.0
    assert column(run_dir, "val_loss") == pytest.approx(column(single, "val_loss"), rel=1e-4)
    reference_weights = torch.load(single / "weights.pt", weights_only=True)
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    assert weights.keys() == reference_weights.keys()
    for key, value in reference_weights.items():
        assert weights[key].shape == value.shape, key
        torch.testing.assert_close(weights[key], value, atol=1e-4, rtol=0, msg=f"tp={nproc} {name}: {key}")


def test_each_rank_holds_a_quarter_of_weights_gradients_and_optimizer_states(runs: Path) -> None:
    summary = json.loads((runs / "np4" / "tp" / "summary.json").read_text())
    full_bytes = 4 * summary["num_params"]
    assert summary["world_size"] == 4
    for rank in summary["state_bytes_per_rank"]:
        # only the norm weights (5 x 64 floats) are replicated
        assert rank["params"] == pytest.approx(full_bytes / 4, rel=0.02), rank
        # gradients in their parameter's layout: no full-vocabulary embedding gradient kept around
        assert rank["grads"] == rank["params"], rank
        assert rank["optimizer"] == 2 * rank["params"], rank


def test_sharded_init_trains_with_distinct_heads_on_each_rank(runs: Path) -> None:
    """init=sharded on the CPU (no DTensor RNG): each tp rank must draw its own shard, else the heads of
    rank 1 would be copies of rank 0's and stay so."""
    run_dir = runs / "np2" / "sharded_init"
    losses = column(run_dir, "train_loss")
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.1  # a normal(0, 0.02) init predicts ~uniformly
    assert losses[-1] < losses[0] - 0.3
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    for key in ("layers.0.attention.wq.weight", "layers.0.feed_forward.w2.weight", "tok_embeddings.weight"):
        dim = 1 if key.endswith("w2.weight") else 0
        first, second = weights[key].chunk(2, dim=dim)
        assert not torch.allclose(first, second, atol=1e-3), key


@pytest.mark.parametrize("name", ["gpt_dropout", "gpt_dropout_no_sequence_parallel"])
def test_gpt_dropout_keeps_replicas_equal_and_draws_split_masks_per_rank(runs: Path, name: str) -> None:
    """Replicated activations must see the same dropout mask on every tp rank (else the replicated weights
    drift apart); split ones (each rank's heads; sequence shards) their own stream per rank."""
    losses = column(runs / "np2" / name, "train_loss")
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3
    ranks = [torch.load(runs / name / f"replicated_rank{r}.pt", weights_only=True) for r in (0, 1)]
    replicated = ranks[0]["replicated"]
    assert {"layers.0.attention_norm.weight", "layers.0.attention.wo.bias", "pos_embeddings.weight"} <= set(replicated)
    for key, value in replicated.items():
        assert torch.equal(value, ranks[1]["replicated"][key]), key
    sequence_parallel = name == "gpt_dropout"
    for rank, recorded in enumerate(ranks):
        streams = recorded["streams"]
        assert streams["layers.1.attention.core_attention"] == rank + 1
        assert streams["layers.1.dropout"] == streams["emb_dropout"] == (rank + 1 if sequence_parallel else 0)
