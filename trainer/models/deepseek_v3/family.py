"""The DeepSeek-V3 family's declaration (`trainer.interfaces.ModelFamily`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.nn as nn

from trainer.interfaces.inventory import ModelInventory
from trainer.interfaces.model_family import BlockSplit, StageModules
from trainer.models.decoder import DecoderFamily, pre_norm_block_split
from trainer.models.deepseek_v3 import planner
from trainer.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from trainer.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Config


class DeepSeekV3Family(DecoderFamily):
    name = "deepseek_v3"
    config_class = DeepSeekV3Config
    model_class = DeepSeekV3
    hf_adapter = DeepSeekV3HFAdapter()

    def block_split(self, block: nn.Module) -> BlockSplit:
        # Multi-head latent attention split by heads: the per-head up-projections (wq or wq_b, wkv_b)
        # column-parallel, wo row-parallel; the low-rank down-projections wq_a/wkv_a and their norms produce
        # the latents every head reads (and the shared rotary key), so every rank computes them whole.
        attention = block.attention
        full_rank_q = attention.wq is not None  # type: ignore[union-attr]
        column = ("attention.wq",) if full_rank_q else ("attention.wq_b",)
        replicated = ("attention.wkv_a", "attention.kv_norm") + (() if full_rank_q else ("attention.wq_a", "attention.q_norm"))
        return pre_norm_block_split(block, attention_args=3, column=column + ("attention.wkv_b",),
                                    row=("attention.wo",), replicated=replicated, head_groups=("attention",))

    def tensor_parallel_blocks(self, model: nn.Module) -> list[nn.Module]:
        # the multi-token-prediction blocks split as the main ones (their input is the residual stream too)
        return [*super().tensor_parallel_blocks(model), *(depth.block for depth in model.mtp.values())]  # type: ignore[union-attr]

    def stage_modules(self, model: nn.Module) -> StageModules:
        ends = super().stage_modules(model)
        depths = [f"mtp.{key}" for key in model.mtp.keys()]  # type: ignore[union-attr]
        return dataclasses.replace(
            ends, residual_norms=tuple(f"{d}.{norm}" for d in depths for norm in ("enorm", "hnorm", "norm")),
            residual_linears=tuple(f"{d}.eh_proj" for d in depths))

    def tensor_parallel_sizes(self, config: DeepSeekV3Config) -> list[tuple[str, int, str]]:
        return [("model.n_heads", config.n_heads, "attention heads"),
                ("model.ffn_hidden_dim", config.ffn_hidden_dim, "dense MLP hidden width"),
                ("model.vocab_size", config.vocab_size, "vocabulary rows")]

    def unsupported_parallelism(self, config: DeepSeekV3Config, *, tp: int, pp: int,
                                cp: int) -> Optional[tuple[str, str]]:
        """Data-parallel strategies need nothing from a family; expert parallelism splits every DeepSeekMoE
        (the MTP module's too) and tensor parallelism follows `block_split`. Pipeline and context
        parallelism are not built for this family."""
        del tp
        why = {
            "pp": "pipeline parallelism cannot split DeepSeek-V3 yet (its MTP module needs the embedding and "
                  "the main model's last hidden states on one stage)",
            "cp": "context parallelism is not built for DeepSeek-V3 (MLA's attention core and MTP's shifted "
                  "tokens across sequence shards)",
        }
        for key, size in (("pp", pp), ("cp", cp)):
            if size > 1:
                return key, (f"{key}={size} with model {config.name}: {why[key]} (DeepSeek-V3 runs with "
                             "strategy=single, ddp, zero1, zero2, zero3, fsdp or tp, and ep)")
        return None

    def parameter_inventory(self, config: DeepSeekV3Config) -> ModelInventory:
        return planner.inventory(config)


FAMILY = DeepSeekV3Family()
