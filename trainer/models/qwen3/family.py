"""The Qwen3 family's declaration (`trainer.interfaces.ModelFamily`): dense and MoE."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from trainer.interfaces.inventory import ModelInventory
from trainer.interfaces.model_family import BlockSplit
from trainer.models.decoder import DecoderFamily, pre_norm_block_split
from trainer.models.llama.family import GQA_COLUMN, GQA_ROW, gqa_sizes
from trainer.models.qwen3 import planner
from trainer.models.qwen3.hf_adapter import Qwen3HFAdapter
from trainer.models.qwen3.model import Qwen3, Qwen3Config


class Qwen3Family(DecoderFamily):
    """Every strategy runs Qwen3, dense and MoE (nothing in `unsupported_parallelism`): tensor and context
    parallelism split it as they split the Llama (the q/k norms declared as per-head norms; the pooled
    balance loss sums its statistics over the cp ranks), and so does pipeline parallelism. The MoE
    variant's balance loss pools the routing statistics of all MoE layers of one forward (each layer's
    gradient has a coefficient that depends on every layer's counts): each stage passes the sums of the
    layers up to its own on with the hidden states, and the last stage sends the whole model's back as the
    gradient of that extra stage output (`carry_into_stage`, `carry_out_of_stage`; `_CarryBalanceOn` in
    model.py), so every stage's backward has them, with every schedule and any number of micro-batches."""

    name = "qwen3"
    config_class = Qwen3Config
    model_class = Qwen3
    hf_adapter = Qwen3HFAdapter()

    def block_split(self, block: nn.Module) -> BlockSplit:
        # Llama's split, plus the q/k RMSNorms: one head_dim gain shared by every head, applied to each
        # rank's own heads, so its gradient is a sum over the tp ranks.
        return pre_norm_block_split(block, attention_args=3, column=GQA_COLUMN, row=GQA_ROW,
                                    head_norms=("attention.q_norm", "attention.k_norm"))

    def tensor_parallel_sizes(self, config: Qwen3Config) -> list[tuple[str, int, str]]:
        return gqa_sizes(config)

    # ---- pipeline: the pooled balance statistics travel with the hidden states ------------------------
    def carry_into_stage(self, model: nn.Module, carried: tuple[torch.Tensor, ...]) -> None:
        model.pipeline_carried = tuple(carried)  # type: ignore[assignment]

    def carry_out_of_stage(self, model: nn.Module) -> tuple[torch.Tensor, ...]:
        carried: tuple[torch.Tensor, ...] = model.pipeline_carry_out  # type: ignore[assignment]
        model.pipeline_carry_out = ()  # type: ignore[assignment]
        return carried

    def moe_layer_keys(self, config: Qwen3Config) -> list[str]:
        return [str(i) for i in config.sparse_layers] if config.is_moe else []

    def unsupported_planning(self, config: Qwen3Config) -> Optional[tuple[str, str]]:
        sparse = config.sparse_layers
        if not sparse or len(sparse) == config.n_layers:
            return None
        return ("model.mlp_only_layers",
                f"model {config.name} mixes dense and MoE layers (mlp_only_layers={list(config.mlp_only_layers)}, "
                f"decoder_sparse_step={config.decoder_sparse_step}), which the planner does not model yet: "
                "set trainer.preflight=false to train it without the memory check")

    def unsupported_qk_clip(self, config: Qwen3Config) -> Optional[str]:
        return ("Qwen3 RMS-normalises each head's q and k after the projections (QK-norm), so scaling wq/wk rows "
                "does not change the logits: QK-clip does not apply (QK-norm already bounds them); "
                "unset optimizer.qk_clip_tau")

    def parameter_inventory(self, config: Qwen3Config) -> ModelInventory:
        return planner.inventory(config)


FAMILY = Qwen3Family()
