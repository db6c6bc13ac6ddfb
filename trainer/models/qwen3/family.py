"""The Qwen3 family's declaration (`trainer.interfaces.ModelFamily`): dense and MoE."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from trainer.interfaces.inventory import ModelInventory
from trainer.interfaces.model_family import BlockSplit
from trainer.models.decoder import DecoderFamily, pre_norm_block_split
from trainer.models.llama.family import GQA_COLUMN, GQA_ROW, gqa_sizes
from trainer.models.qwen3 import planner
from trainer.models.qwen3.hf_adapter import Qwen3HFAdapter
from trainer.models.qwen3.model import Qwen3, Qwen3Config


class Qwen3Family(DecoderFamily):
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

    def unsupported_parallelism(self, config: Qwen3Config, *, tp: int, pp: int, cp: int) -> Optional[tuple[str, str]]:
        """Tensor and context parallelism split Qwen3 as they split the Llama (q/k norms declared as per-head
        norms; the pooled balance loss sums its statistics over the cp ranks). The MoE variant's balance
        loss pools the routing statistics of all MoE layers of one forward (each layer's gradient has a
        coefficient that depends on every layer's counts), which pipeline stages would have to exchange
        between the last forward and the first backward: pp is refused for it while the loss is on."""
        del tp, cp
        if pp > 1 and config.is_moe and config.router_aux_loss_coef > 0:
            return "pp", (f"pp={pp}: the Qwen3-MoE balance loss pools every MoE layer's routing statistics of a "
                          f"forward, which pipeline stages cannot share yet (model {config.name}); use tp, cp, ep "
                          "or data parallelism, or model.router_aux_loss_coef=0 to pipeline it without the loss")
        return None

    def unsupported_planning(self, config: Qwen3Config) -> Optional[tuple[str, str]]:
        sparse = config.sparse_layers
        if not sparse or len(sparse) == config.n_layers:
            return None
        return ("model.mlp_only_layers",
                f"model {config.name} mixes dense and MoE layers (mlp_only_layers={list(config.mlp_only_layers)}, "
                f"decoder_sparse_step={config.decoder_sparse_step}), which the planner does not model yet: "
                "set trainer.preflight=false to train it without the memory check")

    def parameter_inventory(self, config: Qwen3Config) -> ModelInventory:
        return planner.inventory(config)


FAMILY = Qwen3Family()
