"""The planner's parameter inventory: what the model family tells the planner about every weight.

The planner never builds a model to count: each family lists its parameters with their shapes and
tensor-parallel splits in its own `planner.py` (trainer/models/<family>/, `ModelFamily.parameter_inventory`),
in the vocabulary of `trainer.interfaces.inventory` (`ParamSpec`, `ModelInventory`, re-exported here for the
planner's modules), so that the bytes a rank holds follow from the parallel sizes alone, for any model size.
Tests check the totals against the real modules (`CausalLM.num_params`) and against the published Llama
parameter counts.
"""

from __future__ import annotations

from typing import Any

from trainer.interfaces.inventory import EMBEDDING, HEAD, LAYER, ModelInventory, ParamSpec
from trainer.models import family_of

__all__ = ["EMBEDDING", "HEAD", "LAYER", "ModelInventory", "ParamSpec", "inventory"]


def inventory(model_cfg: Any) -> ModelInventory:
    """The inventory of a model config dataclass (`trainer.planner.layout.model_config`), from its family."""
    return family_of(model_cfg).parameter_inventory(model_cfg)
