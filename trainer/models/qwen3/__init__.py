"""The Qwen3 family (dense and Mixture of Experts): the model and its config (`model.py`), the mapping to
and from transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM weights (`hf_adapter.py`).

Everything the family needs lives in this folder, so that the model-family contract (how strategies ask a
model for its tensor-parallel plan, pipeline split, checkpointing units, expert layers, planner inventory,
Hugging Face adapter) can take it over as one unit.
"""

from trainer.models.qwen3.hf_adapter import Qwen3HFAdapter
from trainer.models.qwen3.model import PooledBalance, Qwen3, Qwen3Attention, Qwen3Block, Qwen3Config, Qwen3MoE

__all__ = ["PooledBalance", "Qwen3", "Qwen3Attention", "Qwen3Block", "Qwen3Config", "Qwen3HFAdapter", "Qwen3MoE"]
