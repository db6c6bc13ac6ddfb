"""What a model family tells the planner: every parameter's shape and tensor-parallel split, and the
sizes the activation, communication and time models read (`ModelFamily.parameter_inventory`).

A family builds its `ModelInventory` from its config in its own `planner.py` (trainer/models/<family>/),
without building the model; the planner (trainer/planner) derives every byte and FLOP count from it and
names no model attribute itself. The counting methods here are the family-independent part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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

    # The block layout the activation and time models apply (not the family's name): "llama" (RMSNorm, SDPA,
    # SwiGLU: Llama and Qwen3), "gpt" (LayerNorm, GELU MLP, optional materialized attention and dropout) or
    # "deepseek_v3" (multi-head latent attention, dense then MoE blocks, multi-token prediction).
    family: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    # GPT only: attention implementation and dropout (Korthikanti's accounting needs both).
    attn_impl: str
    dropout: float
    embedding: tuple[ParamSpec, ...]
    layer: tuple[ParamSpec, ...]  # one transformer block (the most frequent kind when they differ)
    head: tuple[ParamSpec, ...]  # final norm, output head (no head weight when tied)
    # The output head's weight when it is the embedding's (None: untied): counted once, in `embedding`, but
    # the head's matmul reads it, and a last pipeline stage without the embedding holds a copy of it.
    tied_head: Optional[ParamSpec] = None
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
    def tied(self) -> bool:
        """Whether the output head is the embedding's weight (`tied_head`)."""
        return self.tied_head is not None

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

    def layer_flops_per_token(self, seq_len: int) -> list[int]:
        """Training FLOPs per token of each transformer block in order (`flops_per_token`'s convention; each
        block of `layer_groups` at its own width): what the pipeline's stages split between them."""
        attention = 6 * seq_len * self.n_heads * (self.head_dim + self.value_dim)
        return [6 * self._matmul(specs) + attention for n, specs in self.blocks() for _ in range(n)]

    def block_forward_flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs of one transformer block per token (what a full recompute runs again)."""
        return 2 * self.layer_matmul_params() + self.attention_core_forward_flops_per_token(seq_len)

    def attention_core_forward_flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs of one block's attention core (QK^T and attention x V) per token."""
        return 2 * seq_len * self.n_heads * (self.head_dim + self.value_dim)
