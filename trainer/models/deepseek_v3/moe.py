"""DeepSeekMoE routing (DeepSeek-V3, Section 2.1.2) on top of the framework's MoE layer.

`DeepSeekMoE` is `trainer.models.moe.MoE` (same grouped experts, dispatch, expert parallelism, statistics
and auxiliary-loss-free bias updates through `collect_moe_stats` / `update_router_biases`) with DeepSeek-V3's
router, as transformers' `DeepseekV3TopkRouter` computes it:

    s      = sigmoid(x W_r^T)                       affinity of each routed expert, in fp32
    choice = s + b                                  b: the auxiliary-loss-free selection bias (`expert_bias`,
                                                    HF `e_score_correction_bias`), used for the choice only
    groups: the experts split into n_group groups; each group scores the sum of its two best `choice`
            values; only the topk_group best groups stay eligible (node-limited routing: a token's experts
            live on at most topk_group nodes when the groups are nodes)
    chosen = top_k of `choice` among the eligible experts
    g      = s[chosen] (/ their sum + 1e-20 when norm_topk_prob) * routed_scaling_factor

The output is sum_j g_j expert_j(x) + shared_experts(x). The bias moves after every optimizer step by
`bias_update_rate` (the paper's gamma) towards under-loaded experts, outside the gradient (the loop calls
`update_router_biases`). Optional sequence-wise balance loss (the paper's eq. 17-20, weight alpha =
`aux_loss_coef`, off by default): per sequence, f_i = E / (K T) * #tokens that chose i, P_i = mean over
the sequence's tokens of s_i / sum_j s_j, loss = mean over sequences of sum_i f_i P_i (1.0 when balanced).
Under context parallelism the per-sequence statistics are summed over the ranks holding the parts of the
sequences (`sequence_group`): the loss is the whole sequences', as one process computes it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.moe import MoE, _local, _SumOverGroup


class DeepSeekMoE(MoE):
    """Sigmoid-scored, group-limited top-k routing with a routed scaling factor; see the module docstring."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, *, shared_experts: Optional[nn.Module],
                 n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                 bias_update_rate: float, seq_aux_loss_coef: float, grouped_mm: bool = True) -> None:
        super().__init__(dim, hidden_dim, n_experts, top_k, shared_experts=shared_experts,
                         aux_loss_coef=seq_aux_loss_coef, z_loss_coef=0.0, bias_update_rate=bias_update_rate,
                         capacity_factor=0.0, renormalize=norm_topk_prob, grouped_mm=grouped_mm)
        # DeepSeek-V3 renormalises the chosen affinities whenever norm_topk_prob is set, also for top-1
        # (the softmax MoE skips that case, where it would make every weight 1).
        self.renormalize = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        # Always in the state dict, whether or not this run moves it: published checkpoints carry trained
        # biases, which the routing must use.
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=True)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits [T, E] (fp32), sigmoid affinities [T, E], chosen experts [T, k], their gates [T, k]."""
        logits = F.linear(flat.float(), _local(self.router.weight).float())
        scores = logits.sigmoid()
        choice = scores + self.expert_bias.float()
        if self.n_group > 1:
            tokens = choice.shape[0]
            per_group = choice.view(tokens, self.n_group, -1)
            group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            kept = group_scores.topk(self.topk_group, dim=-1).indices
            eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = per_group.masked_fill(~eligible[:, :, None], float("-inf")).view(tokens, -1)
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, scores, chosen, weights * self.routed_scaling_factor

    def balance_loss(self, counts: torch.Tensor, probs: torch.Tensor, tokens: int, *,
                     chosen: Optional[torch.Tensor] = None, seq_len: Optional[int] = None,
                     counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss (eq. 17-20) before its weight alpha: 1.0 when every
        sequence spreads its tokens evenly, E / K when each sequence sends all of them to the same K.

        `counted` ([T] bool, `MoE.forward`): the tokens each sequence counts (T_b of them; the others are
        padding). Under context parallelism (`sequence_group`, training forwards) each rank holds a part of
        every sequence: the per-sequence picks, token counts and affinity sums are summed over the group, so
        that the loss is the whole sequences' (the same value on every rank; `_SumOverGroup` gives each
        rank's affinities their share of the gradient)."""
        del counts
        assert chosen is not None and seq_len is not None
        sequences = tokens // seq_len
        weight = (torch.ones(tokens, device=probs.device, dtype=probs.dtype) if counted is None
                  else counted.to(probs.dtype)).view(sequences, seq_len)
        normalized = probs / probs.sum(dim=-1, keepdim=True)  # s'_{i,t}
        share_sum = (normalized.view(sequences, seq_len, self.n_experts) * weight[..., None]).sum(dim=1)
        picks = torch.zeros(sequences, self.n_experts, device=probs.device, dtype=probs.dtype)
        picks.scatter_add_(1, chosen.view(sequences, -1),
                           weight[..., None].expand(-1, -1, self.top_k).reshape(sequences, -1))
        length = weight.sum(dim=1, keepdim=True)  # T_b
        if self.sequence_group is not None and self.training:
            summed = _SumOverGroup.apply(torch.cat([picks, length, share_sum], dim=1), self.sequence_group)
            picks, length, share_sum = summed.split([self.n_experts, 1, self.n_experts], dim=1)
            picks, length = picks.detach(), length.detach()
        frequency = picks * self.n_experts / (self.top_k * length)  # f_i per sequence (no gradient)
        share = share_sum / length  # P_i per sequence
        return (frequency * share).sum(dim=-1).mean()
