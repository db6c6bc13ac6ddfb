"""The GPT family's parameter inventory for the planner (`GPTFamily.parameter_inventory`): every weight of
trainer/models/gpt with its shape and its tensor-parallel split, as Megatron-LM and `GPTFamily.block_split`
lay GPT out: the head-major fused qkv and w1 split by rows with their biases, wo and w2 by columns with
replicated biases, the position table replicated.
"""

from __future__ import annotations

from typing import Any

from trainer.interfaces.inventory import ModelInventory, ParamSpec


def inventory(cfg: Any) -> ModelInventory:
    """The inventory of a `GPTConfig`."""
    h, f, v = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    layer = [ParamSpec("attention_norm.weight", (h,), None)]
    if cfg.bias:
        layer.append(ParamSpec("attention_norm.bias", (h,), None))
    layer.append(ParamSpec("attention.wqkv.weight", (3 * h, h), 0, True))
    if cfg.bias:
        layer.append(ParamSpec("attention.wqkv.bias", (3 * h,), 0))
    layer.append(ParamSpec("attention.wo.weight", (h, h), 1, True))
    if cfg.bias:
        layer.append(ParamSpec("attention.wo.bias", (h,), None))
    layer.append(ParamSpec("ffn_norm.weight", (h,), None))
    if cfg.bias:
        layer.append(ParamSpec("ffn_norm.bias", (h,), None))
    layer.append(ParamSpec("feed_forward.w1.weight", (f, h), 0, True))
    if cfg.bias:
        layer.append(ParamSpec("feed_forward.w1.bias", (f,), 0))
    layer.append(ParamSpec("feed_forward.w2.weight", (h, f), 1, True))
    if cfg.bias:
        layer.append(ParamSpec("feed_forward.w2.bias", (h,), None))
    head = [ParamSpec("norm.weight", (h,), None)]
    if cfg.bias:
        head.append(ParamSpec("norm.bias", (h,), None))
    output = ParamSpec("output.weight", (v, h), 0, True)  # vocab-parallel rows
    if not cfg.tie_embeddings:
        head.append(output)
    embedding = (ParamSpec("tok_embeddings.weight", (v, h), 0),
                 ParamSpec("pos_embeddings.weight", (cfg.max_seq_len, h), None))
    return ModelInventory(
        family="gpt", n_layers=cfg.n_layers, dim=h, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
        head_dim=cfg.head_dim, ffn_dim=f, vocab_size=v, attn_impl=cfg.attn_impl, dropout=cfg.dropout,
        embedding=embedding, layer=tuple(layer), head=tuple(head),
        tied_head=output if cfg.tie_embeddings else None,
    )
