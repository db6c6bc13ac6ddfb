"""`grad_sync=auto` (trainer/planner/accumulation.py): FSDP2-sharded runs reduce once per optimizer step when
the planner finds that the whole gradients and parameters fit the device, else per micro-batch. The runs
that check the collectives and the parity of the resolved settings are in tests/test_strategies.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from trainer.config import ConfigError, compose, validate
from trainer.planner import plan
from trainer.planner.accumulation import choose_grad_sync, this_machine
from trainer.planner.core import hardware_from_config
from trainer.plugins.strategies.fsdp import FSDPOptions

TINY_ACCUMULATING = ["strategy=zero3", "trainer.devices=2", "trainer.micro_batch_size=4"]  # 16 / (4 x 2) = 2
# Llama-2-13B on 8 H100s, bf16, 2 micro-batches a step: the gradient shards fit, whole gradients do not.
BIG = ["model=llama2_13b", "hardware=h100_80g", "strategy=zero3", "trainer.devices=8", "trainer.seq_len=4096",
       "trainer.micro_batch_size=1", "trainer.global_batch_size=16", "precision=bf16", "activation_checkpointing=full"]


def choice(overrides: list[str]) -> tuple[str, bool]:
    cfg = compose(overrides)
    chosen = choose_grad_sync(cfg, hardware_from_config(cfg))
    return chosen.grad_sync, chosen.reshard_after_backward


def test_auto_reduces_once_per_step_when_it_fits_and_per_microbatch_otherwise() -> None:
    assert choice(TINY_ACCUMULATING) == ("step", False)
    assert choice(BIG) == ("microbatch", True)
    # the same answer as the planner's reports: per micro-batch fits, once per step does not
    assert plan(compose(BIG + ["strategy.grad_sync=microbatch"])).fits
    assert not plan(compose(BIG + ["strategy.grad_sync=step"])).fits
    auto = plan(compose(BIG))
    assert auto.fits and auto.memory == plan(compose(BIG + ["strategy.grad_sync=microbatch"])).memory


def test_auto_without_accumulation_and_under_a_pipeline() -> None:
    assert choice(["strategy=zero3", "trainer.devices=2"]) == ("microbatch", True)  # one micro-batch a step
    # a pipeline schedule reduces once per step whatever is asked
    assert choice(["strategy=3d", "pp=2", "trainer.devices=2"])[0] == "step"


def test_this_machine_shares_host_memory_between_the_local_ranks_of_a_cpu_run() -> None:
    base = hardware_from_config(compose([]))
    one = this_machine(base, torch.device("cpu"), 1, host_bytes=24e9)
    four = this_machine(base, torch.device("cpu"), 4, host_bytes=24e9)
    assert one.memory_gb == pytest.approx(24.0) and four.memory_gb == pytest.approx(6.0)
    assert four.reserved_gb == 0.0 and four.devices_per_node == 4 and four.host_memory_gb == pytest.approx(24.0)


def test_explicit_settings_and_what_an_unresolved_auto_does() -> None:
    assert FSDPOptions(grad_sync="step").reshard_after_backward is False  # the whole gradient is held anyway
    assert FSDPOptions(grad_sync="microbatch").reshard_after_backward is True
    assert FSDPOptions(grad_sync="step", reshard_after_backward=True).reshard_after_backward is True
    options = FSDPOptions()
    assert options.grad_sync == "auto"
    # not resolved (the planner's exact mode, a strategy built by hand): FSDP2's defaults, per micro-batch
    assert isinstance(options.backward_sync(torch.nn.Linear(1, 1), last_microbatch=False), contextlib.nullcontext)
    assert options.planner_fields()["reshard_after_backward"] is True
    asked = []
    # every rank must take the same answer: `agree` (an all-reduce in a run) has the last word
    chosen = options.resolve_grad_sync(lambda: True, lambda fits: asked.append(fits) or False)
    assert asked == [True] and chosen == ("microbatch", True)
    assert (options.grad_sync, options.reshard_after_backward) == ("microbatch", True)
    assert options.resolve_grad_sync(lambda: True, lambda fits: fits) is None  # settled once
    assert FSDPOptions().resolve_grad_sync(lambda: True, lambda fits: fits) == ("step", False)


def test_auto_with_an_explicit_reshard_setting_is_refused() -> None:
    with pytest.raises(ConfigError, match="chosen together with grad_sync=auto"):
        validate(compose(["strategy=zero3", "strategy.reshard_after_backward=false"]))
    validate(compose(["strategy=zero3", "strategy.grad_sync=step", "strategy.reshard_after_backward=true"]))
