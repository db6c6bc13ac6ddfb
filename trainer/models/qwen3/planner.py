"""The Qwen3 family's parameter inventory for the planner (`Qwen3Family.parameter_inventory`): the Llama
block with per-head q/k RMSNorm weights, a head_dim of its own, optional q/k/v/o biases and Qwen3-MoE
experts. Tensor splits as `Qwen3Family.block_split` lays them out: the Llama's, the q/k norms replicated.
"""

from __future__ import annotations

from typing import Any

from trainer.interfaces.inventory import ModelInventory, ParamSpec
from trainer.models.llama.planner import embedding_and_head, routed_experts, swiglu


def inventory(cfg: Any) -> ModelInventory:
    """The inventory of a `Qwen3Config` (ValueError when it mixes dense and MoE layers)."""
    sparse = cfg.sparse_layers
    if sparse and len(sparse) != cfg.n_layers:
        # The inventory describes one block for all layers (`Qwen3Family.unsupported_planning` says so first).
        raise ValueError(f"model {cfg.name} mixes dense and MoE layers (mlp_only_layers={list(cfg.mlp_only_layers)}, "
                         f"decoder_sparse_step={cfg.decoder_sparse_step}): the planner models every layer alike; "
                         "set trainer.preflight=false to train it without the memory check")
    h, v, d = cfg.dim, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.n_heads * d, cfg.num_kv_heads * d
    bias = cfg.attention_bias
    layer: tuple[ParamSpec, ...] = (
        ParamSpec("attention_norm.weight", (h,), None),
        ParamSpec("attention.wq.weight", (q, h), 0, True), *([ParamSpec("attention.wq.bias", (q,), 0)] if bias else []),
        ParamSpec("attention.wk.weight", (kv, h), 0, True), *([ParamSpec("attention.wk.bias", (kv,), 0)] if bias else []),
        ParamSpec("attention.wv.weight", (kv, h), 0, True), *([ParamSpec("attention.wv.bias", (kv,), 0)] if bias else []),
        ParamSpec("attention.q_norm.weight", (d,), None),
        ParamSpec("attention.k_norm.weight", (d,), None),
        ParamSpec("attention.wo.weight", (h, q), 1, True), *([ParamSpec("attention.wo.bias", (h,), None)] if bias else []),
        ParamSpec("ffn_norm.weight", (h,), None),
    )
    n_experts, top_k = (cfg.n_experts, cfg.top_k) if sparse else (0, 1)
    f = cfg.ffn_hidden_dim
    if sparse:
        fe = cfg.moe_hidden_dim
        layer += routed_experts(n_experts, top_k, fe, h)
        f = top_k * fe  # SwiGLU hidden activations a token produces (the activation model's width)
    else:
        layer += swiglu(f, h)
    embedding, head, tied_head = embedding_and_head(v, h, cfg.tie_embeddings)
    # family "llama": the activation and timing models of a Llama block (SDPA, SwiGLU) apply, plus qk_norm
    return ModelInventory(
        family="llama", n_layers=cfg.n_layers, dim=h, n_heads=cfg.n_heads, n_kv_heads=cfg.num_kv_heads,
        head_dim=d, ffn_dim=f, vocab_size=v, attn_impl="sdpa", dropout=0.0,
        embedding=embedding, layer=layer, head=head, tied_head=tied_head, n_experts=n_experts, top_k=top_k,
        qk_norm=True,
    )
