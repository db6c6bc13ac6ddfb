"""Model families and the meta-device build path shared by every training strategy.

Each family is one folder declaring the model-family contract (`trainer.interfaces.ModelFamily`) in its
`family.py`; `FAMILIES` registers them and `family_of` finds the family of a config or a model (a pipeline
stage or a wrapped model too). Adding a family is its folder, one line here and its conf/model files.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainer.interfaces.model_family import ModelFamily
from trainer.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from trainer.models.deepseek_v3.family import FAMILY as DEEPSEEK_V3
from trainer.models.gpt import GPT, GPTConfig
from trainer.models.gpt.family import FAMILY as GPT_FAMILY
from trainer.models.llama import Llama, LlamaConfig
from trainer.models.llama.family import FAMILY as LLAMA
from trainer.models.qwen3 import Qwen3, Qwen3Config
from trainer.models.qwen3.family import FAMILY as QWEN3

ModelConfig = Union[LlamaConfig, GPTConfig, Qwen3Config, DeepSeekV3Config]

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (LLAMA, GPT_FAMILY, QWEN3, DEEPSEEK_V3)}

# Schema of each model family, registered in Hydra's ConfigStore as `<name>_schema` by
# trainer.config.register_configs (conf/model/*.yaml names it in its defaults list).
SCHEMAS: dict[str, type] = {name: family.config_class for name, family in FAMILIES.items()}


def family_of(obj: Any) -> ModelFamily:
    """The family of a model config (dataclass or structured DictConfig), a config class, or a model
    (a pipeline stage, an FSDP/replicate-wrapped model, whose classes derive from the family's; a compiled
    or DDP-wrapped one)."""
    if isinstance(obj, DictConfig):
        obj = OmegaConf.to_object(obj)
    module = obj
    while module is not None:
        for family in FAMILIES.values():
            if (isinstance(module, (family.config_class, family.model_class))
                    or (isinstance(module, type) and issubclass(module, family.config_class))):
                return family
        # torch.compile's wrapper holds the model as `_orig_mod`, DistributedDataParallel as `module`
        inner = getattr(module, "_orig_mod", None) or getattr(module, "module", None)
        module = inner if isinstance(module, nn.Module) and isinstance(inner, nn.Module) else None
    known = ", ".join(FAMILIES)
    raise TypeError(f"{type(obj).__name__} belongs to no model family (known: {known})")


__all__ = [
    "FAMILIES",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "Qwen3",
    "Qwen3Config",
    "SCHEMAS",
    "build_meta_model",
    "build_model",
    "family_of",
]


def _as_dataclass(config: Any) -> Any:
    # A structured DictConfig (e.g. cfg.model composed from the registered schema)
    # converts back to its dataclass; anything else must already be one.
    if isinstance(config, DictConfig):
        config = OmegaConf.to_object(config)
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(
            f"expected a model config dataclass instance, got {type(config).__name__}"
        )
    return config


def build_meta_model(config: ModelConfig) -> nn.Module:
    """Construct the model named by ``config._target_`` on the meta device (no memory).

    Use this to shard/wrap before materializing; afterwards call
    ``model.to_empty(device=...)`` and ``model.init_weights()``.
    """
    config = _as_dataclass(config)
    family = family_of(config)
    if get_class(config._target_) is not family.model_class:
        raise TypeError(f"model._target_={config._target_} is not the {family.name} family's model "
                        f"({family.model_class.__module__}.{family.model_class.__name__})")
    return family.build_meta_model(config)


def build_model(config: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """Construct on meta, materialize on ``device`` and initialize from the global RNG."""
    model = build_meta_model(config)
    model.to_empty(device=device)
    model.init_weights()
    return model
