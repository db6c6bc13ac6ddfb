"""Qwen3 decoder, dense and Mixture of Experts (Qwen3-0.6B ... 32B, Qwen3-30B-A3B, Qwen3-235B-A22B).

A Llama-style pre-norm decoder (RMSNorm, RoPE in Hugging Face's rotate-half layout, grouped-query
attention, SwiGLU) with what Qwen3 adds, checked against transformers' `modeling_qwen3.py` and
`modeling_qwen3_moe.py`:

- **q/k norm**: an RMSNorm over `head_dim` (one weight of `head_dim` shared by all heads) applied to each
  query and key head after the projection and before RoPE.
- **head_dim** is a field of its own, not `dim / n_heads` (Qwen3-30B-A3B: 32 heads x 128 = 4096 attention
  width on a residual stream of 2048); the attention scale is `head_dim ** -0.5` (SDPA's default).
- optional biases on q/k/v/o (`attention_bias`, off in every published Qwen3).
- **MoE** (`n_experts > 0`): token-choice top-k over a softmax of the router logits, the k weights
  renormalised to sum to 1 when `norm_topk_prob` (`Qwen3MoeTopKRouter`); the layer is the project's `MoE`
  (router + stacked SwiGLU experts, grouped matmul, expert parallelism). Which layers are sparse follows
  `Qwen3MoeDecoderLayer`: layer i is an MoE unless i is in `mlp_only_layers` or (i + 1) is not a multiple of
  `decoder_sparse_step`; the others keep a dense SwiGLU of `ffn_hidden_dim`.
- **load-balancing loss** as transformers' `load_balancing_loss_func` defines it for Qwen3-MoE: pooled
  over the MoE layers of one forward, `E * sum_e F_e * P_e` with F_e the assignments to expert e over all
  layers' T x k choices divided by (layers x T) (so sum_e F_e = k) and P_e the mean router probability of e
  over all layers' rows; added to the loss times `router_aux_loss_coef` (see `PooledBalance`). Under
  pipeline parallelism the stages pass these sums forward beside the hidden states and the whole model's
  back as their gradient (`_CarryBalanceOn`, `_CarryBalanceEnd`), so every stage trains the pooled loss.

Module and parameter names are the Llama's (`attention.wq`, `attention_norm`, `feed_forward.w1`, ...) so
that the project's name-based tools (activation checkpointing's `core_attention`, weight-decay groups,
checkpoints) treat both alike; `hf_adapter.py` maps them to transformers' names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer.models.common import CausalLM, init_linear_, module_device, require_divisible, require_positive
from trainer.models.llama import CoreAttention, FeedForward, apply_rope, compute_rope_cache
from trainer.models.moe import MoE, _in_backward, _SumOverGroup


@dataclass
class Qwen3Config:
    """Architecture of a Qwen3 model; the defaults are Qwen3-8B (dense). Field names are the project's
    (the Llama's); the Hugging Face `config.json` name of each is given in brackets."""

    # Hydra target; ``trainer.models.build_model`` resolves the model class from it.
    _target_: str = "trainer.models.Qwen3"
    # Human-readable model name (used in logs and checkpoint metadata).
    name: str = "qwen3"
    # Vocabulary size (rows of the embedding and the output head) [vocab_size].
    vocab_size: int = 151936
    # Residual stream width [hidden_size].
    dim: int = 4096
    # Number of transformer blocks [num_hidden_layers].
    n_layers: int = 36
    # Number of query heads [num_attention_heads]; need not divide ``dim`` (see head_dim).
    n_heads: int = 32
    # Number of key/value heads for grouped-query attention; None = n_heads [num_key_value_heads].
    n_kv_heads: Optional[int] = 8
    # Width of one attention head, independent of dim / n_heads [head_dim]; RoPE needs it even.
    head_dim: int = 128
    # SwiGLU hidden width of the dense feed-forward layers (all of them in a dense model, the
    # mlp_only_layers of an MoE) [intermediate_size].
    ffn_hidden_dim: int = 12288
    # Epsilon of every RMSNorm, the q/k norms included [rms_norm_eps].
    norm_eps: float = 1e-6
    # RoPE base frequency [rope_theta, or rope_parameters.rope_theta].
    rope_theta: float = 1000000.0
    # Longest sequence the RoPE cache covers [max_position_embeddings].
    max_seq_len: int = 40960
    # Share the token embedding matrix with the output head [tie_word_embeddings].
    tie_embeddings: bool = False
    # Biases on the q/k/v/o projections [attention_bias]; off in every published Qwen3.
    attention_bias: bool = False
    # Std of the normal init; residual output projections use init_std / sqrt(2 * n_layers)
    # [initializer_range] (the project's init; transformers' uses init_std everywhere).
    init_std: float = 0.02
    # ---- Mixture of Experts (Qwen3-MoE); n_experts = 0 is the dense Qwen3 ----
    # Routed experts per MoE layer [num_experts]; 128 in Qwen3-30B-A3B and Qwen3-235B-A22B.
    n_experts: int = 0
    # Experts each token is sent to [num_experts_per_tok].
    top_k: int = 8
    # SwiGLU width of one expert [moe_intermediate_size].
    moe_hidden_dim: int = 768
    # Renormalise the k chosen router probabilities to sum to 1 [norm_topk_prob]. True in the published
    # Qwen3-MoE configs (transformers' class default is False). With top_k = 1 every weight becomes 1.
    norm_topk_prob: bool = True
    # Layer i (0-based) is sparse when (i + 1) is a multiple of this and i is not in mlp_only_layers
    # [decoder_sparse_step]; 1 = every layer.
    decoder_sparse_step: int = 1
    # Layers that keep a dense SwiGLU of ffn_hidden_dim in an MoE model [mlp_only_layers].
    mlp_only_layers: List[int] = field(default_factory=list)
    # Coefficient of Qwen3-MoE's load-balancing loss (pooled over the MoE layers; equals top_k when
    # perfectly balanced) added to the language-model loss [router_aux_loss_coef]; 0 = off.
    router_aux_loss_coef: float = 0.001
    # Multiply each expert's tokens with torch's grouped matmul where it applies (else one matmul per
    # expert); a speed choice, the result is the same.
    moe_grouped_mm: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` if the shapes or MoE options are inconsistent."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "ffn_hidden_dim", "max_seq_len"):
            require_positive(getattr(self, name), name)
        require_divisible(self.n_heads, self.num_kv_heads, "n_heads must be divisible by n_kv_heads")
        if self.head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise ValueError(f"model.norm_eps must be a positive number, got {self.norm_eps}")
        if self.n_experts < 0:
            raise ValueError(f"model.n_experts must be >= 0 (0: dense), got {self.n_experts}")
        if self.n_experts == 0:
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} must be between 1 and model.n_experts={self.n_experts}")
        require_positive(self.moe_hidden_dim, "moe_hidden_dim")
        require_positive(self.decoder_sparse_step, "decoder_sparse_step")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if outside:
            raise ValueError(f"model.mlp_only_layers {outside} are not layers of a {self.n_layers}-layer model")
        coef = self.router_aux_loss_coef
        if not (math.isfinite(coef) and coef >= 0):
            raise ValueError(f"model.router_aux_loss_coef must be a finite number >= 0, got {coef}")

    @property
    def num_kv_heads(self) -> int:
        """Resolved number of key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width of the dense layers (the name the project's size checks read)."""
        return self.ffn_hidden_dim

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a Mixture of Experts."""
        return any(self.is_sparse_layer(i) for i in range(self.n_layers))

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) is an MoE, by `Qwen3MoeDecoderLayer`'s rule."""
        return (self.n_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> list[int]:
        """Indices of the MoE layers."""
        return [i for i in range(self.n_layers) if self.is_sparse_layer(i)]


class Qwen3Attention(nn.Module):
    """Causal grouped-query self-attention with per-head RMSNorm of q and k before RoPE."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=bias)
        # One gain vector of head_dim shared by every head (transformers: "only on the head dim").
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.core_attention = CoreAttention(grouped=self.n_kv_heads != self.n_heads)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=bias)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_norm(self.wq(x).view(batch, seq_len, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seq_len, -1, self.head_dim))
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.core_attention(q, k, v, doc_ids)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def init_weights(self, std: float, residual_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init_linear_(linear, std)
        init_linear_(self.wo, residual_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class PooledBalance:
    """The routing statistics of one forward of a model, pooled over its MoE layers, for Qwen3-MoE's
    load-balancing loss (transformers' `load_balancing_loss_func`):

        loss = E * sum_e F_e * P_e,   F_e = sum_l c_le / (L T),   P_e = sum_l s_le / (L T)

    with c_le the assignments of layer l's T tokens x k choices to expert e and s_le the sum of its router
    probabilities for e. The loss is linear in each layer's s_l, with a coefficient (F) that depends on
    every layer's counts: each layer hands its s_l to `_PooledBalanceLoss`, whose backward reads F from
    this object once the whole forward has run (the backward always follows the forward it belongs to).
    A new pool is made per forward and captured by that forward's graph, so micro-batches never mix.

    Under pipeline parallelism a stage holds some of the layers: its pool starts from the sums of the
    earlier stages' layers (`carried`, which the previous stage passed on with the hidden states), so that
    the last stage's pool holds every layer after its forward, and the other stages' pools are completed
    with the whole model's sums (`complete`) when their backward begins (`_CarryBalanceOn`).
    """

    def __init__(self, carried: Optional[torch.Tensor] = None, layers: int = 0) -> None:
        self.counts: Optional[torch.Tensor] = None  # [E] assignments summed over the layers
        self.prob_sums: Optional[torch.Tensor] = None  # [E] router probabilities summed (detached)
        self.layers = layers  # the layers summed (under pp: the earlier stages' count from their start)
        self.tokens = 0
        if carried is not None:
            self.counts, self.prob_sums = carried.detach().float().clone().chunk(2)

    def add(self, counts: torch.Tensor, prob_sum: torch.Tensor, tokens: int) -> None:
        """Count one MoE layer's forward (not its activation-checkpointing recompute)."""
        counts, prob_sum = counts.detach().float(), prob_sum.detach().float()
        self.counts = counts if self.counts is None else self.counts + counts.to(self.counts.device)
        self.prob_sums = prob_sum if self.prob_sums is None else self.prob_sums + prob_sum.to(self.prob_sums.device)
        self.layers += 1
        self.tokens = tokens  # every layer routes the same tokens

    def sums(self, n_experts: int, device: torch.device) -> torch.Tensor:
        """[2E]: the assignment counts and the probability sums so far (zeros before any MoE layer)."""
        if self.counts is None or self.prob_sums is None:
            return torch.zeros(2 * n_experts, device=device)
        return torch.cat([self.counts, self.prob_sums]).to(device)

    def complete(self, whole: torch.Tensor, layers: int) -> None:
        """Replace the sums by those of the whole model's `layers` MoE layers (`sums` of the last stage)."""
        self.counts, self.prob_sums = whole.detach().float().clone().chunk(2)
        self.layers = layers

    def fractions(self) -> torch.Tensor:
        """F_e: assignments per routed row, pooled over the layers (sums to top_k)."""
        assert self.counts is not None
        return self.counts / (self.layers * self.tokens)

    def value(self) -> torch.Tensor:
        """The pooled loss E * sum_e F_e P_e (without its coefficient), as transformers computes it."""
        assert self.prob_sums is not None
        return self.counts.numel() * torch.sum(self.fractions() * self.prob_sums / (self.layers * self.tokens))


class _PooledBalanceLoss(torch.autograd.Function):
    """Forward: `value` (this layer's share, for logging). Backward: the gradient of the pooled loss with
    respect to this layer's probability sums, E * F_e / (L T), with F read from the finished pool."""

    @staticmethod
    def forward(ctx: Any, prob_sum: torch.Tensor, value: torch.Tensor, pool: PooledBalance) -> torch.Tensor:
        ctx.pool = pool
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        pool: PooledBalance = ctx.pool
        fractions = pool.fractions().to(grad.device)
        return grad * fractions.numel() * fractions / (pool.layers * pool.tokens), None, None


class _CarryBalanceOn(torch.autograd.Function):
    """The exit of a pipeline stage before the last: the hidden states pass unchanged, and a second output
    carries the pool's sums so far (the earlier stages' layers and this stage's) to the next stage.

    Backward: the gradient that comes back for the carried sums is not a gradient but the whole model's
    sums (the last stage's `_CarryBalanceEnd` sends them back as such); they complete this forward's pool
    and go on to the previous stage as the "gradient" of what it carried in. This node is where the hidden
    states' gradient enters the stage, and every layer's `_PooledBalanceLoss` lies behind the hidden states,
    so autograd runs it first: the pool is complete before any of them reads it (the zero-bubble schedules'
    input-gradient pass runs it as well, on the way to the stage's input)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, carried_in: Optional[torch.Tensor], pool: PooledBalance,
                n_experts: int, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.pool, ctx.layers, ctx.carried = pool, layers, carried_in is not None
        device = carried_in.device if carried_in is not None else h.device
        # the same storage, not an autograd view: a stage output must be detachable in place (the
        # zero-bubble schedules' input-gradient pass detaches it)
        return h.detach(), pool.sums(n_experts, device)

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor, whole: Optional[torch.Tensor]) -> tuple[Any, ...]:
        if whole is not None:
            ctx.pool.complete(whole, ctx.layers)
        return grad_h, whole if ctx.carried else None, None, None, None


class _CarryBalanceEnd(torch.autograd.Function):
    """On the last pipeline stage: the hidden states pass unchanged; the backward returns the pool's sums,
    complete after the forward (every MoE layer of the model), as the gradient of what the previous stage
    carried in, which sends them back through the stages (`_CarryBalanceOn`)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, carried_in: torch.Tensor, pool: PooledBalance,
                n_experts: int) -> torch.Tensor:
        ctx.pool, ctx.n_experts = pool, n_experts
        ctx.meta = (carried_in.device, carried_in.dtype)
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor) -> tuple[Any, ...]:
        device, dtype = ctx.meta
        return grad_h, ctx.pool.sums(ctx.n_experts, device).to(dtype), None, None


class Qwen3MoE(MoE):
    """The project's MoE layer with Qwen3-MoE's routing weights and load-balancing loss.

    Routing is the same as `MoE.route` (fp32 softmax over the router logits, top-k, optional
    renormalisation of the k weights): only `norm_topk_prob` with top_k = 1 differs, where Qwen3 gives
    the single expert weight 1 and the base layer would keep the probability, so it is set explicitly.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config.dim, config.moe_hidden_dim, config.n_experts, config.top_k,
                         aux_loss_coef=config.router_aux_loss_coef, grouped_mm=config.moe_grouped_mm)
        self.renormalize = config.norm_topk_prob
        # Set by `Qwen3.forward` for each forward (plain attribute: never in state dicts).
        self.balance_pool: Optional[PooledBalance] = None

    def balance_loss(self, counts: torch.Tensor, probs: torch.Tensor, tokens: int, *,
                     chosen: Optional[torch.Tensor] = None, seq_len: Optional[int] = None) -> torch.Tensor:
        """This layer's part of the pooled Qwen3-MoE loss; its forward value is the loss of this layer
        alone, E * sum_e (c_e / T)(s_e / T), which is what `moe/aux_loss` logs (averaged over layers).
        (Batch-wise: the per-sequence `chosen` and `seq_len` are not used.)"""
        del chosen, seq_len
        prob_sum = probs.sum(dim=0)
        counts = counts.detach().float()
        if self.sequence_group is not None and self.training:
            # context parallelism: the statistics of the whole sequences, as the single process counts them
            # (`_SumOverGroup` gives each rank's probabilities their share of the gradient)
            size = dist.get_world_size(self.sequence_group)
            summed = _SumOverGroup.apply(torch.cat([counts, prob_sum]), self.sequence_group)
            counts, prob_sum, tokens = summed[:self.n_experts].detach(), summed[self.n_experts:], tokens * size
        alone = self.n_experts * torch.sum(counts / tokens * prob_sum / tokens)
        pool = self.balance_pool
        if pool is None:  # used outside a Qwen3 forward: the layer is its own pool
            return alone
        if not _in_backward():  # a recompute runs the forward again: count it once
            pool.add(counts, prob_sum, tokens)
        return _PooledBalanceLoss.apply(prob_sum, alone.detach(), pool)


class Qwen3Block(nn.Module):
    """Pre-norm block ``x + attn(norm(x))`` then ``h + ffn(norm(h))``; the ffn is dense or an MoE."""

    def __init__(self, config: Qwen3Config, index: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Qwen3Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward: nn.Module = (Qwen3MoE(config) if config.is_sparse_layer(index)
                                        else FeedForward(config.dim, config.ffn_hidden_dim))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, std: float, residual_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, residual_std)
        self.feed_forward.init_weights(std, residual_std)


class Qwen3(CausalLM):
    """Qwen3 decoder returning logits ``[B, S, vocab_size]``.

    The model-level glue (embedding, RoPE table, final norm, head, document masking, stage-shaped
    forward) is the Llama's: set ``tok_embeddings`` / ``norm`` / ``output`` to None or delete entries of
    ``layers`` for a pipeline stage.

    Under pipeline parallelism with the pooled balance loss on, a stage passes the routing statistics of
    the layers up to its own to the next stage beside the hidden states, and the last stage sends the whole
    model's back as their gradient (`_CarryBalanceOn`, `_CarryBalanceEnd`): `pipeline_carried` and
    `pipeline_carry_out`, which the family's `carry_into_stage` / `carry_out_of_stage` set and read.
    """

    # The pooled routing statistics of the latest forward (MoE only; `PooledBalance.value()` is the
    # aux loss transformers reports for it; under pp, on the last stage, or on the others after the backward).
    last_balance: Optional[PooledBalance] = None
    # Under pipeline parallelism, set before each forward of a stage: what the previous stage passed on
    # beside the hidden states (() on the first stage; None outside a pipeline). Read once by the forward.
    pipeline_carried: Optional[tuple[torch.Tensor, ...]] = None
    # What the latest forward of a stage before the last passes on to the next stage.
    pipeline_carry_out: tuple[torch.Tensor, ...] = ()

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): Qwen3Block(config, i) for i in range(config.n_layers)})
        self.norm: Optional[nn.RMSNorm] = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the config, so kept out of checkpoints; on the meta device it holds no data until
        # init_weights recomputes it.
        self.register_buffer("rope_cache", self._compute_rope_cache(None), persistent=False)

    def _attention_dim(self) -> int:
        # n_heads x head_dim, not dim: the width of QK^T and attention x V (flops_per_token).
        return self.config.n_heads * self.config.head_dim

    def _compute_rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        cfg = self.config
        return compute_rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)

    def _apply(self, fn: Any, recurse: bool = True) -> Qwen3:
        super()._apply(fn, recurse)
        # Module.to(dtype) would also cast the RoPE table; bf16 keeps ~3 digits of cos/sin, so rebuild it.
        cache = self.rope_cache
        if cache.dtype != torch.float32 and not cache.is_meta:
            with torch.no_grad():
                self.rope_cache = self._compute_rope_cache(cache.device)
        return self

    def moe_layers(self) -> list[Qwen3MoE]:
        """The MoE layers this model (or stage) holds, in layer order."""
        return [m for m in self.modules() if isinstance(m, Qwen3MoE)]

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids ``[B, S]`` (or hidden states ``[B, S, dim]`` without ``tok_embeddings``). ``doc_ids``
        (``[B, S]``, `trainer.models.documents`): attention within documents, positions restarting at each."""
        doc_ids = self.pipeline_doc_ids if doc_ids is None else doc_ids
        carried, self.pipeline_carried = self.pipeline_carried, None
        cfg = self.config
        # a pipeline stage of a model whose balance loss pools over the layers of every stage
        pooled_stage = carried is not None and cfg.is_moe and cfg.router_aux_loss_coef > 0
        carried_in = carried[0] if pooled_stage and carried else None
        # this forward's routing statistics (Qwen3-MoE's pooled balance loss); on a later pipeline stage,
        # from the sums of the earlier stages' MoE layers on
        pool = PooledBalance()
        if carried_in is not None:
            first = min(int(key) for key in self.layers)
            pool = PooledBalance(carried_in, layers=sum(1 for i in cfg.sparse_layers if i < first))
        for moe in self.moe_layers():
            moe.balance_pool = pool
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
        else:
            rope_cache = self.rope_cache[self.positions(local_len, self.rope_cache.device)]
        for layer in self.layers.values():
            h = layer(h, rope_cache, doc_ids)
        self.last_balance = pool
        if pooled_stage:
            if self.output is None:  # a stage before the last: carry the sums on, get the whole model's back
                h, sums = _CarryBalanceOn.apply(h, carried_in, pool, cfg.n_experts, len(cfg.sparse_layers))
                self.pipeline_carry_out = (sums,)
            elif carried_in is not None:  # the last stage: its pool holds every layer; send the sums back
                h = _CarryBalanceEnd.apply(h, carried_in, pool, cfg.n_experts)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize every parameter and the RoPE cache from torch's global RNG (fixed draw order)."""
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
