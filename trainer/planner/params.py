"""Analytic parameter inventory of the model families: every weight's shape and how it is split.

The planner never builds a model to count: it lists each parameter of the Llama, GPT and DeepSeek-V3 blocks
with its shape and its tensor-parallel split (the layout of `plugins/strategies/tensor_parallel.py`), so that the
bytes a rank holds follow from the parallel sizes alone, for any model size. Tests check the totals
against the real modules (`CausalLM.num_params`) and against the published Llama parameter counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# Where a parameter lives in the model, which decides the pipeline stage that holds it.
EMBEDDING = "embedding"  # first stage
LAYER = "layer"  # the stage that holds its block
HEAD = "head"  # last stage (final norm and output head)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its global shape and the dimension tensor parallelism splits (None: replicated)."""

    name: str
    shape: tuple[int, ...]
    # 0: column-parallel (output rows split) or vocab-parallel rows; 1: row-parallel (input columns split).
    tp_dim: Optional[int]
    # Takes part in a matmul (counted by the model FLOPs: every nn.Linear weight).
    matmul: bool = False
    # A stacked routed-expert weight [n_experts, ...]: split over the ep ranks on dim 0, and a token uses
    # `active` of it (top_k / n_experts; 1.0 for every other weight).
    expert: bool = False
    active: float = 1.0

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one tensor-parallel rank's shard (tp must divide the split dimension)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] //= tp
        return tuple(shape)


@dataclass(frozen=True)
class ModelInventory:
    """Every parameter of a model, grouped by where it lives, plus the sizes the other estimates need."""

    family: str  # "llama" (Qwen3 too: the same block layout), "gpt" or "deepseek_v3"
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    tied: bool
    # GPT only: attention implementation and dropout (Korthikanti's accounting needs both).
    attn_impl: str
    dropout: float
    embedding: tuple[ParamSpec, ...]
    layer: tuple[ParamSpec, ...]  # one transformer block (the most frequent kind when they differ)
    head: tuple[ParamSpec, ...]  # final norm, output head (empty head weight when tied)
    # Mixture of Experts (0: dense): routed experts per layer and experts per token.
    n_experts: int = 0
    top_k: int = 1
    # RMSNorm of each query and key head before RoPE (Qwen3): what it saves for the backward.
    qk_norm: bool = False
    # Blocks of different kinds (DeepSeek-V3: first_k_dense_replace dense blocks, then MoE ones) as
    # (count, specs) in layer order, counts summing to n_layers; empty: all n_layers blocks are `layer`.
    layer_groups: tuple[tuple[int, tuple[ParamSpec, ...]], ...] = ()
    # Per kind of block (`blocks()`): its feed-forward width for the activation model and whether it routes
    # to experts (DeepSeek-V3: the dense SwiGLU's width; top_k x expert + shared for the MoE blocks); empty:
    # `ffn_dim` and `n_experts` hold for every block.
    layer_group_ffn: tuple[tuple[int, bool], ...] = ()
    # Multi-token-prediction modules (DeepSeek-V3), held with the head by the last stage; they reuse the
    # embedding and the output head (one more head matmul per depth). `mtp_blocks` transformer blocks.
    mtp: tuple[ParamSpec, ...] = ()
    mtp_blocks: int = 0
    # Whether num_params / num_active_params count `mtp` (memory always does: the weights are held).
    count_mtp: bool = False
    # Value width per head when it differs from the query/key width `head_dim` (MLA); 0: head_dim.
    v_head_dim: int = 0
    # Multi-head latent attention (DeepSeek-V3; 0: none): the query and key/value latent widths (no query
    # latent: q_lora_rank 0) and the rotated key part shared by the heads, what the activation model needs.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0

    @property
    def attention_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """Per-head width of the values (= head_dim except for MLA)."""
        return self.v_head_dim or self.head_dim

    def blocks(self) -> tuple[tuple[int, tuple[ParamSpec, ...]], ...]:
        """(count, specs) of every kind of block, in layer order."""
        return self.layer_groups or ((self.n_layers, self.layer),)

    @staticmethod
    def _inactive(specs: tuple[ParamSpec, ...]) -> int:
        return sum(p.numel - round(p.numel * p.active) for p in specs if p.expert)

    @staticmethod
    def _matmul(specs: tuple[ParamSpec, ...]) -> int:
        return sum(round(p.numel * p.active) for p in specs if p.matmul)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_numel(self) -> int:
        return sum(p.numel for p in self.layer)

    def num_params(self) -> int:
        """All parameters, tied weights once (what `CausalLM.num_params()` counts; the MTP modules with
        `count_mtp`)."""
        return (sum(p.numel for p in self.embedding) + sum(n * sum(p.numel for p in specs) for n, specs in self.blocks())
                + sum(p.numel for p in self.head) + (sum(p.numel for p in self.mtp) if self.count_mtp else 0))

    def num_active_params(self) -> int:
        """Parameters one token uses (`CausalLM.num_active_params`): top_k of n_experts routed experts."""
        inactive = sum(n * self._inactive(specs) for n, specs in self.blocks())
        return self.num_params() - inactive - (self._inactive(self.mtp) if self.count_mtp else 0)

    def layer_matmul_params(self) -> int:
        """Matmul weights one token multiplies with in one block (its top_k experts for an MoE)."""
        return sum(round(p.numel * p.active) for p in self.layer if p.matmul)

    def num_matmul_params(self) -> int:
        """Weights of every Linear (the output head counts even when tied: it is still a matmul), and the
        active routed experts."""
        head = sum(p.numel for p in self.head if p.matmul)
        if self.tied:
            head += self.vocab_size * self.dim
        # each MTP depth multiplies with its own weights and the shared output head once more
        mtp = self._matmul(self.mtp) + self.mtp_blocks * self.vocab_size * self.dim
        return sum(n * self._matmul(specs) for n, specs in self.blocks()) + head + mtp

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, Narayanan et al. 2021's convention (as `CausalLM.flops_per_token`):
        6 x matmul weights + 6 x blocks x seq_len x heads x (query/key + value width) (QK^T and attention
        x V, forward and backward, not halved for causality; 12 x layers x seq_len x attention width when
        the widths are equal)."""
        blocks = self.n_layers + self.mtp_blocks
        return 6 * self.num_matmul_params() + 6 * blocks * seq_len * self.n_heads * (self.head_dim + self.value_dim)

    def block_forward_flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs of one transformer block per token (what a full recompute runs again)."""
        return 2 * self.layer_matmul_params() + self.attention_core_forward_flops_per_token(seq_len)

    def attention_core_forward_flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs of one block's attention core (QK^T and attention x V) per token."""
        return 2 * seq_len * self.n_heads * (self.head_dim + self.value_dim)


def _llama_inventory(cfg: Any) -> ModelInventory:
    h, f, v = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = (
        ParamSpec("attention_norm.weight", (h,), None),
        ParamSpec("attention.wq.weight", (q, h), 0, True),
        ParamSpec("attention.wk.weight", (kv, h), 0, True),
        ParamSpec("attention.wv.weight", (kv, h), 0, True),
        ParamSpec("attention.wo.weight", (h, q), 1, True),
        ParamSpec("ffn_norm.weight", (h,), None),
    )
    n_experts, top_k = int(getattr(cfg, "n_experts", 0) or 0), int(getattr(cfg, "top_k", 1) or 1)
    if n_experts:
        # Mixture of Experts (trainer/models/moe.py): replicated under tensor parallelism (tp_dim None).
        fe, shared = cfg.expert_hidden_dim, cfg.n_shared_experts * cfg.expert_hidden_dim
        active = top_k / n_experts
        layer += (ParamSpec("feed_forward.router.weight", (n_experts, h), None, True),
                  ParamSpec("feed_forward.experts.w1", (n_experts, fe, h), None, True, True, active),
                  ParamSpec("feed_forward.experts.w2", (n_experts, h, fe), None, True, True, active),
                  ParamSpec("feed_forward.experts.w3", (n_experts, fe, h), None, True, True, active))
        if shared:
            layer += (ParamSpec("feed_forward.shared_experts.w1.weight", (shared, h), None, True),
                      ParamSpec("feed_forward.shared_experts.w2.weight", (h, shared), None, True),
                      ParamSpec("feed_forward.shared_experts.w3.weight", (shared, h), None, True))
        f = top_k * fe + shared  # SwiGLU hidden activations a token produces (the activation model's width)
    else:
        layer += (ParamSpec("feed_forward.w1.weight", (f, h), 0, True),
                  ParamSpec("feed_forward.w2.weight", (h, f), 1, True),
                  ParamSpec("feed_forward.w3.weight", (f, h), 0, True))
    head = [ParamSpec("norm.weight", (h,), None)]
    if not cfg.tie_embeddings:
        head.append(ParamSpec("output.weight", (v, h), 0, True))
    return ModelInventory(
        family="llama", n_layers=cfg.n_layers, dim=h, n_heads=cfg.n_heads, n_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, ffn_dim=f, vocab_size=v, tied=cfg.tie_embeddings, attn_impl="sdpa", dropout=0.0,
        embedding=(ParamSpec("tok_embeddings.weight", (v, h), 0),), layer=layer, head=tuple(head),
        n_experts=n_experts, top_k=top_k,
    )


def _qwen3_inventory(cfg: Any) -> ModelInventory:
    """Qwen3 (trainer/models/qwen3): the Llama block with per-head q/k RMSNorm weights, head_dim of its
    own, optional q/k/v/o biases, Qwen3-MoE experts. Tensor splits as the Llama's would be (Qwen3 refuses
    tp for now, `Qwen3Config.unsupported_parallelism`, so they only matter to the search's what-ifs)."""
    sparse = cfg.sparse_layers
    if sparse and len(sparse) != cfg.n_layers:
        # The inventory describes one block for all layers; a mix is the model-family contract's job.
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
        fe, active = cfg.moe_hidden_dim, cfg.top_k / cfg.n_experts
        layer += (ParamSpec("feed_forward.router.weight", (n_experts, h), None, True),
                  ParamSpec("feed_forward.experts.w1", (n_experts, fe, h), None, True, True, active),
                  ParamSpec("feed_forward.experts.w2", (n_experts, h, fe), None, True, True, active),
                  ParamSpec("feed_forward.experts.w3", (n_experts, fe, h), None, True, True, active))
        f = top_k * fe  # SwiGLU hidden activations a token produces (the activation model's width)
    else:
        layer += (ParamSpec("feed_forward.w1.weight", (f, h), 0, True),
                  ParamSpec("feed_forward.w2.weight", (h, f), 1, True),
                  ParamSpec("feed_forward.w3.weight", (f, h), 0, True))
    head = [ParamSpec("norm.weight", (h,), None)]
    if not cfg.tie_embeddings:
        head.append(ParamSpec("output.weight", (v, h), 0, True))
    # family "llama": the activation and timing models of a Llama block (SDPA, SwiGLU) apply, plus qk_norm
    return ModelInventory(
        family="llama", n_layers=cfg.n_layers, dim=h, n_heads=cfg.n_heads, n_kv_heads=cfg.num_kv_heads,
        head_dim=d, ffn_dim=f, vocab_size=v, tied=cfg.tie_embeddings, attn_impl="sdpa", dropout=0.0,
        embedding=(ParamSpec("tok_embeddings.weight", (v, h), 0),), layer=layer, head=tuple(head),
        n_experts=n_experts, top_k=top_k, qk_norm=True,
    )


def _gpt_inventory(cfg: Any) -> ModelInventory:
    h, f, v = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    # Tensor-parallel splits as Megatron-LM and this trainer's tp strategy lay GPT out: the head-major
    # fused qkv and w1 split by rows with their biases, wo and w2 by columns with replicated biases, the
    # position table replicated.
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
    if not cfg.tie_embeddings:
        head.append(ParamSpec("output.weight", (v, h), 0, True))
    embedding = (ParamSpec("tok_embeddings.weight", (v, h), 0),
                 ParamSpec("pos_embeddings.weight", (cfg.max_seq_len, h), None))
    return ModelInventory(
        family="gpt", n_layers=cfg.n_layers, dim=h, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
        head_dim=cfg.head_dim, ffn_dim=f, vocab_size=v, tied=cfg.tie_embeddings, attn_impl=cfg.attn_impl,
        dropout=cfg.dropout, embedding=embedding, layer=tuple(layer), head=tuple(head),
    )


def _deepseek_v3_block(cfg: Any, moe: bool) -> tuple[ParamSpec, ...]:
    """One DeepSeek-V3 block (trainer/models/deepseek_v3): MLA, then a dense SwiGLU or DeepSeekMoE. No
    tensor-parallel split (tp_dim None): DeepSeek-V3 refuses tp until it has a plan."""
    h, heads, qk, v = cfg.dim, cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    specs = [ParamSpec("attention_norm.weight", (h,), None)]
    if cfg.q_lora_rank is None:
        specs.append(ParamSpec("attention.wq.weight", (heads * qk, h), None, True))
    else:
        specs += [ParamSpec("attention.wq_a.weight", (cfg.q_lora_rank, h), None, True),
                  ParamSpec("attention.q_norm.weight", (cfg.q_lora_rank,), None),
                  ParamSpec("attention.wq_b.weight", (heads * qk, cfg.q_lora_rank), None, True)]
    specs += [ParamSpec("attention.wkv_a.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), None, True),
              ParamSpec("attention.kv_norm.weight", (cfg.kv_lora_rank,), None),
              ParamSpec("attention.wkv_b.weight", (heads * (cfg.qk_nope_head_dim + v), cfg.kv_lora_rank), None, True),
              ParamSpec("attention.wo.weight", (h, heads * v), None, True),
              ParamSpec("ffn_norm.weight", (h,), None)]
    if not moe:
        f = cfg.ffn_hidden_dim
        return (*specs, ParamSpec("feed_forward.w1.weight", (f, h), None, True),
                ParamSpec("feed_forward.w2.weight", (h, f), None, True),
                ParamSpec("feed_forward.w3.weight", (f, h), None, True))
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


def _deepseek_v3_inventory(cfg: Any) -> ModelInventory:
    h, v = cfg.dim, cfg.vocab_size
    dense, moe = _deepseek_v3_block(cfg, moe=False), _deepseek_v3_block(cfg, moe=True)
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
        head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, ffn_dim=ffn, vocab_size=v, tied=False,
        attn_impl="sdpa", dropout=0.0, embedding=(ParamSpec("tok_embeddings.weight", (v, h), None),),
        layer=max(groups, key=lambda group: group[0])[1], head=(ParamSpec("norm.weight", (h,), None),
                                                               ParamSpec("output.weight", (v, h), None, True)),
        n_experts=cfg.n_experts, top_k=cfg.top_k, layer_groups=groups if len(groups) > 1 else (),
        layer_group_ffn=group_ffn,
        mtp=mtp, mtp_blocks=cfg.mtp_depth, count_mtp=cfg.count_mtp_params, v_head_dim=cfg.v_head_dim,
        q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank, rope_head_dim=cfg.qk_rope_head_dim,
    )


def inventory(model_cfg: Any) -> ModelInventory:
    """The inventory of a model config dataclass (`LlamaConfig`, `GPTConfig`, `Qwen3Config` or
    `DeepSeekV3Config`).

    (This ladder is what the model-family contract replaces: a family will hand the planner its own
    inventory.)"""
    from trainer.models import DeepSeekV3Config, GPTConfig, LlamaConfig, Qwen3Config

    if isinstance(model_cfg, LlamaConfig):
        return _llama_inventory(model_cfg)
    if isinstance(model_cfg, GPTConfig):
        return _gpt_inventory(model_cfg)
    if isinstance(model_cfg, Qwen3Config):
        return _qwen3_inventory(model_cfg)
    if isinstance(model_cfg, DeepSeekV3Config):
        return _deepseek_v3_inventory(model_cfg)
    raise TypeError(f"the planner knows the llama, gpt, qwen3 and deepseek_v3 families, not {type(model_cfg).__name__}")
