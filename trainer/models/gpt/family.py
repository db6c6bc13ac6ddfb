"""The GPT-2/3 family's declaration (`trainer.interfaces.ModelFamily`)."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from trainer.interfaces.inventory import ModelInventory
from trainer.interfaces.model_family import BlockSplit
from trainer.models.decoder import DecoderFamily, pre_norm_block_split
from trainer.models.gpt import planner
from trainer.models.gpt.model import GPT, GPTConfig


class GPTFamily(DecoderFamily):
    name = "gpt"
    config_class = GPTConfig
    model_class = GPT

    def unsupported_qk_clip(self, config: GPTConfig) -> Optional[str]:
        return ("QK-clip is not implemented for GPT's fused, biased wqkv projection (and its attention kernels); "
                "unset optimizer.qk_clip_tau")

    def block_split(self, block: nn.Module) -> BlockSplit:
        # The fused wqkv is laid out head by head ([n_heads, 3, head_dim]), so its contiguous row split gives
        # each rank whole heads with their q, k and v.
        return pre_norm_block_split(block, attention_args=2, column=("attention.wqkv",), row=("attention.wo",))

    def tensor_parallel_sizes(self, config: GPTConfig) -> list[tuple[str, int, str]]:
        return [("model.n_heads", config.n_heads, "query heads"),
                ("model.ffn_hidden_dim", config.hidden_dim, "MLP hidden width"),
                ("model.vocab_size", config.vocab_size, "vocabulary rows")]

    def parameter_inventory(self, config: GPTConfig) -> ModelInventory:
        return planner.inventory(config)


FAMILY = GPTFamily()
