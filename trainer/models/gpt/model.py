"""GPT-2 / GPT-3 style decoder (learned positions, pre-LayerNorm, GELU MLP, tied head)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.common import (
    CausalLM,
    StreamDropout,
    init_linear_,
    require_divisible,
    require_positive,
    rng_stream,
)
from trainer.models.context_parallel import ContextParallel
from trainer.models.documents import document_mask

ATTN_IMPLS: tuple[str, ...] = ("sdpa", "materialized")


@dataclass
class GPTConfig:
    """Architecture of a GPT model; the defaults are GPT-2 small (124M)."""

    # Hydra target; ``trainer.models.build_model`` resolves the model class from it.
    _target_: str = "trainer.models.GPT"
    # Human-readable model name (used in logs and checkpoint metadata).
    name: str = "gpt"
    # Vocabulary size of the tokenizer (rows of the embedding and the output head).
    vocab_size: int = 50257
    # Number of learned positions, i.e. the longest sequence the model accepts.
    max_seq_len: int = 1024
    # Model (residual stream) width.
    dim: int = 768
    # Number of transformer blocks.
    n_layers: int = 12
    # Number of attention heads; must divide ``dim``.
    n_heads: int = 12
    # MLP hidden width; None = 4 * dim.
    ffn_hidden_dim: Optional[int] = None
    # Dropout on the embeddings, the residual branches and the attention probabilities.
    dropout: float = 0.0
    # Biases in the Linear layers and LayerNorms.
    bias: bool = True
    # Epsilon of the LayerNorms.
    norm_eps: float = 1e-5
    # Share the token embedding matrix with the output head.
    tie_embeddings: bool = True
    # "sdpa" (fused kernel) or "materialized" (explicit softmax(QK^T/sqrt(d)) with a causal
    # mask and attention dropout, whose saved activations match Korthikanti et al. 2022).
    attn_impl: str = "sdpa"
    # Std of the normal init; residual output projections use init_std / sqrt(2 * n_layers).
    init_std: float = 0.02

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` if the configuration is inconsistent."""
        for field in ("vocab_size", "max_seq_len", "dim", "n_layers", "n_heads"):
            require_positive(getattr(self, field), field)
        require_divisible(self.dim, self.n_heads, "dim must be divisible by n_heads")
        if self.ffn_hidden_dim is not None:
            require_positive(self.ffn_hidden_dim, "ffn_hidden_dim")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """Resolved MLP hidden width."""
        return 4 * self.dim if self.ffn_hidden_dim is None else self.ffn_hidden_dim


def materialized_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, doc_ids: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``dropout(softmax(q k^T / sqrt(d) + causal mask)) @ v`` on ``[B, H, S, D]`` inputs (with ``doc_ids``,
    the mask also keeps each token inside its document).

    Autograd saves exactly what Korthikanti et al. count: q and k for the score matmul,
    the softmax output, the dropout mask and output, and v.
    """
    seq_len, head_dim = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
    # Adding a constant -inf bias saves nothing for backward (masked_fill would save a mask).
    if doc_ids is None:
        hidden = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
    else:
        hidden = ~document_mask(doc_ids, doc_ids)
    bias = torch.zeros(hidden.shape, dtype=scores.dtype, device=q.device)
    scores = scores + bias.masked_fill(hidden, float("-inf"))
    probs = scores.softmax(dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


class CoreAttention(nn.Module):
    """Causal ``dropout(softmax(q k^T / sqrt(d))) v`` on ``[B, H, S, D]``: attention without weights.

    A module of its own (no parameters, so no state-dict entries) so that activation
    checkpointing can recompute just this part (Korthikanti et al. 2022's selective
    recomputation, ``activation_checkpointing=attention``). Its dropout draws from
    ``rng_stream(self.rng_stream)``: tensor parallelism gives each rank's heads their own stream.
    """

    def __init__(self, attn_impl: str, dropout: float) -> None:
        super().__init__()
        self.attn_impl = attn_impl
        self.dropout = dropout
        self.rng_stream = 0

    # Set under context parallelism: q, k, v then hold this rank's tokens only (see context_parallel.py).
    context_parallel: Optional[ContextParallel] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        dropout_p = self.dropout if self.training else 0.0
        with rng_stream(self.rng_stream if dropout_p else 0, q.device):
            if self.context_parallel is not None:
                return self.context_parallel.attention(q, k, v, self.local_attention, dropout_p=dropout_p,
                                                       doc_ids=doc_ids)
            return self.local_attention(q, k, v, doc_ids)

    def local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention over whole sequences (dropout drawn from the caller's random stream); with
        `doc_ids` ([B, S]) only within each document."""
        dropout_p = self.dropout if self.training else 0.0
        if self.attn_impl == "materialized":
            return materialized_causal_attention(q, k, v, dropout_p, doc_ids)
        if doc_ids is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids, doc_ids), dropout_p=dropout_p)


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused qkv projection.

    The fused projection's output features are laid out head by head, ``[n_heads, 3, head_dim]``
    (Megatron-LM's layout), so that a contiguous split of its rows over tensor-parallel ranks gives each
    rank whole heads with their own q, k and v; the head count is read from the output, which under
    tensor parallelism is the local n_heads / tp.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=config.bias)
        self.core_attention = CoreAttention(config.attn_impl, config.dropout)
        self.wo = nn.Linear(config.dim, config.dim, bias=config.bias)

    def forward(self, x: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        qkv = self.wqkv(x).view(batch, seq_len, -1, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)
        out = self.core_attention(q, k, v, doc_ids)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def init_weights(self, std: float, residual_std: float) -> None:
        init_linear_(self.wqkv, std)
        init_linear_(self.wo, residual_std)


class FeedForward(nn.Module):
    """``w2(gelu(w1 x))`` with the tanh GELU of GPT-2."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=config.bias)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))

    def init_weights(self, std: float, residual_std: float) -> None:
        init_linear_(self.w1, std)
        init_linear_(self.w2, residual_std)


class TransformerBlock(nn.Module):
    """Pre-LN block with dropout on both residual branches; stateless forward."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias)
        self.feed_forward = FeedForward(config)
        self.dropout = StreamDropout(config.dropout)

    def forward(self, x: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.dropout(self.attention(self.attention_norm(x), doc_ids))
        return h + self.dropout(self.feed_forward(self.ffn_norm(h)))

    def init_weights(self, std: float, residual_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, residual_std)
        self.feed_forward.init_weights(std, residual_std)


class GPT(CausalLM):
    """GPT decoder returning logits ``[B, S, vocab_size]``.

    Pipeline stages: later stages set both ``tok_embeddings`` and ``pos_embeddings`` to
    None and receive hidden states ``[B, S, dim]``; earlier stages set ``norm``/``output``
    to None and return hidden states; entries of ``layers`` may be deleted.
    """

    first_stage_modules: tuple[str, ...] = ("tok_embeddings", "pos_embeddings")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings: Optional[nn.Embedding] = nn.Embedding(config.max_seq_len, config.dim)
        self.emb_dropout = StreamDropout(config.dropout)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config) for i in range(config.n_layers)}
        )
        self.norm: Optional[nn.LayerNorm] = nn.LayerNorm(
            config.dim, eps=config.norm_eps, bias=config.bias
        )
        self.output: Optional[nn.Linear] = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _attention_dim(self) -> int:
        return self.config.dim

    def _embed(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.tok_embeddings is None:
            if self.pos_embeddings is not None:
                raise ValueError(
                    "a stage without tok_embeddings must also drop pos_embeddings "
                    "(positions are added once, on the first stage)"
                )
            return tokens
        local_len = tokens.shape[1]
        if self.sequence_length(local_len) > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {self.sequence_length(local_len)} exceeds max_seq_len {self.config.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            # [1, S]: dim 1 is the sequence, as in h (tensor parallelism shards both there); under context
            # parallelism this rank's tokens at their global positions
            if doc_ids is None:
                positions = self.positions(local_len, tokens.device).unsqueeze(0)
            else:  # [B, S]: each token's position in its document
                positions = self.document_positions(doc_ids)
            h = h + self.pos_embeddings(positions)
        return self.emb_dropout(h)

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids ``[B, S]`` (or hidden states ``[B, S, dim]`` on a later pipeline stage). ``doc_ids``
        (``[B, S]`` of the whole sequence, `trainer.models.documents`): attention within documents only,
        positions restarting at each; a pipeline stage reads them from ``pipeline_doc_ids``."""
        doc_ids = self.pipeline_doc_ids if doc_ids is None else doc_ids
        h = self._embed(tokens, doc_ids)
        for layer in self.layers.values():
            h = layer(h, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize every parameter from torch's global RNG.

        GPT has no derived buffers, so ``buffer_device`` is accepted for interface
        parity with ``Llama`` and ignored.
        """
        del buffer_device
        cfg = self.config
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        tied = cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None
        if tied:
            # to_empty may have given the two modules separate storage.
            self.output.weight = self.tok_embeddings.weight
        for table in (self.tok_embeddings, self.pos_embeddings):
            if table is not None:
                nn.init.normal_(table.weight, mean=0.0, std=cfg.init_std)
        for layer in self.layers.values():
            layer.init_weights(cfg.init_std, residual_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not tied:
            init_linear_(self.output, cfg.init_std)
