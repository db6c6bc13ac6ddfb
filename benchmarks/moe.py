"""Mixture of Experts: grouped expert compute, expert-load balance, and all-to-all's share under ep=2.

1. Forward + backward tokens/s of one MoE layer three ways on the same tokens and weights, for Mixtral's
   shape (8 SwiGLU experts, top-2) and a fine-grained one (64 narrow experts, top-8, DeepSeek-style): a naive loop over experts (each expert finds its tokens with `torch.where`, multiplies them,
   adds them back: transformers' Mixtral loop), our sort-by-expert layout with one matmul per expert
   (`moe_grouped_mm=false`), and our layout with torch's grouped matmul (`torch._grouped_mm`). Repeats
   alternate the variants; the ratios are to the naive loop.
2. Expert-load balance of `model=tiny_moe` trained `--steps` steps (200) on the default data, three ways:
   no balancing (aux coefficient 0), the Switch/Mixtral aux loss (0.01), and DeepSeek-V3's auxiliary-loss-free
   bias (rates 1e-3, DeepSeek-V3's, and 1e-2; no aux loss). Reported: max/mean tokens per expert per layer averaged over the last 50
   steps (1.0 = perfectly balanced, n_experts / top_k = 4.0 = every token on the same two experts), and the
   final validation loss.
3. All-to-all share of the step under ep=2 (strategy=ddp, 2 gloo processes, 1 thread each): torch.profiler
   on 3 steps after 2 warm-up steps; the wall time with an expert all-to-all in flight on rank 0 (gloo's
   records of the dispatch, the combine, their backward and the count exchange), over the step time.

    python benchmarks/moe.py [--steps 200] [--repeats 5] [--parts compute,a2a,balance]

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import compose  # noqa: E402
from trainer.models.moe import MoE  # noqa: E402
from trainer.run import build_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ---- 1. grouped compute -------------------------------------------------------------------------------------
def naive_loop(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """transformers' Mixtral loop: for each expert, its tokens by `torch.where`, one SwiGLU, index_add."""
    _, _, chosen, weights = moe.route(x)
    out = torch.zeros_like(x)
    e = moe.experts
    for expert in range(moe.n_experts):
        token, slot = torch.where(chosen == expert)
        if token.numel() == 0:
            continue
        rows = x[token]
        h = F.silu(rows @ e.w1[expert].t()) * (rows @ e.w3[expert].t())
        out.index_add_(0, token, (h @ e.w2[expert].t()) * weights[token, slot, None])
    return out


def grouped_compute(tokens: int, dim: int, hidden: int, repeats: int, n_experts: int = 8,
                    top_k: int = 2) -> dict[str, float]:
    torch.manual_seed(0)
    moe = MoE(dim, hidden, n_experts=n_experts, top_k=top_k)
    moe.init_weights(0.02, 0.02)
    x = torch.randn(tokens, dim)
    variants = {
        "naive_loop": lambda: naive_loop(moe, x),
        "per_expert_matmul": lambda: _with_grouped(moe, False, x),
        "grouped_mm": lambda: _with_grouped(moe, True, x),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats + 1):  # the first round warms up
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            moe.zero_grad(set_to_none=True)
            start = time.perf_counter()
            variants[name]().square().mean().backward()
            if repeat:
                times[name].append(time.perf_counter() - start)
    best = {name: min(values) for name, values in times.items()}
    result = {f"{name}_tokens_per_s": tokens / t for name, t in best.items()}
    result.update({f"{name}_vs_naive": best["naive_loop"] / t for name, t in best.items() if name != "naive_loop"})
    return result


def _with_grouped(moe: MoE, grouped: bool, x: torch.Tensor) -> torch.Tensor:
    moe.experts.grouped = grouped
    return moe(x)


# ---- 2. load balance --------------------------------------------------------------------------------------
BALANCE = {
    "no_balancing": ["model.router_aux_loss_coef=0.0"],
    "aux_loss_0.01": ["model.router_aux_loss_coef=0.01"],
    "bias_balancing_1e-3": ["model.router_aux_loss_coef=0.0", "model.router_bias_update_rate=0.001"],
    "bias_balancing_1e-2": ["model.router_aux_loss_coef=0.0", "model.router_bias_update_rate=0.01"],
}


def load_balance(steps: int, out: Path) -> dict[str, dict[str, float]]:
    import csv

    result = {}
    for name, overrides in BALANCE.items():
        cfg = compose(["model=tiny_moe", "trainer.seq_len=128", "trainer.global_batch_size=8",
                       "trainer.micro_batch_size=8", f"trainer.max_steps={steps}", "trainer.log_every=1",
                       f"trainer.val_every={steps}", f"lr_schedule.warmup_steps={min(10, steps // 2)}", "callbacks=none", *overrides])
        trainer = build_trainer(cfg, out / name)
        summary = trainer.fit()
        with open(out / name / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("moe/max_load")]
        last = rows[-50:]
        layers = sorted(k for k in rows[0] if k.startswith("moe/max_load/"))
        result[name] = {
            **{f"max_over_mean_layer_{k.rsplit('/', 1)[1]}": sum(float(r[k]) for r in last) / len(last) for k in layers},
            "max_over_mean_worst_layer": sum(float(r["moe/max_load"]) for r in last) / len(last),
            "aux_loss": sum(float(r["moe/aux_loss"]) for r in last) / len(last),
            "final_val_loss": summary["final_val_loss"],
        }
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in result[name].items()), flush=True)
    return result


# ---- 3. all-to-all share under ep=2 -------------------------------------------------------------------------
def a2a_worker(out: Path) -> None:
    """Runs on each of 2 processes (torchrun): ddp with ep=2, profile 3 steps, rank 0 writes the share."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from trainer.plugins.callbacks.monitors import busy_seconds as busy_time

    dist.init_process_group("gloo")
    cfg = compose(["model=tiny_moe", "strategy=ddp", "ep=2", "trainer.devices=2", "trainer.seq_len=256",
                   "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "trainer.max_steps=5",
                   "trainer.val_every=0", "trainer.log_every=1", "lr_schedule.warmup_steps=1", "callbacks=none",
                   "trainer.num_threads=1"])
    trainer = build_trainer(cfg, out / "a2a")
    loader = trainer.train_loader
    for _ in range(2):
        trainer.training_step(trainer.strategy.local_batches(next(loader)))
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(3):
            trainer.training_step(trainer.strategy.local_batches(next(loader)))
        wall = time.perf_counter() - start
    events = prof.events()
    a2a = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events
           if e.name.startswith("gloo:") and "all_to_all" in e.name]
    collectives = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events if e.name.startswith("gloo:")]
    if dist.get_rank() == 0:
        (out / "a2a.json").write_text(json.dumps({
            "step_s": wall / 3, "all_to_all_s_per_step": busy_time(a2a) / 3,
            "all_to_all_share": busy_time(a2a) / wall, "all_collectives_share": busy_time(collectives) / wall,
            "all_to_all_records_per_step": len(a2a) / 3}))
    dist.barrier()
    trainer.strategy.teardown()


def a2a_share(out: Path) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(Path(__file__).resolve()), "--a2a-worker", str(out)], check=True, env=env, cwd=ROOT)
    return json.loads((out / "a2a.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--parts", default="compute,a2a,balance", help="which of compute, a2a, balance to run")
    parser.add_argument("--a2a-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.a2a_worker is not None:
        a2a_worker(args.a2a_worker)
        return
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    parts = set(args.parts.split(","))
    shapes = {"8_experts_top2": (8, 2, 512), "64_experts_top8": (64, 8, 64)} if "compute" in parts else {}
    for label, (experts, k, width) in shapes.items():
        compute = grouped_compute(args.tokens, 256, width, args.repeats, experts, k)
        print(f"grouped compute, {experts} experts top-{k}, dim 256, expert width {width}, "
              f"{args.tokens} tokens, forward+backward, 1 thread:")
        print(f"  naive loop over experts   {compute['naive_loop_tokens_per_s']:10,.0f} tokens/s")
        print(f"  sorted, matmul per expert {compute['per_expert_matmul_tokens_per_s']:10,.0f} tokens/s "
              f"({compute['per_expert_matmul_vs_naive']:.2f}x)")
        print(f"  sorted, grouped matmul    {compute['grouped_mm_tokens_per_s']:10,.0f} tokens/s "
              f"({compute['grouped_mm_vs_naive']:.2f}x)", flush=True)
        results[f"grouped_compute_{label}"] = compute
    with tempfile.TemporaryDirectory() as tmp:
        if "a2a" in parts:
            results["a2a_ep2"] = a2a = a2a_share(Path(tmp))
            print(f"ep=2 (ddp, 2 processes): step {a2a['step_s'] * 1e3:.1f} ms, expert all-to-all in flight "
                  f"{a2a['all_to_all_s_per_step'] * 1e3:.1f} ms = {100 * a2a['all_to_all_share']:.1f}% of the step "
                  f"(all collectives {100 * a2a['all_collectives_share']:.1f}%)", flush=True)
        if "balance" in parts:
            results["load_balance"] = load_balance(args.steps, Path(tmp))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
