"""The run seeds its generators as Lightning's `seed_everything` does, without importing Lightning."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from trainer.run import seed_everything


def generator_states() -> tuple[torch.Tensor, np.ndarray, tuple]:
    return torch.get_rng_state().clone(), np.random.get_state()[1].copy(), random.getstate()


@pytest.mark.parametrize("seed", [0, 1234, 2**31 - 1])
def test_the_same_generator_states_as_lightnings_seed_everything(seed: int) -> None:
    from lightning.fabric.utilities.seed import seed_everything as lightning_seed_everything

    seed_everything(seed)
    ours = generator_states()
    torch.rand(3), np.random.rand(3), random.random()  # move them on: the second seeding must reset them
    lightning_seed_everything(seed, verbose=False)
    theirs = generator_states()
    assert torch.equal(ours[0], theirs[0])
    assert np.array_equal(ours[1], theirs[1])
    assert ours[2] == theirs[2]


def test_building_and_running_a_trainer_does_not_import_lightning() -> None:
    """Importing lightning costs every process seconds (torchmetrics, scipy, torch._dynamo): the modules a
    worker imports leave it out, and only the throughput monitor and the wandb/TensorBoard loggers load it."""
    code = ("import sys; import trainer.run, trainer.cli, trainer.plugins.callbacks, trainer.plugins.loggers, "
            "trainer.plugins.strategies, trainer.plugins.precision; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'torchmetrics', 'scipy')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
