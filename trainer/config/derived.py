"""Quantities derived from a composed config: run length, world and data-parallel sizes, accumulation.

Small pure functions of a `DictConfig` (no side effects), used by validation, the training loop, the
launcher and the planner alike, so that every part of the project computes them the same way.
"""

from __future__ import annotations

import math

from hydra.utils import get_class
from omegaconf import DictConfig


def tokens_per_step(cfg: DictConfig) -> int:
    return int(cfg.trainer.global_batch_size) * int(cfg.trainer.seq_len)


def total_steps(cfg: DictConfig) -> int:
    """Optimizer steps of the run: the earlier of max_steps and max_tokens."""
    limits = []
    if cfg.trainer.max_steps is not None:
        limits.append(int(cfg.trainer.max_steps))
    if cfg.trainer.max_tokens is not None:
        limits.append(math.ceil(int(cfg.trainer.max_tokens) / tokens_per_step(cfg)))
    return min(limits)


def strategy_class(cfg: DictConfig) -> type:
    return get_class(cfg.strategy._target_)


def world_size(cfg: DictConfig) -> int:
    return int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)


def model_parallel_size(cfg: DictConfig) -> int:
    """Ranks that share one sample: tensor x pipeline x context parallel."""
    return int(cfg.tp) * int(cfg.pp) * int(cfg.cp)


def data_parallel_size(cfg: DictConfig) -> int:
    """Ranks that read distinct data: the world divided by the model-parallel sizes."""
    if not strategy_class(cfg).uses_dp:
        return 1
    if cfg.dp == "auto":
        return max(1, world_size(cfg) // model_parallel_size(cfg))
    return int(cfg.dp)


def gradient_accumulation_steps(cfg: DictConfig) -> int:
    per_step = int(cfg.trainer.micro_batch_size) * data_parallel_size(cfg)
    return int(cfg.trainer.global_batch_size) // per_step
