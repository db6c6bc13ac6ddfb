"""`grad_sync=auto` (trainer/planner/accumulation.py): FSDP2-sharded runs reduce once per optimizer step when
the planner finds that the whole gradients and parameters fit the device, else per micro-batch. The run
settles it before it builds the strategy (`trainer.run.settle_grad_sync`), which is then built with the
settled value. The runs that check the collectives and the parity of the resolved settings are in
tests/test_strategies.py."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import yaml
from hydra.utils import instantiate

from trainer.config import ConfigError, compose, validate
from trainer.planner import plan
from trainer.planner.accumulation import choose_grad_sync, this_machine
from trainer.planner.core import hardware_from_config
from trainer.plugins.strategies import FSDPOptions, FSDPSharding
from trainer.run import build_trainer, settle_grad_sync

TINY_ACCUMULATING = ["strategy=zero3", "trainer.devices=2", "trainer.micro_batch_size=4"]  # 16 / (4 x 2) = 2
# Llama-2-13B on 8 H100s, bf16, 2 micro-batches a step: the gradient shards fit, whole gradients do not.
BIG = ["model=llama2_13b", "hardware=h100_80g", "strategy=zero3", "trainer.devices=8", "trainer.seq_len=4096",
       "trainer.micro_batch_size=1", "trainer.global_batch_size=16", "precision=bf16", "activation_checkpointing=full"]


def choice(overrides: list[str]) -> tuple[str, bool]:
    cfg = compose(overrides)
    chosen = choose_grad_sync(cfg, hardware_from_config(cfg))
    assert chosen is not None
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
    assert FSDPSharding("full_shard", FSDPOptions(grad_sync="step")).reshard_after_backward is False  # whole anyway
    assert FSDPSharding("full_shard", FSDPOptions(grad_sync="microbatch")).reshard_after_backward is True
    assert FSDPSharding("full_shard", FSDPOptions(grad_sync="step", reshard_after_backward=True)).reshard_after_backward
    # not settled (the planner's exact mode, validation, a strategy built by hand): FSDP2's defaults, per micro-batch
    unsettled = FSDPSharding("full_shard", FSDPOptions())
    assert unsettled.options.grad_sync == "auto"
    assert isinstance(unsettled.backward_sync(torch.nn.Linear(1, 1), last_microbatch=False), contextlib.nullcontext)
    assert unsettled.planner_fields()["reshard_after_backward"] is True


def test_the_run_settles_auto_before_it_builds_the_strategy_and_every_rank_agrees() -> None:
    """settle_grad_sync asks the planner (with the plugins handed to it), lets `agree` (an all-reduce in a
    run) have the last word, and writes the answer into the config the strategy is then built from."""
    cfg = compose(TINY_ACCUMULATING)
    precision, checkpointing = instantiate(cfg.precision), instantiate(cfg.activation_checkpointing)
    asked: list[bool] = []
    # another rank's memory is short: every rank reduces per micro-batch
    chosen = settle_grad_sync(cfg, precision, checkpointing, torch.device("cpu"),
                              agree=lambda fits: asked.append(fits) or False)
    assert asked == [True] and chosen is not None
    assert (chosen.grad_sync, chosen.reshard_after_backward) == ("microbatch", True)
    assert chosen.describe().startswith("grad_sync=auto -> microbatch (another rank's memory decided): whole "
                                        "gradients and parameters fit")
    assert (cfg.strategy.grad_sync, cfg.strategy.reshard_after_backward) == ("microbatch", True)
    built = instantiate(cfg.strategy).fsdp
    assert (built.options.grad_sync, built.reshard_after_backward) == ("microbatch", True)
    # every rank fits
    cfg = compose(TINY_ACCUMULATING)
    chosen = settle_grad_sync(cfg, precision, checkpointing, torch.device("cpu"), agree=lambda fits: fits)
    assert chosen is not None and chosen.describe().startswith("grad_sync=auto -> step: whole gradients")
    assert instantiate(cfg.strategy).fsdp.options.grad_sync == "step"
    # nothing to settle, and no collective: set explicitly, or a flavour that reduces once per step anyway
    for overrides in (TINY_ACCUMULATING + ["strategy.grad_sync=microbatch"],
                      ["strategy=3d", "strategy.data_parallel=zero1", "trainer.devices=2", "trainer.micro_batch_size=4"],
                      ["strategy=ddp", "trainer.devices=2", "trainer.micro_batch_size=4"]):
        cfg = compose(overrides)
        before = cfg.strategy.get("grad_sync", None)
        assert settle_grad_sync(cfg, precision, checkpointing, torch.device("cpu"), agree=pytest.fail) is None
        assert cfg.strategy.get("grad_sync", None) == before


def test_a_run_builds_its_strategy_with_the_settled_choice_and_records_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One process (a world of one), 2 micro-batches a step: auto settles to step before the strategy exists,
    the strategy holds it from its construction and config.yaml records it."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    overrides = ["strategy=zero3", "trainer.devices=1", "trainer.micro_batch_size=8", "model.dim=32",
                 "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden_dim=64",
                 "trainer.seq_len=32", "trainer.max_steps=1", "data.max_bytes=100000", "callbacks=none"]
    trainer = build_trainer(compose(overrides), tmp_path)
    strategy = trainer.strategy
    try:
        assert (strategy.fsdp.options.grad_sync, strategy.fsdp.options.reshard_after_backward) == ("step", False)
        recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())["strategy"]
        assert (recorded["grad_sync"], recorded["reshard_after_backward"]) == ("step", False)
    finally:
        del trainer
        strategy.teardown()


def test_the_strategy_adopts_the_process_group_the_run_joined_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run joins the group before it builds the strategy (to agree on grad_sync); the strategy then owns
    it and destroys it at teardown. A group some other program made stays that program's."""
    import torch.distributed as dist

    from trainer.plugins.strategies.distributed import init_process_group

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for adopt in (True, False):
        assert init_process_group(torch.device("cpu"))  # a group of one, as the run makes it
        try:
            strategy = instantiate(compose(["strategy=zero3"]).strategy)
            strategy.setup_environment("cpu", 1, adopt_process_group=adopt)
            strategy.teardown()
            assert dist.is_initialized() is not adopt
        finally:  # leave no group to the tests after this one
            if dist.is_initialized():
                dist.destroy_process_group()


def test_auto_with_an_explicit_reshard_setting_is_refused() -> None:
    with pytest.raises(ConfigError, match="chosen together with grad_sync=auto"):
        validate(compose(["strategy=zero3", "strategy.reshard_after_backward=false"]))
    validate(compose(["strategy=zero3", "strategy.grad_sync=step", "strategy.reshard_after_backward=true"]))
