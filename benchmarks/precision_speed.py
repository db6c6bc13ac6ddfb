"""What do bf16 and fp16 buy end to end, against fp32, on this machine?

The trainer runs the same model on the same batches with each precision (`precision=fp32|bf16|
bf16_true|fp16`), in this one process, alternating the order of the precisions from repeat to repeat so
that drifts in machine speed hit all of them alike. Each run times its steps after a warm-up. Reported:
median tokens/s per precision, the ratio to fp32, and, for context, the matmul throughput of each dtype
measured here (a square matmul, `trainer.hardware.measure_matmul_flops`): end to end a precision can
gain at most what its matmuls gain, less the casts it adds.

    python benchmarks/precision_speed.py                      # ~10 minutes on 2 CPU cores without AMX
    python benchmarks/precision_speed.py --precisions fp32,bf16 --steps 3 --repeats 1   # smoke test
    python benchmarks/precision_speed.py --model gpt2_small --seq-len 1024 --batch 8 --steps 10 --warmup 3  # a GPU

On a machine with CUDA the runs (and the matmul measurements) use the GPU: the trainer's
`trainer.accelerator=auto` picks it.

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import StepClock  # noqa: E402

from trainer.plugins.precision import DTYPES  # noqa: E402
from trainer.config import compose  # noqa: E402
from trainer.hardware import measure_matmul_flops  # noqa: E402
from trainer.run import build_trainer  # noqa: E402

COMPUTE_DTYPE = {"fp32": "fp32", "bf16": "bf16", "bf16_true": "bf16", "fp16": "fp16"}




def run(overrides: list[str], warmup: int, tokens_per_step: int) -> tuple[float, float]:
    """(tokens/s over the steps after the warm-up, last logged train loss)."""
    clock = StepClock()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(compose(overrides), Path(run_dir))
        trainer.callbacks.append(clock)
        trainer.fit()
    measured = clock.times[warmup:]
    return (len(measured) - 1) * tokens_per_step / (measured[-1] - measured[0]), trainer.last_train_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", default="fp32,bf16,bf16_true,fp16")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before the clock starts")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each precision (median)")
    parser.add_argument("--model", default="tiny", help="a conf/model/ config (tiny: 3.3M parameters)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (one micro-batch)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    precisions = args.precisions.split(",")
    n = args.steps + args.warmup
    base = [f"model={args.model}", f"trainer.seq_len={args.seq_len}", f"trainer.global_batch_size={args.batch}",
            f"trainer.micro_batch_size={args.batch}", f"trainer.max_steps={n}", f"trainer.val_every={n + 1}",
            "trainer.val_batches=1", "callbacks=none", "lr_schedule.warmup_steps=1", "trainer.peak_flops=1e12"]
    if args.threads:
        base.append(f"trainer.num_threads={args.threads}")
    tokens_per_step = args.seq_len * args.batch
    # the device the runs use (trainer.accelerator=auto), so the matmul context is that device's
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    peaks = {name: measure_matmul_flops(device_type, DTYPES[name]) for name in sorted({COMPUTE_DTYPE[p] for p in precisions})}
    print("matmul GFLOP/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()), flush=True)

    speeds: dict[str, list[float]] = {p: [] for p in precisions}
    losses: dict[str, float] = {}
    for repeat in range(args.repeats):
        order = precisions if repeat % 2 == 0 else precisions[::-1]  # ABBA: drifts hit all alike
        for precision in order:
            speed, loss = run(base + [f"precision={precision}"], args.warmup, tokens_per_step)
            speeds[precision].append(speed)
            losses[precision] = loss
            print(f"  repeat {repeat}: {precision} {speed:,.0f} tokens/s", flush=True)

    reference = statistics.median(speeds["fp32"]) if "fp32" in speeds else None
    # Ratios within each repeat (runs close in time), whose median resists machine drift better than the
    # ratio of medians when the machine is shared.
    paired = {p: [s / r for s, r in zip(speeds[p], speeds["fp32"])] for p in precisions} if reference else {}
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device_type == "cuda" else "cpu", "model": args.model,
        "threads": torch.get_num_threads(), "seq_len": args.seq_len, "batch": args.batch,
        "tokens_per_step": tokens_per_step, "measured_steps": args.steps, "repeats": args.repeats,
        "matmul_flops": peaks, "precisions": {},
    }
    for precision in precisions:
        median = statistics.median(speeds[precision])
        ratio = median / reference if reference else None
        matmul_ratio = peaks[COMPUTE_DTYPE[precision]] / peaks["fp32"] if "fp32" in peaks else None
        paired_ratio = statistics.median(paired[precision]) if paired else None
        results["precisions"][precision] = {"tokens_per_s": median, "runs": speeds[precision],
                                            "ratio_to_fp32": ratio, "paired_ratios": paired.get(precision),
                                            "median_paired_ratio": paired_ratio,
                                            "matmul_ratio_to_fp32": matmul_ratio, "last_train_loss": losses[precision]}
        ratio_text = (f", x{ratio:.3f} of fp32 (median of per-repeat ratios x{paired_ratio:.3f}; matmul alone: "
                      f"x{matmul_ratio:.3f})" if ratio and matmul_ratio and paired_ratio else "")
        print(f"{precision}: {median:,.0f} tokens/s{ratio_text}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
