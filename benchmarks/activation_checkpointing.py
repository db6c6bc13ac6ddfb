"""What each activation-checkpointing policy saves in memory and costs in FLOPs.

For each policy (none, full, every_n, selective, attention, offload) the script builds the configured
model with the policy applied exactly as a strategy applies it (`policy.apply(model)`), runs one
forward + backward of one micro-batch, and measures:

- activation bytes: the distinct storages the forward leaves for the backward, counted with
  `torch.autograd.graph.saved_tensors_hooks` plus the outputs a selective-checkpoint policy caches,
  views of one storage counted once, parameters and buffers excluded
  (`trainer.plugins.activation_checkpointing.accounting.SavedActivationMeter`);
- FLOPs with `torch.utils.flop_counter.FlopCounterMode` over the forward and over the backward
  (which includes any recomputation). Recompute FLOPs = (forward + backward FLOPs with the policy)
  - (the same without); `extra_forwards` expresses them in units of the forward without the policy.
  FlopCounterMode counts matmuls and fused attention only (elementwise recomputation is free in this
  count); torch 2.13 has no formula for the CPU flash-attention kernel, so the script registers its
  CUDA formulas for it (same maths).

Two configurations where activations dominate the memory (seq_len 512, 8 blocks of width 256, byte
vocabulary): `llama`, the project's Llama family with fused SDPA (which never stores the S x S
attention matrix), and `gpt`, a GPT with the materialized attention and dropout 0.1 that Korthikanti
et al. 2022 analyse (softmax output and dropout mask/output of size heads x S x S per sequence).

Targets (issue 5): full cuts activation memory by >= 60% for about one extra forward; selective and
attention cut less, for <= 15% extra FLOPs.

`--compile` also trains a small Llama for 2 steps with `trainer.compile=true` (per-block torch.compile of
the wrapped blocks, as the strategies apply it) under every policy and reports whether the losses equal
those of compiled `none` (a check that compile composes with each policy; several minutes on 2 cores).

    OMP_NUM_THREADS=1 python benchmarks/activation_checkpointing.py           # ~1 minute on 2 cores
    python benchmarks/activation_checkpointing.py --seq-len 128 --layers 2    # smoke test
    OMP_NUM_THREADS=1 python benchmarks/activation_checkpointing.py --models --compile

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode, flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.plugins.activation_checkpointing.accounting import SavedActivationMeter  # noqa: E402
from trainer.config import compose  # noqa: E402
from trainer.loss import cross_entropy_loss  # noqa: E402
from trainer.models import build_meta_model  # noqa: E402

POLICIES = ("none", "full", "every_n", "selective", "attention", "offload")
aten = torch.ops.aten


def _same_formula_as(op: Any) -> Any:
    """The registered formula of `op`, marked as taking raw arguments (it already reads their shapes)."""
    formula = flop_registry[op]

    def count(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    count._get_raw = True  # type: ignore[attr-defined]
    return count


# The CPU flash-attention kernel has the same maths as the CUDA kernels FlopCounterMode knows.
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _same_formula_as(aten._scaled_dot_product_flash_attention),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        _same_formula_as(aten._scaled_dot_product_flash_attention_backward),
}

def model_overrides(family: str, args: argparse.Namespace) -> list[str]:
    shape = [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
             f"model.ffn_hidden_dim={4 * args.dim if family == 'gpt' else 3 * args.dim}",
             "model.vocab_size=256", f"model.max_seq_len={args.seq_len}"]
    if family == "gpt":
        return ["model=gpt2_small", *shape, "model.attn_impl=materialized", "model.dropout=0.1"]
    return ["model=tiny", *shape, f"model.n_kv_heads={args.heads // 2}"]


def measure(family: str, policy_name: str, args: argparse.Namespace) -> dict[str, float]:
    overrides = [*model_overrides(family, args), f"activation_checkpointing={policy_name}",
                 f"activation_checkpointing.n={args.every_n}" if policy_name == "every_n" else None]
    cfg = compose([o for o in overrides if o])
    model = build_meta_model(OmegaConf.to_object(cfg.model))
    policy = instantiate(cfg.activation_checkpointing)
    meter = SavedActivationMeter.applying(policy, model)
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    model.train()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.micro_batch_size, args.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(2)  # the same dropout masks for every policy
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        with meter:
            loss = cross_entropy_loss(model(inputs), targets)
        forward_flops = counter.get_total_flops()
        loss.backward()
    return {"activation_bytes": meter.bytes, "forward_flops": forward_flops,
            "flops": counter.get_total_flops(), "loss": loss.item()}


def compiled_losses(policy_name: str, run_dir: Path) -> list[float]:
    """Per-step training losses of 2 steps of a 2-block Llama with per-block compile under the policy."""
    from trainer.run import build_trainer

    cfg = compose(["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                   "model.ffn_hidden_dim=128", "trainer.seq_len=32", "trainer.global_batch_size=8",
                   "trainer.micro_batch_size=4", "trainer.max_steps=2", "trainer.log_every=1", "trainer.val_every=0",
                   "trainer.val_batches=1", "lr_schedule.warmup_steps=1", "data.max_bytes=200000", "callbacks=none",
                   "trainer.peak_flops=1e12", "trainer.compile=true", f"activation_checkpointing={policy_name}"])
    trainer = build_trainer(cfg, run_dir / policy_name)
    trainer.fit()
    with open(run_dir / policy_name / "metrics.csv") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["llama", "gpt"], choices=["llama", "gpt"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--every-n", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also check every policy under trainer.compile")
    args = parser.parse_args()

    results: dict[str, Any] = {"config": vars(args)}
    for family in args.models:
        rows = {name: measure(family, name, args) for name in POLICIES}
        base = rows["none"]
        print(f"\n{family}: {args.layers} blocks, dim {args.dim}, {args.heads} heads, seq_len {args.seq_len}, "
              f"micro-batch {args.micro_batch_size}")
        print(f"{'policy':<10} {'activations MiB':>16} {'cut':>7} {'fwd+bwd GFLOP':>14} {'extra FLOPs':>12} "
              f"{'extra fwd':>10}")
        for name, row in rows.items():
            row["activation_cut"] = 1 - row["activation_bytes"] / base["activation_bytes"]
            row["extra_flops"] = row["flops"] / base["flops"] - 1
            row["extra_forwards"] = (row["flops"] - base["flops"]) / base["forward_flops"]
            # recomputation replays the same ops on the same inputs: the loss must not move
            assert row["loss"] == base["loss"], (name, row["loss"], base["loss"])
            print(f"{name:<10} {row['activation_bytes'] / 2**20:>16.1f} {100 * row['activation_cut']:>6.1f}% "
                  f"{row['flops'] / 1e9:>14.2f} {100 * row['extra_flops']:>11.1f}% {row['extra_forwards']:>10.2f}")
        full, selective, attention = rows["full"], rows["selective"], rows["attention"]
        rows["targets"] = {
            "full_cut_ge_60pct": full["activation_cut"] >= 0.60,
            "full_about_one_extra_forward": 0.75 <= full["extra_forwards"] <= 1.05,
            "selective_cuts_less_than_full": 0 < selective["activation_cut"] < full["activation_cut"],
            "selective_extra_flops_le_15pct": selective["extra_flops"] <= 0.15,
            "attention_cuts_less_than_full": 0 < attention["activation_cut"] < full["activation_cut"],
            "attention_extra_flops_le_15pct": attention["extra_flops"] <= 0.15,
        }
        print("targets: " + ", ".join(f"{k}={v}" for k, v in rows["targets"].items()))
        results[family] = rows
    if args.compile:
        with tempfile.TemporaryDirectory() as tmp:
            curves = {name: compiled_losses(name, Path(tmp)) for name in POLICIES}
        results["compile"] = {name: {"losses": curve, "equal_to_none": curve == curves["none"]}
                              for name, curve in curves.items()}
        print("\ncompiled (per block), 2 steps: " + ", ".join(
            f"{name} {'=' if row['equal_to_none'] else '!='} none" for name, row in results["compile"].items()))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
