"""Bytes each rank holds under ddp / zero1 / zero2 / zero3, measured, against ZeRO's table.

Rajbhandari et al. 2020 (Sec. 3.1, Fig. 1): with Psi parameters, N data-parallel ranks and mixed-precision
Adam (2 bytes of weights, 2 of gradients, K = 12 of optimizer state: fp32 master, momentum, variance per
parameter), a rank holds
    baseline (ddp)  2 Psi + 2 Psi + 12 Psi
    stage 1 (P_os)  2 Psi + 2 Psi + 12 Psi / N
    stage 2 (P_os+g) 2 Psi + (2 + 12) Psi / N
    stage 3 (P_os+g+p) (2 + 2 + 12) Psi / N
`precision=bf16_true` (bf16 weights and gradients, fp32 master weights and Adam moments) is exactly that
mixed-precision setup, so each strategy runs one optimizer step on N processes with it and reports
`state_bytes_per_rank` from summary.json (what every rank holds after the step: its shards of parameters,
gradients and optimizer states, master copies included). Ratios measured / formula are printed; shards are
ceil-sized row chunks, so small tensors make them slightly above 1 / N.

    python benchmarks/zero_memory.py                 # N = 4, the 3.3M-parameter tiny Llama (~2 min on 2 cores)
    python benchmarks/zero_memory.py --devices 2

The last line printed is one JSON object with every figure.
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
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# (weights, gradients, optimizer) divided by N or not, per strategy: ZeRO's stages 0-3
SHARDED = {"ddp": (False, False, False), "zero1": (False, False, True), "zero2": (False, True, True),
           "zero3": (True, True, True)}
BYTES = {"params": 2, "grads": 2, "optimizer": 12}


def formula(strategy: str, psi: int, n: int) -> dict[str, float]:
    return {kind: BYTES[kind] * psi / (n if sharded else 1)
            for kind, sharded in zip(("params", "grads", "optimizer"), SHARDED[strategy])}


def run(strategy: str, devices: int, out: Path) -> dict:
    command = [sys.executable, "-m", "trainer", f"strategy={strategy}", f"trainer.devices={devices}",
               "precision=bf16_true", "trainer.max_steps=1", "trainer.val_every=0", "trainer.val_batches=1",
               "trainer.log_every=1", "lr_schedule.warmup_steps=0", "trainer.seq_len=64",
               f"trainer.global_batch_size={4 * devices}", "trainer.micro_batch_size=4", "callbacks=none",
               "data.max_bytes=1000000", f"hydra.run.dir={out / strategy}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        sys.exit(f"{strategy} failed:\n{result.stderr[-3000:]}")
    return json.loads((out / strategy / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="data-parallel ranks N")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in STRATEGIES:
            summary = run(strategy, args.devices, Path(tmp))
            psi = summary["num_params"]
            expected = formula(strategy, psi, args.devices)
            held = summary["state_bytes_per_rank"]
            worst = {kind: max(rank[kind] for rank in held) for kind in BYTES}
            rows.append({"strategy": strategy, "num_params": psi, "ranks": args.devices, "measured_max_rank": worst,
                         "formula": expected, "ratio": {k: worst[k] / expected[k] for k in BYTES}})
    print(f"N = {args.devices}, Psi = {rows[0]['num_params']:,} parameters, precision=bf16_true (ZeRO's 2 + 2 + 12)")
    print(f"{'strategy':<9}{'params MiB':>22}{'grads MiB':>22}{'optimizer MiB':>22}   (measured / ZeRO formula)")
    for row in rows:
        cells = "".join(f"{row['measured_max_rank'][k] / 2**20:>10.2f} / {row['formula'][k] / 2**20:>8.2f}  "
                        for k in BYTES)
        ratios = ", ".join(f"{row['ratio'][k]:.3f}" for k in BYTES)
        print(f"{row['strategy']:<9}{cells}  ratios {ratios}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
