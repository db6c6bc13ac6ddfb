"""The Llama family (dense, and the Mixtral-style MoE when `n_experts > 0`): the model and its config
(`model.py`), transformers' names (`hf_adapter.py`), the planner's parameter inventory (`planner.py`) and
the family's declaration (`family.py`)."""

from trainer.models.llama.model import (
    Attention,
    CoreAttention,
    FeedForward,
    Llama,
    LlamaConfig,
    TransformerBlock,
    apply_rope,
    compute_rope_cache,
    make_feed_forward,
)

__all__ = ["Attention", "CoreAttention", "FeedForward", "Llama", "LlamaConfig", "TransformerBlock", "apply_rope",
           "compute_rope_cache", "make_feed_forward"]
