"""Runs several training configurations inside one torchrun launch.

Starting processes costs seconds on a 2-core machine, so the multi-process tests batch their runs:
`torchrun --nproc-per-node N tests/distributed_harness.py SPEC.json`, where SPEC lists named override
lists. Each run writes, from rank 0, `<out>/<name>/summary.json` (with per-step losses from metrics.csv
next to it) and `<out>/<name>/weights.pt` (the full final weights).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import compose  # noqa: E402
from trainer.launch import configure_worker_logging  # noqa: E402
from trainer.run import build_trainer  # noqa: E402


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    configure_worker_logging(rank, out)
    for run in spec["runs"]:
        run_dir = out / run["name"]
        trainer = build_trainer(compose(run["overrides"]), run_dir)
        summary = trainer.fit()
        weights = trainer.strategy.full_state_dict(trainer.model_parts)
        if rank == 0:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            torch.save(weights, run_dir / "weights.pt")
        dist.barrier()
        # Drop each run (DDP's reducer holds the process group) while the group lives: see
        # trainer.run.train. The group itself is this script's, so teardown leaves it alone.
        trainer.strategy.teardown()
        trainer = None
        gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
