"""Which process this is: a worker started by torchrun or srun, or a plain `python -m trainer`.

A leaf module (the standard library only), read both by config validation (a multi-node run needs a
rendezvous address unless a launcher started it) and by trainer/launch.py (whether to start workers).
"""

from __future__ import annotations

import os


def distributed_environment() -> str | None:
    """`torchrun` or `slurm` when this process is already one of the workers, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return "torchrun"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return "slurm"
    return None
