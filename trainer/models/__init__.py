"""Model families and the meta-device build path shared by every training strategy."""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainer.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from trainer.models.gpt import GPT, GPTConfig
from trainer.models.llama import Llama, LlamaConfig
from trainer.models.qwen3 import Qwen3, Qwen3Config

ModelConfig = Union[LlamaConfig, GPTConfig, Qwen3Config, DeepSeekV3Config]

# Schema of each model family, registered in Hydra's ConfigStore as `<name>_schema` by
# trainer.config.register_configs (conf/model/*.yaml names it in its defaults list).
SCHEMAS: dict[str, type] = {"llama": LlamaConfig, "gpt": GPTConfig, "qwen3": Qwen3Config,
                           "deepseek_v3": DeepSeekV3Config}

__all__ = [
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
    model_cls = get_class(config._target_)
    with torch.device("meta"):
        return model_cls(config)


def build_model(config: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """Construct on meta, materialize on ``device`` and initialize from the global RNG."""
    model = build_meta_model(config)
    model.to_empty(device=device)
    model.init_weights()
    return model
