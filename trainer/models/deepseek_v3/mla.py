"""Multi-head latent attention (MLA, DeepSeek-V2 / V3) with its decoupled RoPE and YaRN scaling.

Per token and layer (names: ours, then transformers' `DeepseekV3Attention`):

    c_q  = q_norm(wq_a x)                                  q_a_proj -> q_a_layernorm   [q_lora_rank]
    q    = wq_b c_q -> per head [q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)]      q_b_proj
    c_kv, k_rope = wkv_a x                                 kv_a_proj_with_mqa  [kv_lora_rank + qk_rope_head_dim]
    c_kv = kv_norm(c_kv)                                   kv_a_layernorm
    per head [k_nope (qk_nope_head_dim) | v (v_head_dim)] = wkv_b c_kv                      kv_b_proj
    k    = [k_nope | RoPE(k_rope)]   (one rotated key part shared by every head)
    q    = [q_nope | RoPE(q_rope)]
    out  = wo softmax(q k^T * scale) v                     o_proj

`latent_kv` is what an inference cache stores: the normalised latent c_kv and the rotated shared key part,
kv_lora_rank + qk_rope_head_dim values per token and layer (576 for DeepSeek-V3, against 2 x 128 heads x
128 for plain multi-head attention), from which `wkv_b` rebuilds every head's keys and values.

RoPE: the published weights order each rotated pair as neighbouring channels (transformers'
`rope_interleave=True`); `apply_rope` (trainer/models/llama/model.py) pairs channel i with i + d/2 (`rotate_half`).
De-interleaving the rotated part first (even channels, then odd) gives exactly transformers'
`apply_rotary_pos_emb_interleave`, whose output is the de-interleaved rotation; since q and k are permuted
alike the scores do not change, so the weights stay in the published layout.

YaRN (`yarn_factor` > 1; the published config: factor 40 over an original 4096 positions) follows
transformers' `_compute_yarn_parameters` and `yarn_apply_mscale` exactly:
- frequencies: a linear ramp between interpolation (inv_freq / factor) and extrapolation (inv_freq) over
  the dimensions whose wavelengths fall between beta_fast and beta_slow rotations of the original context
  (correction range floored / ceiled, clipped to [0, d - 1]);
- cos and sin times the attention factor get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
  when both are set (1.0 for DeepSeek-V3, whose two are equal), else get_mscale(factor);
- the softmax scale qk_head_dim^-0.5 times get_mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set
  (1.3689^2 for factor 40), where get_mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.models.common import init_linear_
from trainer.models.documents import document_mask
from trainer.models.llama import CoreAttention, apply_rope

# transformers' DeepseekV3Attention (and DeepSeek's reference code) build the q and kv latent norms with
# RMSNorm's default epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor 0.1 * mscale * ln(scale) + 1 (1 without scaling)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """What transformers multiplies cos and sin by for YaRN (1.0 without scaling)."""
    if factor <= 1:
        return 1.0
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def softmax_scale(qk_head_dim: int, factor: float, mscale_all_dim: float) -> float:
    """qk_head_dim^-0.5, times get_mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim set."""
    scale = qk_head_dim ** -0.5
    if factor > 1 and mscale_all_dim:
        scale *= yarn_get_mscale(factor, mscale_all_dim) ** 2
    return scale


def rope_inverse_frequencies(dim: int, theta: float, factor: float = 1.0, original_max_seq_len: int = 4096,
                             beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """[dim / 2] inverse frequencies in fp64: plain RoPE for factor <= 1, else YaRN's blend."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if factor <= 1:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return dim * math.log(original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency (high frequencies), 0: interpolate
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def compute_mla_rope_cache(dim: int, max_seq_len: int, theta: float, factor: float = 1.0,
                           original_max_seq_len: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0,
                           mscale: float = 1.0, mscale_all_dim: float = 0.0,
                           device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE table ``[max_seq_len, 2 * dim]`` = ``cat(cos, sin)`` (rotate-half layout, the format
    `apply_rope` reads), YaRN-scaled when ``factor > 1``; computed in fp64 and rounded once to fp32."""
    inv_freq = rope_inverse_frequencies(dim, theta, factor, original_max_seq_len, beta_fast, beta_slow).to(device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    attention_factor = yarn_attention_factor(factor, mscale, mscale_all_dim)
    return torch.cat((angles.cos() * attention_factor, angles.sin() * attention_factor), dim=-1).float()


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Channels (0, 1, 2, 3, ...) -> (0, 2, 4, ..., 1, 3, 5, ...): neighbouring pairs become (i, i + d/2)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (Megatron's "copy to the model-parallel
    region"): for a tensor every rank computes whole and each uses for its own heads. The group is held
    weakly, as `_SumOverGroup` in moe.py does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = weakref.ref(group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group())
        return grad, None


class MLACoreAttention(CoreAttention):
    """Causal ``softmax(q k^T * scale) v`` with MLA's softmax scale and a value width (v_head_dim) that
    differs from the query/key width; the module activation_checkpointing=attention recomputes."""

    def __init__(self, scale: float) -> None:
        super().__init__(grouped=False)  # every head has its own keys and values (rebuilt from the latent)
        self.scale = scale

    def local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if doc_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids, doc_ids), scale=self.scale)


class MultiHeadLatentAttention(nn.Module):
    """MLA (see the module docstring): low-rank queries, keys and values rebuilt from a compressed latent,
    and a decoupled rotary key part shared across heads."""

    # The ranks the heads are split over (tensor parallelism, set by the strategy for the modules the family
    # names in `BlockSplit.head_groups`): each rank's heads use the shared rotary key, whose gradient is
    # then a sum over the ranks.
    head_group: Optional[dist.ProcessGroup] = None

    def __init__(self, dim: int, n_heads: int, q_lora_rank: Optional[int], kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, scale: float,
                 rope_interleave: bool = True) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_interleave = rope_interleave
        self.wq: Optional[nn.Linear] = None
        self.wq_a: Optional[nn.Linear] = None
        self.q_norm: Optional[nn.RMSNorm] = None
        self.wq_b: Optional[nn.Linear] = None
        if q_lora_rank is None:  # full-rank queries (DeepSeek-V2-Lite)
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.core_attention = MLACoreAttention(scale)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def _rotate(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        return apply_rope(deinterleave(x) if self.rope_interleave else x, rope_cache)

    def latent_kv(self, x: torch.Tensor, rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What an inference cache keeps per token: ``c_kv`` ``[B, S, kv_lora_rank]`` (normalised) and the
        rotated shared key part ``k_rope`` ``[B, S, 1, qk_rope_head_dim]``."""
        batch, seq_len, _ = x.shape
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = self._rotate(k_rope.view(batch, seq_len, 1, self.qk_rope_head_dim), rope_cache)
        if self.head_group is not None:
            k_rope = _SumGradientOverGroup.apply(k_rope, self.head_group)
        return self.kv_norm(c_kv), k_rope

    def queries(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        """``[B, S, H, qk_head_dim]``: ``[q_nope | RoPE(q_rope)]`` per head."""
        batch, seq_len, _ = x.shape
        if self.wq is not None:
            q = self.wq(x)
        else:
            assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(batch, seq_len, -1, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return torch.cat((q_nope, self._rotate(q_rope, rope_cache)), dim=-1)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.queries(x, rope_cache)
        c_kv, k_rope = self.latent_kv(x, rope_cache)
        k_nope, v = self.wkv_b(c_kv).view(batch, seq_len, -1, self.qk_nope_head_dim + self.v_head_dim).split(
            [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        out = self.core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), doc_ids)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b, self.wo):
            if linear is not None:
                init_linear_(linear, std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()
