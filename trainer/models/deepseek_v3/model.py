"""DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437): MLA attention, DeepSeekMoE feed-forwards after
`first_k_dense_replace` dense ones, and multi-token prediction (MTP).

The main model is transformers' `DeepseekV3ForCausalLM` (tested to the same logits with the same weights:
tests/test_deepseek_v3.py); names follow torchtitan's DeepSeek-V3 (`hf_adapter.py` maps them to and from
transformers'). Pieces reused from the framework: `nn.RMSNorm`, `apply_rope` (rotate-half RoPE; the
published interleaved layout is de-interleaved in `mla.py`), the Llama `FeedForward` (SwiGLU) for the dense
layers and the shared experts, and the MoE layer (`trainer/models/moe.py`: grouped experts, dispatch,
expert parallelism, statistics, the auxiliary-loss-free bias update) with DeepSeek's router (`moe.py`).

**Multi-token prediction** (Section 2.2). Depth k = 1..D has its own module (enorm, hnorm, eh_proj, one
transformer block with an MoE feed-forward, and the output norm, DeepSeek's `shared_head.norm`) and shares
the embedding and the output head with the main model:

    h'_i^k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})])      (the published weights' order)
    h_i^k  = norm_k(TRM_k(h'_i^k))                                  predicts t_{i+k+1} through the shared head
    h^0    = the main model's final normalised hidden state (what its head reads)

Each depth is thus fed the representation its predecessor's head reads (transformers' `MtpModel`, with
its per-layer `post_norm`). During training forwards the loss lambda / D * sum_k CE_k is attached to the
logits (`_AttachAuxLoss`): its gradient is the one a term added to the language-model loss would get,
under every strategy's loss scaling and accumulation, without the loss path knowing about it. The model
sees the input tokens only (the targets stay with the strategy), so depth k predicts t_{i+k+1} for the
positions whose target is among the inputs: S - k - 1 of a window of S (the paper counts S - k, with the
window's next token), and CE_k is the mean over those. Each depth runs at the full length S (`mtp_tokens`:
position i reads t_{i+k}; the last k + 1 positions read a padding token, their targets are ignored and
their routing is left out of the MoE statistics); attention being causal, the other positions are those
of a depth run on S - k - 1 tokens. So under context parallelism a rank runs each depth on its part of the
whole sequence's shifted tokens, cut as its tokens are (the whole sequence's ids are gathered over the cp
group), and sums its targets' losses over the global count B x (S - k - 1), times cp (the gradients and the
logged losses are averaged over the cp ranks). Evaluation forwards skip MTP (the validation loss is
the main model's). `mtp/loss` (mean over depths, before lambda) and `mtp/loss/<k>` are logged through
`collect_moe_stats`'s `StepStatistics`.

**Context parallelism** (`cp`, both methods): MLA's core attention runs across the cp ranks with its own
softmax scale and value width (trainer/models/context_parallel.py), RoPE reads this rank's global
positions, and the DeepSeekMoE statistics (loads, the sequence-wise balance loss) are those of whole
sequences (`MoE.sequence_group`).

**Counts.** `num_params()` / `num_active_params()` follow the published convention by default (671B /
37B without the 14B MTP module; `count_mtp_params` or `include_mtp=True` adds it; embedding and head are
shared, so the MTP adds its own weights only: the published 14B also counts the checkpoint's copies of
the embedding and head). FLOPs count what a training step runs, MTP included (`flops_per_token`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.loss import IGNORE_INDEX, cross_entropy_loss
from trainer.models.common import (CausalLM, matmul_params, module_device, require_divisible, require_positive,
                                   unique_numel)
from trainer.models.deepseek_v3.mla import MultiHeadLatentAttention, compute_mla_rope_cache, softmax_scale
from trainer.models.deepseek_v3.moe import DeepSeekMoE
from trainer.models.llama import FeedForward
from trainer.models.moe import MoE, StepStatistics, _AttachAuxLoss, counts_statistics


@dataclass
class DeepSeekV3Config:
    """Architecture of a DeepSeek-V3 model; the defaults are the published DeepSeek-V3 (671B) config.
    Each field names its transformers `DeepseekV3Config` counterpart where the name differs."""

    # Hydra target; `trainer.models.build_model` resolves the model class from it.
    _target_: str = "trainer.models.DeepSeekV3"
    # Human-readable model name (logs, checkpoint metadata).
    name: str = "deepseek_v3"
    # Vocabulary size (vocab_size): rows of the embedding and of the output head.
    vocab_size: int = 129280
    # Residual stream width (hidden_size).
    dim: int = 7168
    # Transformer blocks of the main model (num_hidden_layers); the MTP blocks come on top.
    n_layers: int = 61
    # Attention heads (num_attention_heads); MLA gives each head its own keys and values.
    n_heads: int = 128
    # Rank of the query compression (q_lora_rank); None: full-rank queries (`wq`, DeepSeek-V2-Lite).
    q_lora_rank: Optional[int] = 1536
    # Rank of the key/value latent c_kv (kv_lora_rank), what an inference cache stores per token.
    kv_lora_rank: int = 512
    # Per-head query/key width without position encoding (qk_nope_head_dim).
    qk_nope_head_dim: int = 128
    # Per-head width of the rotary (decoupled) query part and of the key part shared by all heads.
    qk_rope_head_dim: int = 64
    # Per-head value width (v_head_dim).
    v_head_dim: int = 128
    # SwiGLU width of the dense feed-forward layers (intermediate_size).
    ffn_hidden_dim: int = 18432
    # The first this many blocks have a dense feed-forward, the others DeepSeekMoE (first_k_dense_replace).
    first_k_dense_replace: int = 3
    # Routed experts per MoE layer (n_routed_experts).
    n_experts: int = 256
    # Routed experts per token (num_experts_per_tok).
    top_k: int = 8
    # Shared experts every token goes through (n_shared_experts), one SwiGLU of n_shared x moe_hidden_dim.
    n_shared_experts: int = 1
    # SwiGLU width of one routed or shared expert (moe_intermediate_size).
    moe_hidden_dim: int = 2048
    # Expert groups for node-limited routing (n_group); 1: no group stage.
    n_group: int = 8
    # Groups a token's experts may come from (topk_group), chosen by the sum of each group's 2 best scores.
    topk_group: int = 4
    # Renormalise the chosen sigmoid affinities to sum to 1 (norm_topk_prob).
    norm_topk_prob: bool = True
    # Multiplies the routed experts' gates (routed_scaling_factor).
    routed_scaling_factor: float = 2.5
    # Auxiliary-loss-free balancing: each expert's selection bias (e_score_correction_bias) moves by this
    # much per optimizer step towards the mean load; the paper's gamma, 0.001 (0.0 for its last 500B tokens).
    router_bias_update_rate: float = 0.001
    # Weight alpha of the sequence-wise balance loss (the paper: 0.0001); 0 = off, only logged (moe/aux_loss).
    seq_aux_loss_coef: float = 0.0
    # Multiply each expert's tokens with torch's grouped matmul where it applies (else one matmul per expert).
    moe_grouped_mm: bool = True
    # Multi-token prediction depth D (num_nextn_predict_layers); 0: no MTP module.
    mtp_depth: int = 1
    # Weight lambda of the MTP loss (the paper: 0.3 for the first 10T tokens, then 0.1); must be > 0 with
    # mtp_depth > 0 (unused MTP weights would get no gradient: set mtp_depth=0 instead).
    mtp_loss_weight: float = 0.3
    # Whether num_params / num_active_params count the MTP modules. False: the published convention
    # (671B total, 37B active; transformers' DeepseekV3ForCausalLM has no MTP layer either).
    count_mtp_params: bool = False
    # Epsilon of the block and final RMSNorms (rms_norm_eps); the q/kv latent norms use 1e-6 (mla.py).
    norm_eps: float = 1e-6
    # RoPE base (rope_theta).
    rope_theta: float = 10000.0
    # The published rotary weights pair neighbouring channels (rope_interleave); False: rotate-half pairs.
    rope_interleave: bool = True
    # Longest sequence (max_position_embeddings); sizes the RoPE table (not saved).
    max_seq_len: int = 163840
    # YaRN context extension (rope_scaling type yarn) by this factor; 1.0 = plain RoPE.
    yarn_factor: float = 40.0
    # YaRN: the context length the model was pre-trained at (original_max_position_embeddings).
    yarn_original_max_seq_len: int = 4096
    # YaRN: rotations bounding the interpolation ramp (beta_fast, beta_slow).
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # YaRN: temperature factors (mscale, mscale_all_dim; 0 = unset, as transformers reads them).
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0
    # Std of the normal init of every weight (the paper: 0.006).
    init_std: float = 0.006

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` on inconsistent shapes or options."""
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim",
                      "qk_rope_head_dim", "v_head_dim", "ffn_hidden_dim", "n_experts", "top_k", "moe_hidden_dim",
                      "n_group", "topk_group", "max_seq_len", "yarn_original_max_seq_len"):
            require_positive(getattr(self, field), f"model.{field}")
        if self.q_lora_rank is not None:
            require_positive(self.q_lora_rank, "model.q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"RoPE needs an even model.qk_rope_head_dim, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.n_layers:
            raise ValueError(f"model.first_k_dense_replace={self.first_k_dense_replace} must be in [0, n_layers]")
        if self.n_shared_experts < 0:
            raise ValueError(f"model.n_shared_experts must be >= 0, got {self.n_shared_experts}")
        require_divisible(self.n_experts, self.n_group, "model.n_experts must be divisible by model.n_group")
        per_group = self.n_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"group-limited routing scores a group by its 2 best experts: model.n_experts / "
                             f"model.n_group = {per_group} must be >= 2")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"model.topk_group={self.topk_group} must be between 1 and model.n_group={self.n_group}")
        if not 1 <= self.top_k <= self.topk_group * per_group:
            raise ValueError(f"model.top_k={self.top_k} must be between 1 and the experts of topk_group groups "
                             f"({self.topk_group} x {per_group})")
        for name in ("routed_scaling_factor", "router_bias_update_rate", "seq_aux_loss_coef", "mtp_loss_weight",
                     "norm_eps", "rope_theta", "yarn_factor", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
                     "yarn_mscale_all_dim", "init_std"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"model.{name} must be a finite number >= 0, got {value}")
        if self.routed_scaling_factor <= 0 or self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("model.routed_scaling_factor, rope_theta and norm_eps must be positive")
        if self.mtp_depth < 0:
            raise ValueError(f"model.mtp_depth must be >= 0, got {self.mtp_depth}")
        if self.mtp_depth and self.mtp_loss_weight <= 0:
            raise ValueError("model.mtp_loss_weight must be > 0 with model.mtp_depth > 0 (its weights would get "
                             "no gradient): set model.mtp_depth=0 to train without multi-token prediction")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: qk_nope_head_dim + qk_rope_head_dim (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def tie_embeddings(self) -> bool:
        """DeepSeek-V3's head is its own weight (the MTP modules share it, and the embedding)."""
        return False

    @property
    def yarn(self) -> bool:
        """Whether RoPE is YaRN-scaled."""
        return self.yarn_factor > 1

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale^2 when scaled (transformers' `yarn_apply_mscale`)."""
        return softmax_scale(self.qk_head_dim, self.yarn_factor, self.yarn_mscale_all_dim)

    def is_moe_layer(self, index: int) -> bool:
        """Whether main-model block `index` has a DeepSeekMoE feed-forward (MTP blocks always do)."""
        return index >= self.first_k_dense_replace


class DeepSeekV3Block(nn.Module):
    """Pre-norm block ``x + mla(norm(x))`` then ``h + ffn(norm(h))``, with a dense SwiGLU or DeepSeekMoE."""

    def __init__(self, config: DeepSeekV3Config, moe: bool) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = MultiHeadLatentAttention(
            config.dim, config.n_heads, config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim,
            config.qk_rope_head_dim, config.v_head_dim, config.softmax_scale, config.rope_interleave)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward: nn.Module
        if moe:
            shared = (FeedForward(config.dim, config.moe_hidden_dim * config.n_shared_experts)
                      if config.n_shared_experts else None)
            self.feed_forward = DeepSeekMoE(
                config.dim, config.moe_hidden_dim, config.n_experts, config.top_k, shared_experts=shared,
                n_group=config.n_group, topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
                routed_scaling_factor=config.routed_scaling_factor,
                bias_update_rate=config.router_bias_update_rate, seq_aux_loss_coef=config.seq_aux_loss_coef,
                grouped_mm=config.moe_grouped_mm)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`counted` (`[B, S]` bool; an MoE block only): the tokens whose routing its statistics count
        (`MoE.forward`); the multi-token-prediction blocks leave out the padding past the window's end."""
        h = x + self.attention(self.attention_norm(x), rope_cache, doc_ids)
        normed = self.ffn_norm(h)
        return h + (self.feed_forward(normed) if counted is None else self.feed_forward(normed, counted=counted))

    def init_weights(self, std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std)
        self.feed_forward.init_weights(std, std)  # one std for every weight (the paper)


class MTPModule(nn.Module):
    """One multi-token-prediction depth: ``norm(block(eh_proj([enorm(emb); hnorm(h)])))`` (model docstring).
    Names are those of DeepSeek's checkpoint (`model.layers.<n_layers + k - 1>.enorm` ...)."""

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__()
        self.enorm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.hnorm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.block = DeepSeekV3Block(config, moe=True)  # DeepSeek-V3's MTP block is an MoE layer
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)  # the checkpoint's shared_head.norm

    def forward(self, embeddings: torch.Tensor, previous: torch.Tensor, rope_cache: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None, counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.eh_proj(torch.cat((self.enorm(embeddings), self.hnorm(previous)), dim=-1))
        return self.norm(self.block(h, rope_cache, doc_ids, counted))

    def init_weights(self, std: float) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        nn.init.normal_(self.eh_proj.weight, mean=0.0, std=std)
        self.block.init_weights(std)


class MultiTokenPrediction(nn.ModuleDict):
    """The D MTP depths, keyed by their layer index in DeepSeek's numbering (n_layers, n_layers + 1, ...:
    the MoE statistics of their blocks are logged under those keys)."""

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__({str(config.n_layers + k): MTPModule(config) for k in range(config.mtp_depth)})


class MTPLosses(nn.Module, StepStatistics):
    """The step's MTP losses (`mtp/loss`, `mtp/loss/<k>`). No weights: every pipeline stage holds one, the
    stage with the MTP module records into it, and the pipeline sums the accumulations over the stages after
    each step (`DeepSeekV3Family.sum_statistics_over_stages`), so that the logging rank reports them."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.reset_losses()

    def reset_losses(self) -> None:
        self.loss_sums = [0.0] * self.depth
        self.loss_calls = 0

    def record(self, losses: list[torch.Tensor]) -> None:
        """Add one training forward's per-depth losses (skipped inside autograd's backward: an
        activation-checkpointing recompute repeats a forward already counted; and in a pipeline's metadata
        inference, `moe_stats_paused`)."""
        if not counts_statistics():
            return
        for depth, loss in enumerate(losses):
            self.loss_sums[depth] += float(loss.detach())
        self.loss_calls += 1

    def totals(self) -> list[float]:
        """What `read_stats` averages: the per-depth loss sums and the number of forwards."""
        return [*self.loss_sums, float(self.loss_calls)]

    def set_totals(self, totals: list[float]) -> None:
        *self.loss_sums, calls = totals
        self.loss_calls = int(calls)

    def stat_names(self) -> list[str]:
        if not self.depth:
            return []
        return ["mtp/loss", *(f"mtp/loss/{k}" for k in range(1, self.depth + 1))]

    def read_stats(self) -> list[float]:
        if not self.depth:
            return []
        calls = max(self.loss_calls, 1)
        per_depth = [total / calls for total in self.loss_sums]
        self.reset_losses()
        return [sum(per_depth) / max(len(per_depth), 1), *per_depth]


class DeepSeekV3(CausalLM):
    """DeepSeek-V3 returning the main model's logits ``[B, S, vocab_size]``; in training forwards the MTP
    loss reaches the gradients through the logits (see the module docstring).

    A pipeline stage (`pp_stage_index`, set by the split) holds its blocks; the first stage the embedding,
    the last the final norm, the head and the MTP module, and a copy of the embedding, which MTP reads
    (`DeepSeekV3Family.end_stage_copies`: the pipeline keeps the two copies equal). A later stage takes
    hidden states; the last reads its micro-batch's token ids from `pipeline_tokens`."""

    last_stage_modules: tuple[str, ...] = ("norm", "output", "mtp")
    # This model's pipeline stage (0: the first stage, or the whole model); set by the pipeline split.
    pp_stage_index: int = 0

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): DeepSeekV3Block(config, moe=config.is_moe_layer(i)) for i in range(config.n_layers)})
        self.norm: Optional[nn.RMSNorm] = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.mtp: Optional[MultiTokenPrediction] = MultiTokenPrediction(config)
        self.mtp_losses = MTPLosses(config.mtp_depth)
        # Derived from the config, so kept out of checkpoints; empty on the meta device until init_weights.
        self.register_buffer("rope_cache", self._compute_rope_cache(None), persistent=False)

    # ---- RoPE ----------------------------------------------------------------------------------------
    def _compute_rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        cfg = self.config
        factor = cfg.yarn_factor if cfg.yarn else 1.0
        return compute_mla_rope_cache(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta, factor,
                                      cfg.yarn_original_max_seq_len, cfg.yarn_beta_fast, cfg.yarn_beta_slow,
                                      cfg.yarn_mscale, cfg.yarn_mscale_all_dim, device=device)

    def _apply(self, fn: Any, recurse: bool = True) -> DeepSeekV3:
        super()._apply(fn, recurse)
        # .to(bf16) would round cos/sin to ~3 digits: rebuild the table in fp32 (a meta table stays empty).
        cache = self.rope_cache
        if cache.dtype != torch.float32 and not cache.is_meta:
            with torch.no_grad():
                self.rope_cache = self._compute_rope_cache(cache.device)
        return self

    def _rope(self, local_len: int, doc_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """The RoPE rows of the `local_len` tokens this rank holds of each sequence (all of them without
        context parallelism, else this rank's shard at its global positions)."""
        if self.sequence_length(local_len) > self.config.max_seq_len:
            raise ValueError(f"sequence length {self.sequence_length(local_len)} exceeds max_seq_len "
                             f"{self.config.max_seq_len}")
        if doc_ids is not None:  # positions restart at each document: [B, S, 2 x rope dim]
            return self.rope_cache[self.document_positions(doc_ids)]
        if self.context_parallel is None:
            return self.rope_cache[:local_len]
        return self.rope_cache[self.positions(local_len, self.rope_cache.device)]

    # ---- forward -------------------------------------------------------------------------------------
    def hidden_states(self, tokens: torch.Tensor,
                      doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embeddings, final normalised hidden states), both ``[B, S, dim]`` (the whole model)."""
        assert self.tok_embeddings is not None and self.norm is not None
        embeddings = self.tok_embeddings(tokens)
        rope_cache = self._rope(tokens.shape[1], doc_ids)
        h = embeddings
        for layer in self.layers.values():
            h = layer(h, rope_cache, doc_ids)
        return embeddings, self.norm(h)

    def mtp_tokens(self, tokens: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP depth `depth`'s input token ids and targets, this rank's part of each (`[B, S_local]`), from
        the whole sequence's token ids `tokens` (`[B, S]`): position i reads t_{i+k} and predicts t_{i+k+1}.
        Positions past the window's end read token 0 and have the loss's ignore index as target: causal
        attention keeps them from the valid positions, which are those of a depth run on S - k - 1 tokens."""
        inputs = F.pad(tokens[:, depth:], (0, depth), value=0)
        targets = F.pad(tokens[:, depth + 1:], (0, depth + 1), value=IGNORE_INDEX)
        if self.context_parallel is not None:
            inputs, targets = self.context_parallel.shard(inputs), self.context_parallel.shard(targets)
        return inputs, targets

    def mtp_hidden_states(self, tokens: torch.Tensor, hidden: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                          rope_cache: Optional[torch.Tensor] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each MTP depth's normalised representation ``[B, S_local, dim]`` and targets ``[B, S_local]``
        (`mtp_tokens`), from the whole sequence's token ids ``[B, S]`` and this rank's final normalised
        hidden states ``[B, S_local, dim]``. Every depth runs at the full length, the positions past the end
        (k + 1 of them at depth k) being padding: their targets are ignored and their routing is not counted
        (`counted`). So a rank's part of each depth is cut from the whole sequence as its tokens are
        (context parallelism), and the valid positions are those of depth k run on S - k - 1 tokens. The
        depths without a target in the window are skipped."""
        assert self.tok_embeddings is not None
        seq_len = tokens.shape[1]
        if rope_cache is None:
            rope_cache = self._rope(hidden.shape[1], doc_ids)
        outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        previous = hidden
        for depth, module in enumerate(self._mtp_depths(), start=1):
            if seq_len - depth - 1 <= 0:
                break
            inputs, targets = self.mtp_tokens(tokens, depth)
            previous = module(self.tok_embeddings(inputs), previous, rope_cache, doc_ids, targets != IGNORE_INDEX)
            outputs.append((previous, targets))
        return outputs

    def mtp_logits(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Each MTP depth's logits through the shared head at its valid positions (depth k: ``[B, S - k - 1,
        vocab]``, position i predicting token i + k + 1); the whole model in one process."""
        _, hidden = self.hidden_states(tokens, doc_ids)
        assert self.output is not None
        return [self.output(h)[:, :tokens.shape[1] - depth - 1]
                for depth, (h, _) in enumerate(self.mtp_hidden_states(tokens, hidden, doc_ids), start=1)]

    def mtp_losses_of(self, tokens: torch.Tensor, hidden: torch.Tensor, doc_ids: Optional[torch.Tensor],
                      rope_cache: torch.Tensor) -> list[torch.Tensor]:
        """CE_k of each depth: the mean over the B x (S - k - 1) targets of the whole micro-batch. `tokens`:
        this rank's token ids (`[B, S_local]`; under context parallelism the whole sequence's are gathered
        from the group). Under context parallelism each rank returns its targets' summed loss over that
        global count, times cp: the gradient average over the cp ranks and the logged mean over them are
        then the single process's CE_k."""
        assert self.output is not None
        ranks = 1
        if self.context_parallel is not None:
            tokens, ranks = self.context_parallel.gather(tokens), self.context_parallel.size
        batch, seq_len = tokens.shape
        losses = []
        for depth, (h, targets) in enumerate(self.mtp_hidden_states(tokens, hidden, doc_ids, rope_cache), start=1):
            summed = cross_entropy_loss(self.output(h), targets, reduction="sum")
            losses.append(summed * (ranks / (batch * (seq_len - depth - 1))))
        return losses

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids ``[B, S]`` (``doc_ids`` ``[B, S]``: attention within documents, positions restarting), or
        hidden states ``[B, S, dim]`` on a later pipeline stage, which returns hidden states unless it is the
        last; a stage reads its micro-batch's document ids from ``pipeline_doc_ids`` and, on the last stage,
        its token ids (what MTP embeds and predicts) from ``pipeline_tokens``."""
        doc_ids = self.pipeline_doc_ids if doc_ids is None else doc_ids
        if self.pp_stage_index == 0:  # the first stage (or the whole model): token ids in
            assert self.tok_embeddings is not None
            h = self.tok_embeddings(tokens)
        else:
            h, tokens = tokens, self.pipeline_tokens  # type: ignore[assignment]
        rope_cache = self._rope(h.shape[1], doc_ids)
        for layer in self.layers.values():
            h = layer(h, rope_cache, doc_ids)
        if self.output is None:  # not the last stage
            return h
        assert self.norm is not None
        hidden = self.norm(h)
        logits = self.output(hidden)
        if self.mtp is not None and len(self.mtp) and self.training and torch.is_grad_enabled():
            # (on a later pipeline stage, its copy of the embedding embeds the shifted tokens)
            assert tokens is not None, "the last stage needs pipeline_tokens"
            losses = self.mtp_losses_of(tokens, hidden, doc_ids, rope_cache)
            if losses:
                self.mtp_losses.record(losses)
                weighted = self.config.mtp_loss_weight / len(self.mtp) * torch.stack(losses).sum()
                logits = _AttachAuxLoss.apply(logits, weighted)
        return logits

    # ---- accounting ----------------------------------------------------------------------------------
    def _attention_dim(self) -> int:
        """Width of the attention output (``n_heads * v_head_dim``, what wo reads)."""
        return self.config.n_heads * self.config.v_head_dim

    def _mtp_depths(self) -> list[MTPModule]:
        """The MTP depths this model (or pipeline stage: the last one holds them) holds."""
        return [] if self.mtp is None else list(self.mtp.values())  # type: ignore[arg-type]

    def _counts_mtp(self, include_mtp: Optional[bool]) -> bool:
        return self.config.count_mtp_params if include_mtp is None else include_mtp

    def num_params(self, exclude_embeddings: bool = False, include_mtp: Optional[bool] = None) -> int:
        """Parameters held; the MTP modules only with ``include_mtp`` (default: ``config.count_mtp_params``,
        off: the published 671B). The embedding and head the MTP shares count once."""
        excluded: set[int] = set()
        if exclude_embeddings and self.tok_embeddings is not None:
            excluded |= {id(p) for p in self.tok_embeddings.parameters()}
        if not self._counts_mtp(include_mtp):
            excluded |= {id(p) for depth in self._mtp_depths() for p in depth.parameters()}
        return unique_numel(p for p in self.parameters() if id(p) not in excluded)

    @staticmethod
    def _inactive_experts(modules: Any) -> int:
        total = 0
        for module in modules:
            if isinstance(module, MoE):
                experts = sum(p.numel() for p in module.experts.parameters())
                total += experts - experts * module.top_k // module.n_experts
        return total

    def num_active_params(self, include_mtp: Optional[bool] = None) -> int:
        """Parameters one token uses: everything but the routed experts it is not sent to (embedding, head,
        attention, dense layers, shared experts, routers and norms count; top_k of n_experts experts): about
        37.6B of DeepSeek-V3's 671B. MTP as for `num_params`."""
        include = self._counts_mtp(include_mtp)
        inactive = self._inactive_experts(self.layers.modules())
        if include:
            inactive += sum(self._inactive_experts(depth.modules()) for depth in self._mtp_depths())
        return self.num_params(include_mtp=include) - inactive

    def num_matmul_params(self) -> int:
        """Weights one token multiplies with in a training forward: every Linear of the main model (routers
        included), top_k of n_experts routed experts, and per MTP depth its own matmuls plus the shared
        output head once more."""
        head = 0 if self.output is None else self.output.weight.numel()
        main = matmul_params(self.layers) + head
        mtp = sum(matmul_params(module) + head for module in self._mtp_depths())
        return main + mtp

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward = 3 x forward, Narayanan et al. 2021's convention):

            6 * num_matmul_params()
          + 6 * (n_layers + mtp_depth) * seq_len * n_heads * (qk_head_dim + v_head_dim)

        the second term being QK^T (width qk_head_dim = 192) and attention x V (v_head_dim = 128) per head,
        not halved for causality, for the main blocks and the MTP blocks alike. MTP depths run at the full
        sequence length (S - k - 1 positions with a target, the rest padding). Elementwise work is ignored."""
        require_positive(seq_len, "seq_len")
        cfg = self.config
        blocks = len(self.layers) + len(self._mtp_depths())
        return 6 * self.num_matmul_params() + 6 * blocks * seq_len * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)

    # ---- init ----------------------------------------------------------------------------------------
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize every weight from torch's global RNG (normal(0, init_std), norms 1, selection
        biases 0) and the RoPE table; works after ``to_empty``, in a fixed draw order."""
        std = self.config.init_std
        if self.tok_embeddings is not None:  # a pipeline stage inits what it holds
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.layers.values():
            layer.init_weights(std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)
        for module in self._mtp_depths():
            module.init_weights(std)
        self.mtp_losses.reset_losses()
        device = module_device(self) if buffer_device is None else torch.device(buffer_device)
        with torch.no_grad():
            self.rope_cache = self._compute_rope_cache(device)
