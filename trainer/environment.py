"""Which process this is: a worker started by torchrun or srun, or a plain `python -m trainer`.

A leaf module (the standard library only), read both by config validation (a multi-node run needs a
rendezvous address unless a launcher started it) and by trainer/launch.py (whether to start workers); the
preemption signals' names (validation, the loop, the launcher that forwards them).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence


def distributed_environment() -> str | None:
    """`torchrun` or `slurm` when this process is already one of the workers, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return "torchrun"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return "slurm"
    return None


def signal_numbers(names: Sequence[str]) -> list[signal.Signals]:
    """`["SIGTERM", "USR1", 15]` -> the signals; ValueError naming an unknown one."""
    numbers = []
    for name in names:
        text = str(name).strip().upper()
        try:
            number = signal.Signals(int(text)) if text.isdigit() else signal.Signals[
                text if text.startswith("SIG") else f"SIG{text}"]
        except (KeyError, ValueError):
            raise ValueError(f"unknown signal {name!r} (e.g. SIGTERM, SIGINT, SIGUSR1)") from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{number.name} cannot be caught")
        numbers.append(number)
    return numbers
