"""What do the collective records, the hang watchdog and the straggler report cost? tokens/s on vs off.

The same multi-process run (`python -m trainer`, the default `tiny` model, `--strategy` over `--devices`
gloo processes; zero3 by default: FSDP2 issues an all-gather and a reduce-scatter per block and step, the
most collectives per step of our strategies) with the defaults of issue 16 on (`on`: torch's flight
recorder, the pipeline p2p record, the watchdog thread, the straggler exchange every log step) and off
(`off`: `trainer.record_collectives=false trainer.hang_timeout_s=0 trainer.straggler_margin=0`), alternated
in ABBA order so that machine noise hits both alike. tokens/s = tokens / the fit's wall time (summary.json
`wall_s`: callbacks, logging and the straggler exchange included; process start-up excluded).
Reported: per-run figures, medians and the ratio on / off (target >= 0.98), and the CPU seconds of each
whole job (launcher and workers, start-up included; less sensitive than wall time to other load on the
machine, though start-up dilutes the difference).

    python benchmarks/hang_watchdog_overhead.py                 # ~5 minutes on 2 CPU cores
    python benchmarks/hang_watchdog_overhead.py --steps 6 --repeats 1   # smoke test

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("on", "off")
OFF = ["trainer.record_collectives=false", "trainer.hang_timeout_s=0", "trainer.straggler_margin=0"]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(variant: str, args: argparse.Namespace) -> tuple[float, float]:
    """(tokens/s on the wall clock of the fit, CPU seconds of the whole job: launcher and workers)."""
    cpu_before = children_cpu_s()
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "trainer", f"strategy={args.strategy}", f"trainer.devices={args.devices}",
                   f"trainer.max_steps={args.steps}", f"trainer.log_every={args.log_every}", "trainer.val_every=0",
                   "trainer.val_batches=1", "lr_schedule.warmup_steps=1", "trainer.save_final=false",
                   "trainer.peak_flops=1e12", f"hydra.run.dir={run_dir}", *(OFF if variant == "off" else [])]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if result.returncode != 0:
            raise SystemExit(f"{variant} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        return summary["tokens"] / summary["wall_s"], children_cpu_s() - cpu_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10, help="the default trainer.log_every")
    parser.add_argument("--repeats", type=int, default=2, help="ABBA rounds (each runs both variants twice)")
    args = parser.parse_args()

    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in (*VARIANTS, *reversed(VARIANTS)):
            tokens_per_s, cpu_s = run(variant, args)
            runs[variant].append(tokens_per_s)
            cpu[variant].append(cpu_s)
            print(f"{variant}: {tokens_per_s:,.0f} tokens/s, {cpu_s:.1f} CPU s for the whole job", flush=True)
    medians = {v: statistics.median(runs[v]) for v in VARIANTS}
    cpu_medians = {v: statistics.median(cpu[v]) for v in VARIANTS}
    report: dict[str, Any] = {"tokens_per_s_median": medians, "tokens_per_s_runs": runs,
                              "ratio_on_to_off": medians["on"] / medians["off"], "cpu_s_runs": cpu,
                              "cpu_ratio_on_to_off": cpu_medians["on"] / cpu_medians["off"], "settings": vars(args)}
    print(f"records + watchdog on / off: tokens/s {report['ratio_on_to_off']:.3f}, "
          f"CPU seconds of the job {report['cpu_ratio_on_to_off']:.3f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
