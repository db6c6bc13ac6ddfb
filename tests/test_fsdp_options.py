"""FSDP2's options are one dataclass, `FSDPOptions`, for strategy=fsdp, zero3 and 3d: their schemas inherit its
fields (flat keys: `strategy.grad_sync=step`), each strategy holds one instance whole (`strategy.fsdp.options`)
and wraps the model through the same `FSDPSharding`, so an option cannot reach one strategy and miss another
(as 3d once missed reshard_last_block)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from trainer.config import compose
from trainer.models import build_meta_model
from trainer.parallel_dims import ParallelDims
from trainer.plugins.strategies import FSDPOptions

SHARDED = ["fsdp", "zero3", "3d"]
# A value other than the default for every field, all accepted together (the first test fails when a field
# is added without one).
CHANGED: dict[str, Any] = {
    "dp_replicate": 2,
    "prefetch_blocks": 3,
    "reshard_after_forward": False,
    "reshard_last_block": True,
    "offload_params": True,
    "offload_optimizer": True,
    "grad_sync": "step",
    "reshard_after_backward": True,
}
FIELDS = [field.name for field in dataclasses.fields(FSDPOptions)]


def override(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_option_has_a_changed_value_here() -> None:
    assert sorted(CHANGED) == sorted(FIELDS)
    assert all(CHANGED[field.name] != field.default for field in dataclasses.fields(FSDPOptions))


@pytest.mark.parametrize("strategy", SHARDED)
def test_every_option_is_a_key_of_the_config_and_reaches_the_strategy_whole(strategy: str) -> None:
    defaults = compose([f"strategy={strategy}"]).strategy
    assert issubclass(OmegaConf.get_type(defaults), FSDPOptions)  # type: ignore[arg-type]
    assert instantiate(defaults).fsdp.options == FSDPOptions()  # the same defaults
    cfg = compose([f"strategy={strategy}", *(f"strategy.{name}={override(value)}" for name, value in CHANGED.items())])
    built = instantiate(cfg.strategy)
    assert type(built.fsdp.options) is FSDPOptions
    assert built.fsdp.options == FSDPOptions(**CHANGED)


@pytest.mark.parametrize("strategy", SHARDED)
def test_the_options_checks_are_the_same_for_every_strategy(strategy: str) -> None:
    with pytest.raises(InstantiationException, match="prefetch_blocks must be >= 0"):
        instantiate(compose([f"strategy={strategy}", "strategy.prefetch_blocks=-1"]).strategy)
    with pytest.raises(InstantiationException, match="chosen together with grad_sync=auto"):
        instantiate(compose([f"strategy={strategy}", "strategy.reshard_after_backward=false"]).strategy)


@pytest.fixture
def fake_world() -> Iterator[None]:
    """A fake process group of 2 ranks (nothing sent), as the planner's exact mode uses."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def reshards_after_forward(strategy_overrides: list[str]) -> list[bool]:
    """Per block of a 2-layer model wrapped by the strategy on a fake world of 2 (meta device, dp = 2):
    whether FSDP2 frees its gathered parameters after its forward."""
    cfg = compose([*strategy_overrides, "trainer.devices=2", "model.n_layers=2", "model.dim=32", "model.n_heads=2",
                   "model.n_kv_heads=1", "model.ffn_hidden_dim=64"])
    strategy = instantiate(cfg.strategy)
    strategy.rank, strategy.world_size, strategy.device = 0, 2, torch.device("meta")
    strategy.init = "sharded"  # nothing to initialize on the meta device
    strategy.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, cp=1, world_size=2)
    strategy.parallel_dims.build_mesh("cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        (model,) = strategy.setup_model(build_meta_model(OmegaConf.to_object(cfg.model)),
                                        instantiate(cfg.activation_checkpointing), False)
    return [block._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
            for block in model.layers.values()]


@pytest.mark.parametrize("strategy", SHARDED)
def test_reshard_last_block_reaches_the_wrapping(fake_world: None, strategy: str) -> None:
    """Wrapping uses the options, not only holds them: the last block keeps its parameters for the backward
    unless reshard_last_block, in strategy=3d as in fsdp and zero3."""
    assert reshards_after_forward([f"strategy={strategy}"]) == [True, False]
    assert reshards_after_forward([f"strategy={strategy}", "strategy.reshard_last_block=true"]) == [True, True]
    assert reshards_after_forward([f"strategy={strategy}", "strategy.reshard_after_forward=false"]) == [False, False]


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_parameters_are_shards_again_after_the_final_validation(tmp_path: Any, strategy: str) -> None:
    """A forward without backward (validation) leaves the root unit and the last block gathered (they keep
    their parameters after a training forward for the backward that follows); the strategy frees them, so
    that after `fit` (and during the next steps and any checkpoint) every parameter is a DTensor shard again.
    Found on a GPU: a world of one showed plain tensors after training."""
    from torch.distributed.tensor import DTensor

    from trainer.run import build_trainer

    cfg = compose([f"strategy={strategy}", "trainer.devices=1", "trainer.seq_len=32", "trainer.global_batch_size=2",
                   "trainer.micro_batch_size=2", "trainer.max_steps=1", "trainer.val_every=0", "trainer.val_batches=1",
                   "data.max_bytes=100000", "callbacks=none", "model.n_layers=2", "model.dim=32", "model.n_heads=2",
                   "model.n_kv_heads=1", "model.ffn_hidden_dim=64", "lr_schedule.warmup_steps=0"])
    trainer = build_trainer(cfg, tmp_path)
    strategy_plugin = trainer.strategy
    try:
        trainer.fit()
        assert trainer.val_history  # the final validation ran
        kinds = {name: type(param).__name__ for name, param in trainer.model_parts[0].named_parameters()}
        assert set(kinds.values()) == {"DTensor"}, kinds
        assert all(isinstance(p, DTensor) for p in trainer.model_parts[0].parameters())
    finally:
        del trainer
        strategy_plugin.teardown()
