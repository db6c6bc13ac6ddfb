"""Llama 2 / Llama 3 decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Module names follow torchtitan; RoPE uses the Hugging Face "rotate_half" layout, so
``wq``/``wk`` export to ``LlamaForCausalLM`` without the head-dim permutation that
Meta's interleaved checkpoints need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.common import (
    CausalLM,
    init_linear_,
    module_device,
    require_divisible,
    require_positive,
)
from trainer.models.context_parallel import ContextParallel
from trainer.models.documents import document_mask
from trainer.models.moe import MoE
from trainer.models.qk_clip import LogitMax


@dataclass
class LlamaConfig:
    """Architecture of a Llama model; the defaults are Llama 2 7B."""

    # Hydra target; ``trainer.models.build_model`` resolves the model class from it.
    _target_: str = "trainer.models.Llama"
    # Human-readable model name (used in logs and checkpoint metadata).
    name: str = "llama"
    # Vocabulary size of the tokenizer (rows of the embedding and the output head).
    vocab_size: int = 32000
    # Model (residual stream) width.
    dim: int = 4096
    # Number of transformer blocks.
    n_layers: int = 32
    # Number of query heads; must divide ``dim``.
    n_heads: int = 32
    # Number of key/value heads for grouped-query attention; None = n_heads (plain multi-head).
    n_kv_heads: Optional[int] = None
    # SwiGLU hidden width; None = Meta's rule from dim, ffn_dim_multiplier and multiple_of.
    ffn_hidden_dim: Optional[int] = None
    # Meta's rule rounds the SwiGLU hidden width up to a multiple of this.
    multiple_of: int = 256
    # Meta's rule scales int(8*dim/3) by this before rounding (Llama 2 70B, Llama 3).
    ffn_dim_multiplier: Optional[float] = None
    # Epsilon of the RMSNorms.
    norm_eps: float = 1e-5
    # RoPE base frequency (10000 for Llama 2, 500000 for Llama 3).
    rope_theta: float = 10000.0
    # Longest sequence the RoPE cache covers.
    max_seq_len: int = 4096
    # Share the token embedding matrix with the output head.
    tie_embeddings: bool = False
    # Std of the normal init; residual output projections use init_std / sqrt(2 * n_layers).
    init_std: float = 0.02
    # ---- Mixture of Experts (trainer/models/moe.py); n_experts = 0 keeps the dense SwiGLU feed-forward ----
    # Routed experts per layer (each a SwiGLU of width moe_hidden_dim).
    n_experts: int = 0
    # Experts each token is sent to (token-choice top-k).
    top_k: int = 2
    # Shared experts every token goes through (DeepSeek), as one SwiGLU of n_shared_experts x moe_hidden_dim.
    n_shared_experts: int = 0
    # Width of one expert's SwiGLU; None = hidden_dim.
    moe_hidden_dim: Optional[int] = None
    # Renormalise the top-k router probabilities to sum to 1 (Mixtral, DeepSeek-V3; ignored for top_k = 1).
    router_renormalize: bool = True
    # Coefficient of the Switch/Mixtral load-balancing loss E * sum_e f_e P_e (1.0 when balanced); 0 = off.
    router_aux_loss_coef: float = 0.01
    # Coefficient of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0 = off.
    router_z_loss_coef: float = 0.0
    # DeepSeek-V3 auxiliary-loss-free balancing: per-expert selection bias moved by this much per step
    # towards the mean load (their gamma, 1e-3); 0 = off.
    router_bias_update_rate: float = 0.0
    # Tokens per expert per micro-batch capped at ceil(capacity_factor * tokens * top_k / n_experts), the
    # rest dropped (counted); 0 = dropless.
    capacity_factor: float = 0.0
    # Multiply each expert's tokens with torch's grouped matmul where it applies (else one matmul per expert).
    moe_grouped_mm: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` if the shapes are inconsistent."""
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            require_positive(getattr(self, field), field)
        require_divisible(self.dim, self.n_heads, "dim must be divisible by n_heads")
        require_divisible(
            self.n_heads, self.num_kv_heads, "n_heads must be divisible by n_kv_heads"
        )
        if self.head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.ffn_hidden_dim is not None:
            require_positive(self.ffn_hidden_dim, "ffn_hidden_dim")
        self.validate_moe()

    def validate_moe(self) -> None:
        """Raise ``ValueError`` on inconsistent Mixture-of-Experts options."""
        if self.n_experts < 0:
            raise ValueError(f"model.n_experts must be >= 0 (0: dense), got {self.n_experts}")
        if self.n_experts == 0:
            if self.n_shared_experts:
                raise ValueError("model.n_shared_experts needs routed experts: set model.n_experts > 0")
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} must be between 1 and model.n_experts={self.n_experts}")
        if self.n_shared_experts < 0 or (self.moe_hidden_dim is not None and self.moe_hidden_dim <= 0):
            raise ValueError("model.n_shared_experts must be >= 0 and model.moe_hidden_dim positive")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate", "capacity_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"model.{name} must be a finite number >= 0, got {value}")

    @property
    def is_moe(self) -> bool:
        """Whether the feed-forward layers are Mixtures of Experts."""
        return self.n_experts > 0

    @property
    def expert_hidden_dim(self) -> int:
        """SwiGLU width of one routed expert."""
        return self.moe_hidden_dim if self.moe_hidden_dim is not None else self.hidden_dim

    @property
    def num_kv_heads(self) -> int:
        """Resolved number of key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """Resolved SwiGLU hidden width (``ffn_hidden_dim`` or Meta's sizing rule)."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        # 8/3 * dim keeps the three SwiGLU matrices at the cost of a 4*dim two-matrix MLP.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def compute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """RoPE table ``[max_seq_len, 2 * head_dim]`` = ``cat(cos, sin)`` in fp32 (computed in fp64), HF layout.

    Frequency ``i`` rotates the pair of channels ``(i, i + head_dim/2)``, which is the
    Hugging Face "rotate_half" convention.
    """
    # Computed in fp64 and rounded once: fp32 cos/sin of angles in the hundreds of radians differ
    # by several ulp between vectorised and scalar kernels (thread chunking picks which), so an fp32
    # table would not be reproducible across thread counts.
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, S, H, D]`` with ``rope_cache[:S]`` of shape ``[S, 2D]`` (or ``[B, S, 2D]``:
    each sequence's own positions, as document masking restarts them)."""
    cos, sin = rope_cache.float().chunk(2, dim=-1)
    if cos.ndim == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    # Rotating in fp32 keeps large positions accurate when activations are bf16.
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).type_as(x)


class CoreAttention(nn.Module):
    """``softmax(q k^T / sqrt(d) + causal mask) v`` on ``[B, H, S, D]``: attention without weights.

    A module of its own (no parameters, so no state-dict entries) so that activation
    checkpointing can recompute just this part (Korthikanti et al. 2022's selective
    recomputation, ``activation_checkpointing=attention``).
    """

    # Set under context parallelism: q, k, v then hold this rank's tokens only (see context_parallel.py).
    context_parallel: Optional[ContextParallel] = None
    # The softmax scale of `local_attention`, which the ring's own kernels use too; None: 1 / sqrt(head
    # width), SDPA's default (a subclass with another scale, MLA's, sets it).
    scale: Optional[float] = None
    # Set when QK-clip is on (`trainer.models.qk_clip.QKClip`): the per-head maximum logit of the training
    # forwards, read and cleared after each optimizer step.
    logit_max: Optional[LogitMax] = None

    def __init__(self, grouped: bool) -> None:
        super().__init__()
        # enable_gqa only when heads are actually grouped: some fused kernels reject the
        # flag outright, and plain multi-head attention should keep all of them eligible.
        self.grouped = grouped

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.logit_max is not None and self.training:
            self.logit_max.record(q, k, self.scale, self.context_parallel, doc_ids)
        if self.context_parallel is not None:
            return self.context_parallel.attention(q, k, v, self.local_attention, doc_ids=doc_ids, scale=self.scale)
        return self.local_attention(q, k, v, doc_ids)

    def local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention over whole sequences; with `doc_ids` ([B, S]) only within each document."""
        grouped = self.grouped and q.shape[1] != k.shape[1]  # all_to_all context parallelism may repeat K/V heads
        if doc_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        mask = document_mask(doc_ids, doc_ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE and no biases."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.core_attention = CoreAttention(grouped=self.n_kv_heads != self.n_heads)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv hold only this rank's heads (n_heads / tp).
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.core_attention(q, k, v, doc_ids)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def init_weights(self, std: float, residual_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init_linear_(linear, std)
        init_linear_(self.wo, residual_std)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, residual_std: float) -> None:
        init_linear_(self.w1, std)
        init_linear_(self.w3, std)
        init_linear_(self.w2, residual_std)


def make_feed_forward(config: LlamaConfig) -> nn.Module:
    """The dense SwiGLU, or a Mixture of Experts when ``config.n_experts > 0``."""
    if not config.is_moe:
        return FeedForward(config.dim, config.hidden_dim)
    hidden = config.expert_hidden_dim
    shared = FeedForward(config.dim, hidden * config.n_shared_experts) if config.n_shared_experts else None
    return MoE(config.dim, hidden, config.n_experts, config.top_k, shared_experts=shared,
               aux_loss_coef=config.router_aux_loss_coef, z_loss_coef=config.router_z_loss_coef,
               bias_update_rate=config.router_bias_update_rate, capacity_factor=config.capacity_factor,
               renormalize=config.router_renormalize, grouped_mm=config.moe_grouped_mm)


class TransformerBlock(nn.Module):
    """Pre-norm block ``x + attn(norm(x))`` then ``h + ffn(norm(h))``; stateless forward."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward: nn.Module = make_feed_forward(config)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, std: float, residual_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, residual_std)
        self.feed_forward.init_weights(std, residual_std)


class Llama(CausalLM):
    """Llama decoder returning logits ``[B, S, vocab_size]``.

    Pipeline stages: set ``tok_embeddings`` to None to feed hidden states ``[B, S, dim]``
    instead of token ids, set ``norm``/``output`` to None to return hidden states, and
    delete entries of ``layers`` (keys keep their global layer index).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config) for i in range(config.n_layers)}
        )
        self.norm: Optional[nn.RMSNorm] = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the config, so kept out of checkpoints; on the meta device it holds
        # no data until init_weights recomputes it.
        self.register_buffer("rope_cache", self._compute_rope_cache(None), persistent=False)

    def _attention_dim(self) -> int:
        return self.config.n_heads * self.config.head_dim

    def _compute_rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        cfg = self.config
        return compute_rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)

    def _apply(self, fn: Any, recurse: bool = True) -> Llama:
        super()._apply(fn, recurse)
        # Module.to(dtype)/.half() would also cast the RoPE table, and bf16 keeps only ~3
        # significant digits of cos/sin, so rebuild it in fp32 (a meta cache stays empty).
        cache = self.rope_cache
        if cache.dtype != torch.float32 and not cache.is_meta:
            with torch.no_grad():
                self.rope_cache = self._compute_rope_cache(cache.device)
        return self

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids ``[B, S]`` (or hidden states ``[B, S, dim]`` on a later pipeline stage). ``doc_ids``
        (``[B, S]`` of the whole sequence, `trainer.models.documents`): attention within documents only,
        positions restarting at each; a pipeline stage reads them from ``pipeline_doc_ids``."""
        doc_ids = self.pipeline_doc_ids if doc_ids is None else doc_ids
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        local_len = h.shape[1]
        if self.sequence_length(local_len) > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {self.sequence_length(local_len)} exceeds max_seq_len {self.config.max_seq_len}"
            )
        if doc_ids is not None:  # each token at its position in its document: [B, S, 2 x head_dim]
            rope_cache = self.rope_cache[self.document_positions(doc_ids)]
        elif self.context_parallel is None:
            rope_cache = self.rope_cache[:local_len]
        else:  # this rank's tokens sit at their global positions
            rope_cache = self.rope_cache[self.positions(local_len, self.rope_cache.device)]
        for layer in self.layers.values():
            h = layer(h, rope_cache, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize every parameter and the RoPE cache from torch's global RNG.

        Works on a model materialized with ``to_empty``; the draw order is fixed, so the
        same seed gives the same weights on the same device type.
        """
        cfg = self.config
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        tied = cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None
        if tied:
            # to_empty may have given the two modules separate storage.
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=cfg.init_std)
        for layer in self.layers.values():
            layer.init_weights(cfg.init_std, residual_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not tied:
            init_linear_(self.output, cfg.init_std)
        device = module_device(self) if buffer_device is None else torch.device(buffer_device)
        with torch.no_grad():
            self.rope_cache = self._compute_rope_cache(device)
