"""The planner's step time and peak memory against measured runs: `mode=plan plan.calibrate=true` for single,
ddp, zero3, tp=2 and pp=2 (2 processes for the distributed ones), the default tiny model and batch, one
thread per process.

Each configuration is one `python -m trainer ... mode=plan plan.calibrate=true` (trainer/planner/calibrate.py):
a few steps trained on this machine, the hardware measured during the same run (matmul FLOP/s and memory
bandwidth per process with all processes busy, each group's latency and bandwidth), the plan predicted on
that profile. Targets: step time within 35%, peak memory within 15% (|predicted / measured - 1|). The
configurations run one after another; the last line is one JSON object with every figure.

    python benchmarks/planner_time.py [--steps 8] [--warmup 2] [--only ddp,pp2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "zero3": ["strategy=zero3", "trainer.devices=2"],
    "tp2": ["strategy=tp", "tp=2", "trainer.devices=2"],
    "pp2": ["strategy=pp", "pp=2", "trainer.devices=2"],
}
TIME_TARGET, MEMORY_TARGET = 0.35, 0.15


def calibrate(name: str, overrides: list[str], steps: int, warmup: int, root: Path) -> dict:
    run_dir = root / name
    command = [sys.executable, "-m", "trainer", *overrides, "mode=plan", "plan.calibrate=true",
               f"plan.calibrate_steps={steps}", f"plan.calibrate_warmup={warmup}", "trainer.num_threads=1",
               f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(done.stdout[done.stdout.index("calibration:"):].split("\ncalibration: /")[0], file=sys.stderr)
    return json.loads((run_dir / "calibration.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated names of " + ", ".join(CONFIGS))
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="planner_time-") as tmp:
        for name in args.only.split(","):
            report = calibrate(name, CONFIGS[name], args.steps, args.warmup, Path(tmp))
            p, m, r = report["predicted"], report["measured"], report["ratio"]
            rows[name] = {
                "command": "python -m trainer " + " ".join(CONFIGS[name]) + " mode=plan plan.calibrate=true",
                "predicted_step_s": p["step_time_s"], "measured_step_s": m["step_time_s"],
                "step_ratio": r["step_time_s"],
                "predicted_peak_mb": p["peak_memory_bytes"] / 1e6, "measured_peak_mb": m["peak_memory_bytes"] / 1e6,
                "memory_ratio": r["peak_memory_bytes"],
                "time_ok": abs(r["step_time_s"] - 1) <= TIME_TARGET,
                "memory_ok": abs(r["peak_memory_bytes"] - 1) <= MEMORY_TARGET,
                "predicted_parts_s": p["time_parts_s"], "measured_phases_s": m["phases_s"],
                "step_times_s": m["step_times_s"], "hardware": report["hardware"],
            }
    header = (f"{'config':<8}{'pred step s':>12}{'meas step s':>12}{'ratio':>7}{'pred peak MB':>14}"
              f"{'meas peak MB':>14}{'ratio':>7}  within 35% time / 15% memory")
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        print(f"{name:<8}{row['predicted_step_s']:>12.3f}{row['measured_step_s']:>12.3f}{row['step_ratio']:>7.2f}"
              f"{row['predicted_peak_mb']:>14.1f}{row['measured_peak_mb']:>14.1f}{row['memory_ratio']:>7.2f}  "
              f"{'yes' if row['time_ok'] else 'NO'} / {'yes' if row['memory_ok'] else 'NO'}")
    load = os.getloadavg()
    print(f"load average after the runs (1, 5, 15 min): {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          f"on {os.cpu_count()} cores")
    print(json.dumps({"configs": rows, "targets": {"time": TIME_TARGET, "memory": MEMORY_TARGET},
                      "load_average": load}, default=str))


if __name__ == "__main__":
    main()
