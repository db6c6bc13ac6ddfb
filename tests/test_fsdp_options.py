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
