"""What do the monitors cost? Wall-clock tokens/s of the same run with and without them.

Three variants of one run (the default `tiny` model, 16 x 256 tokens per step, one process), alternated
in ABBA order in this one process so that machine noise hits them alike:

- `bare`: `callbacks=none` (the loop still logs loss, lr, grad norm, tokens/s and MFU);
- `monitors`: the default callbacks (progress bar, ThroughputMonitor, MemoryMonitor);
- `profiled`: the default callbacks with `callbacks.throughput.comm_every=N` (torch.profiler on every
  N-th step to measure communication).

Each run's tokens/s is measured on the wall clock over whole steps after a warm-up, callbacks and
logging included (the loop's own tokens_per_s leaves callbacks out). Reported: medians and ratios to
`bare` (target: monitors >= 0.98), and the monitors' mean step-time breakdown.

    python benchmarks/monitor_overhead.py                         # ~3 minutes on 2 CPU cores
    python benchmarks/monitor_overhead.py --steps 6 --warmup 2 --repeats 1   # smoke test

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import StepClock  # noqa: E402

from trainer.config import compose, tokens_per_step  # noqa: E402
from trainer.run import build_trainer  # noqa: E402

VARIANTS = ("bare", "monitors", "profiled")




def run(variant: str, steps: int, warmup: int, comm_every: int, log_every: int) -> dict[str, float]:
    overrides = [f"trainer.max_steps={steps}", f"trainer.log_every={log_every}", "trainer.val_every=0",
                 "trainer.val_batches=1", "lr_schedule.warmup_steps=1", "trainer.num_threads=2"]
    if variant == "bare":
        overrides.append("callbacks=none")
    if variant == "profiled":
        overrides.append(f"callbacks.throughput.comm_every={comm_every}")
    cfg = compose(overrides)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(cfg, Path(run_dir))
        trainer.callbacks.append(clock)
        trainer.fit()
        trainer.strategy.teardown()
        measured = clock.times[warmup:]
        result = {"tokens_per_s": (len(measured) - 1) * tokens_per_step(cfg) / (measured[-1] - measured[0])}
        if variant == "monitors":
            with open(Path(run_dir) / "metrics.csv", newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("forward_backward_s")]
            for key in ("data_s", "forward_backward_s", "optimizer_s"):
                result[key] = statistics.mean(float(r[key]) for r in rows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="ABBA rounds (each runs every variant twice)")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--comm-every", type=int, default=10)
    args = parser.parse_args()

    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in (*VARIANTS, *reversed(VARIANTS)):
            results[variant].append(run(variant, args.steps, args.warmup, args.comm_every, args.log_every))
            print(f"{variant}: {results[variant][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)

    medians = {v: statistics.median(r["tokens_per_s"] for r in results[v]) for v in VARIANTS}
    report: dict[str, Any] = {
        "tokens_per_s_median": medians,
        "tokens_per_s_runs": {v: [r["tokens_per_s"] for r in results[v]] for v in VARIANTS},
        "ratio_monitors_to_bare": medians["monitors"] / medians["bare"],
        "ratio_profiled_to_bare": medians["profiled"] / medians["bare"],
        "breakdown_s": {k: statistics.median(r[k] for r in results["monitors"])
                        for k in ("data_s", "forward_backward_s", "optimizer_s")},
        "settings": vars(args),
    }
    print(f"monitors / bare = {report['ratio_monitors_to_bare']:.3f}, "
          f"profiled every {args.comm_every} steps / bare = {report['ratio_profiled_to_bare']:.3f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
