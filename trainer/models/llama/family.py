"""The Llama family's declaration (`trainer.interfaces.ModelFamily`): Llama 2/3 and the Mixtral-style MoE."""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from trainer.interfaces.inventory import ModelInventory
from trainer.interfaces.model_family import BlockSplit, QKClipAttention
from trainer.models.decoder import DecoderFamily, pre_norm_block_split
from trainer.models.llama import planner
from trainer.models.llama.hf_adapter import LlamaHFAdapter
from trainer.models.llama.model import Attention, Llama, LlamaConfig

# Grouped-query attention: wq/wk/wv split by heads (each rank keeps n_heads/tp query heads and
# n_kv_heads/tp key/value heads, so the grouping stays local), wo row-parallel.
GQA_COLUMN = ("attention.wq", "attention.wk", "attention.wv")
GQA_ROW = ("attention.wo",)


def gqa_sizes(config: Any) -> list[tuple[str, int, str]]:
    """What tp must divide in a grouped-query-attention SwiGLU model (Llama, Qwen3)."""
    return [("model.n_heads", config.n_heads, "query heads"),
            ("model.n_kv_heads", config.num_kv_heads, "key/value heads"),
            ("model.ffn_hidden_dim", config.hidden_dim, "MLP hidden width"),
            ("model.vocab_size", config.vocab_size, "vocabulary rows")]


class LlamaFamily(DecoderFamily):
    name = "llama"
    config_class = LlamaConfig
    model_class = Llama
    hf_adapter = LlamaHFAdapter()

    def block_split(self, block: nn.Module) -> BlockSplit:
        return pre_norm_block_split(block, attention_args=3, column=GQA_COLUMN, row=GQA_ROW)

    def tensor_parallel_sizes(self, config: LlamaConfig) -> list[tuple[str, int, str]]:
        return gqa_sizes(config)

    def parameter_inventory(self, config: LlamaConfig) -> ModelInventory:
        return planner.inventory(config)

    def unsupported_qk_clip(self, config: LlamaConfig) -> Optional[str]:
        return None  # RoPE'd q = wq x, k = wk x: scaling a head's rows scales its logits

    def qk_clip_attention(self, model: nn.Module) -> list[tuple[str, QKClipAttention]]:
        # every Attention under the model, whatever wraps it or its blocks (DDP, activation checkpointing,
        # compile); the key is the block's index in the module path
        return [(next((part for part in name.split(".") if part.isdigit()), name),
                 QKClipAttention(module.core_attention, module.wq.weight, module.wk.weight, module.head_dim))
                for name, module in model.named_modules() if isinstance(module, Attention)]


FAMILY = LlamaFamily()
