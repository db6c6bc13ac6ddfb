"""The Llama family's parameter inventory for the planner (`LlamaFamily.parameter_inventory`): every weight
of trainer/models/llama (the Mixtral-style MoE of trainer/models/moe.py included) with its shape and its
tensor-parallel split, as `LlamaFamily.block_split` lays it out. The planner counts from it without building
the model. Qwen3's planner reuses the feed-forward, expert and head parts below.
"""

from __future__ import annotations

from typing import Any, Optional

from trainer.interfaces.inventory import ModelInventory, ParamSpec


def swiglu(f: int, h: int) -> tuple[ParamSpec, ...]:
    """A dense SwiGLU feed-forward of hidden width f: w1 and w3 column-parallel, w2 row-parallel."""
    return (ParamSpec("feed_forward.w1.weight", (f, h), 0, True),
            ParamSpec("feed_forward.w2.weight", (h, f), 1, True),
            ParamSpec("feed_forward.w3.weight", (f, h), 0, True))


def routed_experts(n_experts: int, top_k: int, fe: int, h: int) -> tuple[ParamSpec, ...]:
    """The router and the stacked routed experts of trainer/models/moe.py (each a SwiGLU of width fe, a token
    using top_k of them): replicated under tensor parallelism (tp_dim None)."""
    active = top_k / n_experts
    return (ParamSpec("feed_forward.router.weight", (n_experts, h), None, True),
            ParamSpec("feed_forward.experts.w1", (n_experts, fe, h), None, True, True, active),
            ParamSpec("feed_forward.experts.w2", (n_experts, h, fe), None, True, True, active),
            ParamSpec("feed_forward.experts.w3", (n_experts, fe, h), None, True, True, active))


def output_head(v: int, h: int) -> ParamSpec:
    """The output head's weight: vocab-parallel rows."""
    return ParamSpec("output.weight", (v, h), 0, True)


def embedding_and_head(v: int, h: int, tied: bool
                       ) -> tuple[tuple[ParamSpec, ...], tuple[ParamSpec, ...], Optional[ParamSpec]]:
    """(embedding, head, tied head) of a Llama-layout model: the token table (vocab-parallel rows), the final
    RMSNorm and the output head, which is the token table's weight when `tied`."""
    embedding = (ParamSpec("tok_embeddings.weight", (v, h), 0),)
    norm = ParamSpec("norm.weight", (h,), None)
    if tied:
        return embedding, (norm,), output_head(v, h)
    return embedding, (norm, output_head(v, h)), None


def inventory(cfg: Any) -> ModelInventory:
    """The inventory of a `LlamaConfig`."""
    h, f, v = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer: tuple[ParamSpec, ...] = (
        ParamSpec("attention_norm.weight", (h,), None),
        ParamSpec("attention.wq.weight", (q, h), 0, True),
        ParamSpec("attention.wk.weight", (kv, h), 0, True),
        ParamSpec("attention.wv.weight", (kv, h), 0, True),
        ParamSpec("attention.wo.weight", (h, q), 1, True),
        ParamSpec("ffn_norm.weight", (h,), None),
    )
    n_experts, top_k = int(getattr(cfg, "n_experts", 0) or 0), int(getattr(cfg, "top_k", 1) or 1)
    if n_experts:
        fe, shared = cfg.expert_hidden_dim, cfg.n_shared_experts * cfg.expert_hidden_dim
        layer += routed_experts(n_experts, top_k, fe, h)
        if shared:
            layer += (ParamSpec("feed_forward.shared_experts.w1.weight", (shared, h), None, True),
                      ParamSpec("feed_forward.shared_experts.w2.weight", (h, shared), None, True),
                      ParamSpec("feed_forward.shared_experts.w3.weight", (shared, h), None, True))
        f = top_k * fe + shared  # SwiGLU hidden activations a token produces (the activation model's width)
    else:
        layer += swiglu(f, h)
    embedding, head, tied_head = embedding_and_head(v, h, cfg.tie_embeddings)
    return ModelInventory(
        family="llama", n_layers=cfg.n_layers, dim=h, n_heads=cfg.n_heads, n_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, ffn_dim=f, vocab_size=v, attn_impl="sdpa", dropout=0.0,
        embedding=embedding, layer=layer, head=head, tied_head=tied_head, n_experts=n_experts, top_k=top_k,
    )
