"""The DeepSeek-V3 family's parameter inventory for the planner (`DeepSeekV3Family.parameter_inventory`):
every weight of trainer/models/deepseek_v3 (MLA, the dense and the DeepSeekMoE blocks, the multi-token
prediction modules) with its shape, its tensor-parallel split as `DeepSeekV3Family.block_split` makes it
(MLA's per-head projections split by heads, the low-rank latents, the MoE layers and the MTP projection
whole on every rank; the embedding and head vocab-parallel), and the widths the activation model counts MLA
with.
"""

from __future__ import annotations

from typing import Any

from trainer.interfaces.inventory import ModelInventory, ParamSpec


def block(cfg: Any, moe: bool) -> tuple[ParamSpec, ...]:
    """One DeepSeek-V3 block: MLA, then a dense SwiGLU or DeepSeekMoE."""
    h, heads, qk, v = cfg.dim, cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    specs = [ParamSpec("attention_norm.weight", (h,), None)]
    if cfg.q_lora_rank is None:
        specs.append(ParamSpec("attention.wq.weight", (heads * qk, h), 0, True))
    else:
        specs += [ParamSpec("attention.wq_a.weight", (cfg.q_lora_rank, h), None, True),
                  ParamSpec("attention.q_norm.weight", (cfg.q_lora_rank,), None),
                  ParamSpec("attention.wq_b.weight", (heads * qk, cfg.q_lora_rank), 0, True)]
    specs += [ParamSpec("attention.wkv_a.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), None, True),
              ParamSpec("attention.kv_norm.weight", (cfg.kv_lora_rank,), None),
              ParamSpec("attention.wkv_b.weight", (heads * (cfg.qk_nope_head_dim + v), cfg.kv_lora_rank), 0, True),
              ParamSpec("attention.wo.weight", (h, heads * v), 1, True),
              ParamSpec("ffn_norm.weight", (h,), None)]
    if not moe:
        f = cfg.ffn_hidden_dim
        return (*specs, ParamSpec("feed_forward.w1.weight", (f, h), 0, True),
                ParamSpec("feed_forward.w2.weight", (h, f), 1, True),
                ParamSpec("feed_forward.w3.weight", (f, h), 0, True))
    e, fe, shared, active = cfg.n_experts, cfg.moe_hidden_dim, cfg.n_shared_experts * cfg.moe_hidden_dim, cfg.top_k / cfg.n_experts
    specs += [ParamSpec("feed_forward.router.weight", (e, h), None, True),
              ParamSpec("feed_forward.experts.w1", (e, fe, h), None, True, True, active),
              ParamSpec("feed_forward.experts.w2", (e, h, fe), None, True, True, active),
              ParamSpec("feed_forward.experts.w3", (e, fe, h), None, True, True, active)]
    if shared:
        specs += [ParamSpec("feed_forward.shared_experts.w1.weight", (shared, h), None, True),
                  ParamSpec("feed_forward.shared_experts.w2.weight", (h, shared), None, True),
                  ParamSpec("feed_forward.shared_experts.w3.weight", (shared, h), None, True)]
    return tuple(specs)


def inventory(cfg: Any) -> ModelInventory:
    """The inventory of a `DeepSeekV3Config`."""
    h, v = cfg.dim, cfg.vocab_size
    dense, moe = block(cfg, moe=False), block(cfg, moe=True)
    n_dense = cfg.first_k_dense_replace
    # The activation model's feed-forward widths: the dense SwiGLU's, and an MoE block's as a SwiGLU of width
    # top_k x expert + shared (trainer/planner/activations.py adds the routing and dispatch tensors).
    ffn = cfg.top_k * cfg.moe_hidden_dim + cfg.n_shared_experts * cfg.moe_hidden_dim
    kinds = ((n_dense, dense, (cfg.ffn_hidden_dim, False)), (cfg.n_layers - n_dense, moe, (ffn, True)))
    groups = tuple((n, specs) for n, specs, _ in kinds if n)
    group_ffn = tuple(widths for n, _, widths in kinds if n)
    mtp: tuple[ParamSpec, ...] = ()
    for k in range(cfg.mtp_depth):
        prefix = f"mtp.{cfg.n_layers + k}."
        mtp += (ParamSpec(prefix + "enorm.weight", (h,), None), ParamSpec(prefix + "hnorm.weight", (h,), None),
                ParamSpec(prefix + "eh_proj.weight", (h, 2 * h), None, True),
                *(ParamSpec(prefix + "block." + p.name, p.shape, p.tp_dim, p.matmul, p.expert, p.active) for p in moe),
                ParamSpec(prefix + "norm.weight", (h,), None))
    # MLA's widths (q_lora_rank, kv_lora_rank, rope_head_dim below): the activation model counts it term by term.
    return ModelInventory(
        family="deepseek_v3", n_layers=cfg.n_layers, dim=h, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
        head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, ffn_dim=ffn, vocab_size=v,
        attn_impl="sdpa", dropout=0.0, embedding=(ParamSpec("tok_embeddings.weight", (v, h), 0),),
        layer=max(groups, key=lambda group: group[0])[1], head=(ParamSpec("norm.weight", (h,), None),
                                                               ParamSpec("output.weight", (v, h), 0, True)),
        n_experts=cfg.n_experts, top_k=cfg.top_k, layer_groups=groups if len(groups) > 1 else (),
        layer_group_ffn=group_ffn,
        mtp=mtp, mtp_blocks=cfg.mtp_depth, count_mtp=cfg.count_mtp_params, v_head_dim=cfg.v_head_dim,
        q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank, rope_head_dim=cfg.qk_rope_head_dim,
    )
