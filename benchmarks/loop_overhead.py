"""What does the trainer cost over a minimal hand-written PyTorch loop?

Both train the same model (the default `tiny` config) on the same batches with the same optimizer,
parameter groups, LR schedule and clipping, in this one process, alternating trainer/reference runs (in ABBA order) so
that machine noise hits both alike. Each run times its steps after a warm-up (which absorbs
torch.compile). Reported: median tokens/s of each, their ratio (trainer / reference), and achieved
FLOP/s over this machine's measured matmul peak (MFU), eager and compiled.

    python benchmarks/loop_overhead.py                    # ~4 minutes on 2 CPU cores
    python benchmarks/loop_overhead.py --modes eager --steps 4 --warmup 1 --repeats 1   # smoke test

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import StepClock  # noqa: E402

from trainer.config import compose, total_steps  # noqa: E402
from trainer.hardware import measure_matmul_flops  # noqa: E402
from trainer.models import build_meta_model, build_model  # noqa: E402
from trainer.run import build_data, build_trainer  # noqa: E402




def tokens_per_s(times: list[float], warmup: int, tokens_per_step: int) -> float:
    measured = times[warmup:]
    return (len(measured) - 1) * tokens_per_step / (measured[-1] - measured[0])


def run_trainer(overrides: list[str], warmup: int, tokens_per_step: int) -> float:
    clock = StepClock()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(compose(overrides), Path(run_dir))
        trainer.callbacks.append(clock)
        trainer.fit()
    return tokens_per_s(clock.times, warmup, tokens_per_step)


def run_reference(overrides: list[str], warmup: int, tokens_per_step: int) -> float:
    """The loop a researcher would write by hand for the same run."""
    cfg = compose(overrides)
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "tok_embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "tok_embeddings" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optimizer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optimizer.lr, betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps,
    )
    steps, warmup_steps, min_ratio = total_steps(cfg), cfg.lr_schedule.warmup_steps, cfg.lr_schedule.min_ratio

    def cosine(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps + 1) / max(1, steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(progress * math.pi))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
    loader, val_set = build_data(cfg, cfg.model.vocab_size, dp_rank=0, dp_size=1)
    if cfg.trainer.compile:
        for block in model.layers.values():
            block.compile()

    times = [time.perf_counter()]
    for step in range(steps):
        microbatches = next(loader)
        for x, y in microbatches:
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / len(microbatches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % cfg.trainer.log_every == 0:
            loss.item()
        times.append(time.perf_counter())
    return tokens_per_s(times, warmup, tokens_per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before the clock starts")
    parser.add_argument("--repeats", type=int, default=6, help="runs of each loop per mode (median)")
    parser.add_argument("--modes", default="eager,compiled")
    args = parser.parse_args()

    peak = measure_matmul_flops("cpu", torch.float32)
    results: dict[str, Any] = {"peak_matmul_flops": peak, "threads": torch.get_num_threads()}
    for mode in args.modes.split(","):
        n = args.steps + args.warmup
        overrides = [f"trainer.max_steps={n}", f"trainer.val_every={n + 1}", "trainer.val_batches=1",
                     f"trainer.compile={mode == 'compiled'}", "callbacks=none", "lr_schedule.warmup_steps=1"]
        cfg = compose(overrides)
        tokens_per_step = cfg.trainer.global_batch_size * cfg.trainer.seq_len
        ours: list[float] = []
        reference: list[float] = []
        for repeat in range(args.repeats):
            # Alternate which loop goes first (ABBA...), so drifts in machine speed and a first-run
            # penalty hit both loops alike.
            pair = [(ours, run_trainer), (reference, run_reference)]
            for measured, run in (pair if repeat % 2 == 0 else pair[::-1]):
                measured.append(run(overrides, args.warmup, tokens_per_step))
        flops_per_token = build_meta_model(cfg.model).flops_per_token(cfg.trainer.seq_len)
        ours_median, ref_median = statistics.median(ours), statistics.median(reference)
        results[mode] = {
            "trainer_tokens_per_s": ours_median,
            "reference_tokens_per_s": ref_median,
            "ratio": ours_median / ref_median,
            "trainer_mfu": ours_median * flops_per_token / peak,
            "reference_mfu": ref_median * flops_per_token / peak,
            "trainer_runs": ours,
            "reference_runs": reference,
        }
        print(f"{mode}: trainer {ours_median:,.0f} tok/s, reference {ref_median:,.0f} tok/s, "
              f"ratio {ours_median / ref_median:.3f}, MFU {100 * results[mode]['trainer_mfu']:.1f}%", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
