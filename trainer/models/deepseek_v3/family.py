"""The DeepSeek-V3 family's declaration (`trainer.interfaces.ModelFamily`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from trainer.interfaces.inventory import ModelInventory
from trainer.interfaces.model_family import BlockSplit, StageModules
from trainer.models.decoder import DecoderFamily, pre_norm_block_split
from trainer.models.deepseek_v3 import planner
from trainer.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from trainer.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Config, MTPLosses


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
        # (a pipeline stage other than the last holds none)
        depths = model.mtp.values() if model.mtp is not None else ()  # type: ignore[union-attr]
        return [*super().tensor_parallel_blocks(model), *(depth.block for depth in depths)]

    def stage_modules(self, model: nn.Module) -> StageModules:
        ends = super().stage_modules(model)
        depths = [f"mtp.{key}" for key in (model.mtp.keys() if model.mtp is not None else ())]  # type: ignore[union-attr]
        return dataclasses.replace(
            ends, residual_norms=tuple(f"{d}.{norm}" for d in depths for norm in ("enorm", "hnorm", "norm")),
            residual_linears=tuple(f"{d}.eh_proj" for d in depths))

    def end_stage_copies(self, model: nn.Module) -> tuple[str, ...]:
        # multi-token prediction embeds the shifted tokens on the last stage: it holds a copy of the embedding
        return ("tok_embeddings",) if model.config.mtp_depth else ()  # type: ignore[union-attr]

    def sum_statistics_over_stages(self, model_parts: Sequence[nn.Module],
                                   all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # every stage holds an `MTPLosses` (the same number on every pp rank); the last stage's records the losses
        super().sum_statistics_over_stages(model_parts, all_reduce_sum)  # the MoE layers' rows
        holders = [module for part in model_parts for module in part.modules() if isinstance(module, MTPLosses)]
        if not holders or not holders[0].depth:
            return
        mine = torch.tensor([holder.totals() for holder in holders], dtype=torch.float64).sum(0)
        total = all_reduce_sum(mine).tolist()
        for holder in holders:  # each copy reports the step's losses
            holder.set_totals(total)

    def moe_layer_keys(self, config: DeepSeekV3Config) -> list[str]:
        # the DeepSeekMoE blocks after the dense ones, then each MTP depth's block (keyed n_layers + k - 1)
        return [str(i) for i in range(config.first_k_dense_replace, config.n_layers + config.mtp_depth)]

    def tensor_parallel_sizes(self, config: DeepSeekV3Config) -> list[tuple[str, int, str]]:
        return [("model.n_heads", config.n_heads, "attention heads"),
                ("model.ffn_hidden_dim", config.ffn_hidden_dim, "dense MLP hidden width"),
                ("model.vocab_size", config.vocab_size, "vocabulary rows")]

    def unsupported_qk_clip(self, config: DeepSeekV3Config) -> Optional[str]:
        return ("QK-clip for multi-head latent attention (Kimi K2's rule: q_C, k_C by sqrt(gamma), q_R by gamma, "
                "the shared k_R untouched) is not implemented; unset optimizer.qk_clip_tau")

    def unsupported_parallelism(self, config: DeepSeekV3Config, *, tp: int, pp: int,
                                cp: int) -> Optional[tuple[str, str]]:
        """Every layout is supported. Data-parallel strategies need nothing from a family; expert parallelism
        splits every DeepSeekMoE (the MTP module's too), tensor parallelism follows `block_split`, the
        pipeline puts the MTP module on the last stage with a copy of the embedding (`end_stage_copies`), and
        context parallelism (both methods) runs MLA's core attention across the cp ranks with its own
        softmax scale and value width, the MTP depths on this rank's part of the whole sequence's shifted
        tokens (gathered over the cp group), and the routing statistics of whole sequences."""
        del config, tp, pp, cp
        return None

    def parameter_inventory(self, config: DeepSeekV3Config) -> ModelInventory:
        return planner.inventory(config)


FAMILY = DeepSeekV3Family()
