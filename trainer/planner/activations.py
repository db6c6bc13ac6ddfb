"""Activation memory: what the forward keeps for the backward, per layer, per micro-batch in flight.

Reference: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(Table 2). For a GPT layer with materialized attention and dropout, with 16-bit activations and 1-byte
dropout masks, sequence length s, micro-batch b, hidden size h, a heads, tensor-parallel size t:

    no parallelism                          sbh (34 + 5as/h)
    tensor parallel                         sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel              sbh/t (34 + 5as/h)
    selective recompute, tensor parallel    sbh (10 + 24/t)
    selective recompute, tensor + sequence  34 sbh/t
    full recompute                          2 sbh          (the layer's input only)

`korthikanti_layer_bytes` is that table. The planner itself counts a list of saved tensors per block
(`saved_tensors`): for GPT with `attn_impl=materialized` the list is Korthikanti's term by term (so it
reproduces the table), and for the Llama blocks it is what their forward saves in this code base, measured
with `torch.autograd.graph.saved_tensors_hooks` (tests/test_planner.py checks the sum against a run).
With e = bytes of the compute dtype, r = bytes of the residual stream (`Layout.residual_bytes`: e in fp32
and bf16_true; 4 under bf16/fp16 autocast over fp32 weights, which leaves the embedding, the residual adds
and the norms in fp32), k = projections reading one norm output (1; under autocast each casts it itself):

    RMSNorm (x2)            CUDA (fused kernel): input (r), rstd (fp32 per token)        split by SP
                            CPU (composite, in fp32): input (upcast to fp32), x * rstd (fp32), rstd
    norm output (x2)        input of wq/wk/wv (k = 3) and of w1/w3 (k = 2), e each      not split: TP gathers it
    fused SDPA              q, k, v, output (e), logsumexp (fp32 per head and token)    split by TP
    SwiGLU                  w1 x, w3 x, silu(w1 x), their product (e, width ffn_dim)    split by TP
    autocast weight copies  each matmul's e-byte copy of its fp32 weight                 as the weights

    on CUDA: e sb (4h + 2 h_kv + 4 f) + r sb 2h + 4 abs + 8 sb bytes per layer without parallelism (no s^2
    term: SDPA never materializes the scores); the CPU adds x * rstd, 4 sb 2h; bf16 autocast over fp32
    weights adds 3 e sb h (the extra casts of the norm outputs) and e x (the block's matmul weights).
    Measured on an H200 (Llama 3 8B width, s = 8192, bf16 autocast): 2,148,598,784 bytes per block
    against 2,148,597,760 counted here; selective 907,019,264 against 907,018,240; full the fp32 block
    input, 134,217,728 (benchmarks/gpu_memory.py, issue 27).

Under autocast, a checkpointed block's weight casts are not saved (selective recomputes them, full keeps
only the block input) but autocast's cache holds them until the forward's autocast region ends: a
transient of the forward (`cast_cache`), absent when the blocks are compiled (`trainer.compile`: each
Inductor graph casts and frees them itself; measured on an H200, 29 layers with selective AC peaked at 120.5
GB, 121.99 planned, where counting the cache gave 130.8). The head keeps its input (e), its weight's cast, and the fp32
log-probabilities of the loss (`trainer.loss.cross_entropy_loss` upcasts the logits); the training step
holds the logits themselves until the backward is done (`held_logits`), and the loss's backward makes two
fp32 tensors of the logits' size (`loss_backward`). Compiled (`trainer.compile=true`), the loss keeps 8
bytes a token (each row's max and log-sum-exp) and its backward makes one gradient in the logits' dtype.
How these combine into a peak: trainer/planner/phases.py.

On the CPU, torch's dropout keeps its masks in the activation dtype (not 1-byte bools) and SDPA with
dropout takes its math path (the scores exist): the estimate follows the device (`device_type`), and
measures within 0.3% of the tiny Llama and a small GPT (benchmarks/planner_accuracy.py, tests).

Differences from Korthikanti's accounting for Llama: no dropout masks, SwiGLU's four ffn-wide tensors
instead of GeLU's two 4h-wide ones, grouped-query k/v, RMSNorm's saved normalized input on the CPU, and
under tensor parallelism torch's DTensor keeps the all-gathered input of the column-parallel projections
(Megatron-LM gathers it again in the backward instead). Korthikanti counts 16-bit activations throughout
(Megatron's fp16 weights): this code base's autocast over fp32 weights adds the fp32 residual stream,
one input cast per projection and the weight casts. Not modelled under autocast: GPT's materialized
softmax (autocast runs it in fp32), the MoE router's and experts' casts beyond their weights, Qwen3's q/k
norms in fp32.

Policies (`activation_checkpointing=`): `attention` keeps everything but the attention core's internals
(Korthikanti's selective recompute); `selective` keeps the block input and the outputs of matmuls and fused
attention (which include, under tensor parallelism, the partial sums before the reduce-scatter); `full` and
`every_n` keep the block input of checkpointed blocks; `offload` keeps them all in host memory. Recomputing
a block materializes its full activations again, one block at a time: `recompute_transient`.

In-flight micro-batches (first pipeline rank, M micro-batches per step, P stages, v virtual stages):
gpipe M; 1F1B min(M, P - r) on rank r (P on the first); interleaved 1F1B and zero-bubble
P + (P - 1)/v on the first rank (Narayanan et al. 2021; Korthikanti's factor 1 + (P-1)/(P v)); ZBV P and
DualPipeV P + 1/2 once M >= 2P (fewer at small M), from torch's order of operations played out
(trainer/planner/pipeline_sim.py; the papers: Qi et al. 2024 section 6, DeepSeek-V3 report table 2). Without
pipelining gradient accumulation runs one micro-batch at a time. A pipeline stage also keeps, per
micro-batch in flight, the input it received and the output it sent (full hidden states, s x b x h).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainer.planner.layout import V_SCHEDULES, Layout
from trainer.planner.memory import RankPart, rank_part
from trainer.planner.params import ModelInventory, ParamSpec
from trainer.planner.pipeline_sim import v_schedule_in_flight

# What a saved tensor's size divides by: always by t (its heads or width are split), by t only with
# sequence parallelism (norms, residual stream, dropout masks), or never (replicated on the tp ranks).
TP, SP, FULL = "tp", "sp", "full"
KEEP_ALL = frozenset({"none", "attention"})


@dataclass(frozen=True)
class Saved:
    """One tensor saved for the backward, per layer (or per stage end) and per micro-batch."""

    name: str
    elements: float
    bytes_per_element: float
    split: str
    kept_by: frozenset[str] = KEEP_ALL
    # Kept by full/every_n checkpointing (the block input).
    block_input: bool = False
    # Exists only with tensor parallelism and sequence parallelism (a reduce-scatter output).
    only_tp_sp: bool = False

    def bytes(self, tp: int, sequence_parallel: bool) -> float:
        size = self.elements * self.bytes_per_element
        if self.split == TP or (self.split == SP and sequence_parallel):
            size /= tp
        return size


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one GPT layer, Korthikanti et al. 2022, Table 2 (recompute: none | selective | full)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    if recompute == "selective":
        return 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def rms_norm_saved(name: str, elements: float, tokens: float, r: int, fused: bool, kept_by: frozenset[str],
                   block_input: bool = False, split: str = SP) -> list[Saved]:
    """What one RMSNorm over `elements` values of `tokens` tokens keeps, its input being `r` bytes wide.

    CUDA runs torch's fused kernel (`aten._fused_rms_norm`), which keeps its input and the fp32 inverse
    RMS; the CPU runs the composite, which computes in fp32 and keeps x (an fp32 upcast of it when the
    input is narrower), x * rstd (fp32) and rstd. A block's first norm reads the block input: what full
    and selective checkpointing keep instead of everything (`block_input`). `split`: how tensor parallelism
    divides it (a norm of the residual stream is sequence-parallel; one of a latent every rank computes
    whole, FULL).
    """
    rstd = Saved(f"{name} rstd", tokens, 4, split)
    if fused:
        return [Saved(f"{name} input", elements, r, split, kept_by, block_input=block_input), rstd]
    if r >= 4:
        saved = [Saved(f"{name} input", elements, r, split, kept_by, block_input=block_input)]
    else:
        saved = [Saved(f"{name} input upcast to fp32", elements, 4, split, kept_by - {"selective"})]
        if block_input:  # what checkpointing keeps: the block input itself
            saved.append(Saved(f"{name} input (block input)", elements, r, split, frozenset({"selective"}),
                               block_input=True))
    return saved + [Saved(f"{name} x*rstd", elements, 4, split), rstd]


def saved_tensors(inv: ModelInventory, s: int, b: int, e: int, mask_bytes: int = 1,
                  materialized: bool | None = None, score_len: int | None = None,
                  all_to_all: bool = False, *, residual_bytes: int | None = None, casts: bool = False,
                  fused_norm: bool = False, cast_weights: float = 0.0) -> list[Saved]:
    """The tensors one transformer block saves for the backward (per micro-batch of b sequences of s).

    `mask_bytes`: bytes per element of a dropout mask: 1 on CUDA (bool masks, Korthikanti's assumption);
    torch's CPU dropout keeps its mask in the activation dtype. `materialized` (default: the model's
    `attn_impl`): whether the attention scores exist, as in SDPA's math path, which the CPU takes for
    attention with dropout. `score_len`: keys per query in those scores (default s; under all_to_all
    context parallelism a rank's s/cp tokens' worth of heads see the whole sequence). `all_to_all`: fused
    attention's own output is then a tensor of its own (the all-to-all back to token shards makes another),
    kept beside the output projection's input.

    Number formats: `e` bytes for what the matmuls and attention produce (the compute dtype),
    `residual_bytes` (default e) for the residual stream and what the norms read: fp32 under bf16/fp16
    autocast over fp32 weights, where embeddings, residual adds and norms stay in fp32. With `casts`
    (autocast over wider weights) each matmul casts its fp32 input itself, so the projections reading one
    norm output each keep their own e-byte copy (wq, wk, wv: 3; w1, w3: 2), and each keeps autocast's
    e-byte copy of its weight: `cast_weights` elements per block (this rank's matmul weights), kept by
    `none` and `attention` only (`selective` recomputes the casts, `full` keeps the block input alone).
    `fused_norm`: CUDA's fused RMSNorm (see `rms_norm_saved`).
    """
    r = e if residual_bytes is None else residual_bytes
    weight_copies = [Saved("autocast copies of the matmul weights", cast_weights, e, FULL)] if casts else []
    if materialized is None:
        materialized = inv.attn_impl == "materialized"
    h, f, a = inv.dim, inv.ffn_dim, inv.n_heads
    sb = s * b
    selective = frozenset({"none", "attention", "selective"})
    if inv.family == "gpt":
        mask = 1 if inv.dropout > 0 else 0  # no dropout, no masks (and the softmax output feeds x V itself)
        asb = a * s * (s if score_len is None else score_len) * b
        if materialized:  # Korthikanti's attention terms one by one
            attention = [
                Saved("q, k (for QK^T)", 2 * sb * h, e, TP),
                Saved("softmax output", asb, e, TP, frozenset({"none"})),
                Saved("attention dropout mask", asb * mask, mask_bytes, TP, frozenset({"none"})),
                Saved("attention dropout output", asb * mask, e, TP, frozenset({"none"})),
                Saved("v (for attention x V)", sb * h, e, TP),
                Saved("output projection input", sb * h, e, TP),
            ]
            # op-level selective: the attention matmuls' outputs too
            selective_attention = [Saved("QK^T output", asb, e, TP, frozenset({"selective"})),
                                   Saved("attention x V output", sb * h, e, TP, frozenset({"selective"}))]
        else:  # fused SDPA: q, k, v, output and logsumexp instead of the scores
            attention = [Saved("q, k, v, attention output", 4 * sb * h, e, TP, selective),
                         Saved("attention logsumexp", a * sb, 4, TP, selective)]
            selective_attention = []
            if all_to_all:
                attention.append(Saved("attention output before the all-to-all", sb * h, e, TP,
                                       frozenset({"none", "selective"})))
        return [
            Saved("layernorm 1 input", sb * h, r, SP, selective, block_input=True),
            Saved("qkv projection input", sb * h, e, SP),
            *attention,
            Saved("attention dropout mask (residual)", sb * h * mask, mask_bytes, SP),
            Saved("layernorm 2 input", sb * h, r, SP),
            Saved("fc1 input", sb * h, e, SP),
            Saved("gelu input", sb * f, e, TP),
            Saved("fc2 input", sb * f, e, TP),
            Saved("mlp dropout mask", sb * h * mask, mask_bytes, SP),
            # op-level selective: the outputs of the matmuls (kept instead of what they feed)
            Saved("qkv matmul output", 3 * sb * h, e, TP, frozenset({"selective"})),
            *selective_attention,
            Saved("output projection output", sb * h, e, FULL, frozenset({"selective"})),
            Saved("fc1 output", sb * f, e, TP, frozenset({"selective"})),
            Saved("fc2 output", sb * h, e, FULL, frozenset({"selective"})),
            *weight_copies,
        ]
    if inv.kv_lora_rank:
        attention = mla_saved_tensors(inv, s, b, e, r, casts=casts, fused_norm=fused_norm,
                                      materialized=materialized, score_len=score_len)
    else:
        attention = llama_attention_saved(inv, s, b, e, r, casts=casts, fused_norm=fused_norm)
    # under autocast each ffn projection casts the (fp32) norm output itself: one copy per reader
    ffn_readers = 2 if casts else 1
    each = " (each projection's own cast)" if casts else ""
    exchanged = [Saved("attention output before the all-to-all", sb * inv.n_heads * inv.value_dim, e, TP,
                       frozenset({"none", "selective"}))]
    return [*(exchanged if all_to_all else []), *attention, *(moe_saved_tensors(inv, s, b, e) if inv.n_experts else []),
        *rms_norm_saved("ffn_norm", sb * h, sb, r, fused_norm, KEEP_ALL),
        Saved(f"w1/w3 input (gathered norm output){each}", ffn_readers * sb * h, e, FULL),
        Saved("w1 x, w3 x", 2 * sb * f, e, TP, selective),
        Saved("silu(w1 x), product (w2 input)", 2 * sb * f, e, TP),
        *weight_copies,
        # op-level selective: matmul outputs kept in place of what is recomputed from them
        Saved("wo, w2 outputs (partial sums under TP)", 2 * sb * h, e, FULL, frozenset({"selective"})),
        Saved("wo, w2 reduce-scatter outputs", 2 * sb * h, e, SP, frozenset({"selective"}), only_tp_sp=True),
    ]


def llama_attention_saved(inv: ModelInventory, s: int, b: int, e: int, r: int, *, casts: bool,
                          fused_norm: bool) -> list[Saved]:
    """The attention half of a Llama (Qwen3) block: its norm, the q/k/v projections' input, q and k after
    RoPE, v, the attention output and log-sum-exp (fused SDPA), Qwen3's q/k norms; with op-level selective
    the projections' outputs."""
    sb, h, a = s * b, inv.dim, inv.n_heads
    selective = frozenset({"none", "attention", "selective"})
    q, kv = inv.attention_dim, inv.kv_dim
    # Qwen3's per-head q/k RMSNorm: its input (the wq/wk output), x*rstd and rstd (one per head and token)
    qk_norm = [Saved("q_norm/k_norm input (wq/wk outputs)", sb * (q + kv), e, TP),
               Saved("q_norm/k_norm x*rstd", sb * (q + kv), e, TP),
               Saved("q_norm/k_norm rstd", sb * (a + inv.n_kv_heads), 4, TP)]
    # under autocast each projection casts the (fp32) norm output itself: one copy per reader
    readers = 3 if casts else 1
    each = " (each projection's own cast)" if casts else ""
    return [*(qk_norm if inv.qk_norm else []),
        *rms_norm_saved("attention_norm", sb * h, sb, r, fused_norm, selective, block_input=True),
        Saved(f"wq/wk/wv input (gathered norm output){each}", readers * sb * h, e, FULL),
        Saved("q after RoPE", sb * q, e, TP),
        Saved("k, v after RoPE", 2 * sb * kv, e, TP),
        Saved("attention output (wo input)", sb * q, e, TP, selective),
        Saved("attention logsumexp", a * sb, 4, TP, frozenset({"none", "selective"})),
        Saved("wq/wk/wv outputs (before RoPE)", sb * (q + 2 * kv), e, TP, frozenset({"selective"})),
    ]


def mla_saved_tensors(inv: ModelInventory, s: int, b: int, e: int, r: int, *, casts: bool, fused_norm: bool,
                      materialized: bool, score_len: int | None = None) -> list[Saved]:
    """The attention half of a DeepSeek-V3 block, multi-head latent attention (trainer/models/deepseek_v3/
    mla.py): the block's norm, the input of the two down-projections (wq_a, wkv_a), the query latent's norm
    and the kv latent's norm with what they keep (the kv norm reads a view of the wkv_a output, whose
    storage holds the rotated key part too), the up-projections' inputs, then the attention itself:
    fused (q, k, the storage of v, which is the wkv_b output, the output and the log-sum-exp) or, where
    SDPA takes its math path (the CPU when the value width differs from the query/key width), q and k,
    the softmax output, a contiguous copy of v and the output. With op-level selective every matmul's
    output (the bmm's of the math path too) instead."""
    sb, h, a = s * b, inv.dim, inv.n_heads
    dq, dv, dr = inv.head_dim, inv.value_dim, inv.rope_head_dim
    ql, kvr = inv.q_lora_rank, inv.kv_lora_rank
    asb = a * s * (s if score_len is None else score_len) * b
    kept = frozenset({"none", "attention", "selective"})
    readers = 2 if casts else 1  # wq_a (or wq) and wkv_a each cast the norm output under autocast
    each = " (each projection's own cast)" if casts else ""
    saved = [*rms_norm_saved("attention_norm", sb * h, sb, r, fused_norm, kept, block_input=True),
             Saved(f"wq_a/wkv_a input (norm output){each}", readers * sb * h, e, FULL)]
    if ql:
        # the latents every head reads: whole on every tp rank (`DeepSeekV3Family.block_split`)
        saved += [*rms_norm_saved("q_norm", sb * ql, sb, e, fused_norm, KEEP_ALL, split=FULL),
                  Saved("wq_b input (q_norm output)", sb * ql, e, FULL),
                  Saved("wq_a output", sb * ql, e, FULL, frozenset({"selective"}))]
    kv_norm = rms_norm_saved("kv_norm", sb * kvr, sb, e, fused_norm, KEEP_ALL, split=FULL)
    if fused_norm or e >= 4:  # it keeps its input, a view of the wkv_a output: that whole storage
        kv_norm[0] = Saved("kv_norm input (the wkv_a output, the rotated key part too)", sb * (kvr + dr), e, FULL)
    saved += [*kv_norm, Saved("wkv_b input (kv_norm output)", sb * kvr, e, FULL),
              Saved("wkv_a output", sb * (kvr + dr), e, FULL, frozenset({"selective"})),
              Saved("wq_b (or wq), wkv_b outputs", sb * a * (2 * dq - dr + dv), e, TP, frozenset({"selective"}))]
    if materialized:
        saved += [Saved("q, k (for QK^T)", 2 * sb * a * dq, e, TP),
                  Saved("softmax output", asb, e, TP, frozenset({"none"})),
                  Saved("v (a contiguous copy, for attention x V)", sb * a * dv, e, TP, frozenset({"none"})),
                  Saved("v's storage (the wkv_b output: the attention module's input)", sb * a * (dq - dr + dv), e,
                        TP, frozenset({"attention"})),
                  Saved("QK^T output", asb, e, TP, frozenset({"selective"})),
                  Saved("attention output (wo input)", sb * a * dv, e, TP, kept)]
    else:
        saved += [Saved("q, k after RoPE", 2 * sb * a * dq, e, TP),
                  Saved("v's storage (the wkv_b output)", sb * a * (dq - dr + dv), e, TP),
                  Saved("attention output (wo input)", sb * a * dv, e, TP, kept),
                  Saved("attention logsumexp", a * sb, 4, TP, frozenset({"none", "selective"}))]
    return saved


def head_saved_tensors(inv: ModelInventory, s: int, b: int, e: int, loss_parallel: bool, *,
                       residual_bytes: int | None = None, fused_norm: bool = False,
                       cast_weights: float = 0.0, compiled_loss: bool = False) -> list[Saved]:
    """What the last stage keeps beyond its blocks: final norm, output head input, autocast's copy of the
    head's weight (`cast_weights` elements, under autocast over wider weights), fp32 log-probabilities
    (the eager loss runs on fp32 logits: `trainer.loss.cross_entropy_loss`; its log-softmax keeps its
    output), or with `compiled_loss` (Inductor's, on logits not sharded on the vocabulary) each token's max
    and log-sum-exp. The logits themselves are not saved by anything: the training step holds them
    (`held_logits`)."""
    sb, h = s * b, inv.dim
    r = e if residual_bytes is None else residual_bytes
    if inv.family == "gpt":  # LayerNorm keeps its input (and per-token mean and rstd)
        norm = [Saved("final norm input", sb * h, r, SP)]
    else:  # RMSNorm (Llama, DeepSeek-V3)
        norm = rms_norm_saved("final norm", sb * h, sb, r, fused_norm, KEEP_ALL)
    copy = [Saved("autocast copy of the output head's weight", cast_weights, e, FULL)] if cast_weights else []
    return norm + [
        Saved("output head input", sb * h, e, FULL if inv.family != "gpt" else SP),
        *copy,
        Saved("row max and log-sum-exp (fp32)", 2 * sb, 4, FULL) if compiled_loss else
        Saved("log-softmax (fp32)", sb * inv.vocab_size, 4, TP if loss_parallel else FULL),
    ]


def block_inventory(inv: ModelInventory, group: int) -> ModelInventory:
    """`inv` as the blocks of its `group`-th kind see it (`ModelInventory.layer_group_ffn`): their
    feed-forward width and whether they route to experts."""
    if not inv.layer_group_ffn:
        return inv
    ffn_dim, routed = inv.layer_group_ffn[group]
    return replace(inv, ffn_dim=ffn_dim, n_experts=inv.n_experts if routed else 0)


def moe_saved_tensors(inv: ModelInventory, s: int, b: int, e: int) -> list[Saved]:
    """What an MoE layer (trainer/models/moe.py) keeps beyond a SwiGLU of width top_k x expert + shared:
    the tokens gathered for the experts, the experts' outputs and their weighted sum (top_k rows per token
    each), the router's fp32 logits and probabilities, and the routing's indices and weights. Op-level
    selective keeps the matmul outputs instead (the grouped matmuls' too): the SwiGLU terms count the gate
    and up projections' and one w2 output per token; the routed experts' w2 gives top_k rows per token (plus
    the shared expert's one), and the router's matmul its fp32 logits."""
    tokens, k = s * b, inv.top_k
    selective = frozenset({"selective"})
    expert_specs = [p for _, specs in (inv.layer_groups or ((0, inv.layer),)) for p in specs if p.expert]
    expert_width = expert_specs[0].numel // (expert_specs[0].shape[0] * inv.dim)
    shared = inv.ffn_dim > k * expert_width  # a shared expert: a dense SwiGLU beside the routed ones
    return [Saved("tokens dispatched to the experts, their outputs and weighted outputs", 3 * tokens * k * inv.dim,
                  e, FULL),
            Saved("router logits and probabilities (fp32)", 2 * tokens * inv.n_experts, 4, FULL),
            Saved("routing: chosen experts and their order (int64), combine weights (fp32)", tokens * k * 3,
                  8, FULL),
            Saved("routed (and shared) w2 outputs beyond one per token", (k + shared - 1) * tokens * inv.dim, e,
                  FULL, selective),
            Saved("router matmul output (fp32 logits)", tokens * inv.n_experts, 4, FULL, selective)]


def mtp_saved_tensors(inv: ModelInventory, s: int, b: int, e: int, r: int, *, fused_norm: bool) -> list[Saved]:
    """What one multi-token-prediction depth keeps beyond its block (trainer/models/deepseek_v3/model.py
    `MTPModule` and the loss the model computes with it): the two input norms, the concatenation eh_proj
    reads, the final norm, the output head's input and the fp32 log-probabilities of its loss."""
    sb, h = s * b, inv.dim
    return [*rms_norm_saved("MTP enorm", sb * h, sb, r, fused_norm, KEEP_ALL),
            *rms_norm_saved("MTP hnorm", sb * h, sb, r, fused_norm, KEEP_ALL),
            Saved("MTP eh_proj input (both norms' outputs)", 2 * sb * h, e, FULL),
            *rms_norm_saved("MTP final norm", sb * h, sb, r, fused_norm, KEEP_ALL),
            Saved("MTP output head input", sb * h, e, FULL),
            Saved("MTP log-softmax (fp32)", sb * inv.vocab_size, 4, FULL)]


def embedding_saved_tensors(inv: ModelInventory, s: int, b: int, mask_bytes: int = 1) -> list[Saved]:
    """What the first stage keeps beyond its blocks: the embedding dropout mask (GPT with dropout)."""
    if inv.family == "gpt" and inv.dropout > 0:
        return [Saved("embedding dropout mask", s * b * inv.dim, mask_bytes, SP)]
    return []


def layer_bytes(tensors: list[Saved], policy: str, tp: int, sequence_parallel: bool) -> float:
    """Bytes one layer keeps under a checkpointing policy (none, attention, selective, full)."""
    total = 0.0
    for tensor in tensors:
        if tensor.only_tp_sp and not (tp > 1 and sequence_parallel):
            continue
        kept = tensor.block_input if policy == "full" else policy in tensor.kept_by
        if kept:
            total += tensor.bytes(tp, sequence_parallel)
    return total


def in_flight_microbatches(layout: Layout, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of all its layers."""
    m, p, v = layout.num_microbatches, layout.pp, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "1f1b":
        return float(min(m, p - pp_rank))
    if layout.schedule in V_SCHEDULES:
        # played out on torch's own order of operations (trainer/planner/pipeline_sim.py): ZB-V holds
        # 1F1B's P (Qi et al. 2024, section 6), DualPipeV P + 1/2 (2P + 1 chunks, DeepSeek-V3 report table 2)
        return v_schedule_in_flight(layout.schedule, p, m, pp_rank)
    # looped schedules: (v-1) p + 2 (p - 1 - r) warm-up forward chunks, each 1/v of the rank's layers
    chunks = (v - 1) * p + 2 * (p - 1 - pp_rank) + 1
    return min(float(m), chunks / v)


def checkpointed_layers(layout: Layout, inv: ModelInventory, pp_rank: int) -> int:
    """Blocks of this rank that every_n/full checkpoint (every_n: global layers n-1, 2n-1, ...)."""
    part = rank_part(inv, layout, pp_rank)
    if layout.checkpointing == "full":
        return part.layers
    if layout.checkpointing != "every_n":
        return 0
    from trainer.planner.memory import stage_layers

    counts = stage_layers(inv, layout)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    stages = layout.stages_of_rank(pp_rank)
    n = max(1, layout.checkpoint_every_n)
    return sum(1 for st in stages for i in range(starts[st], starts[st] + counts[st]) if (i + 1) % n == 0)


@dataclass
class ActivationEstimate:
    """Activation memory of one rank (bytes) and how it was obtained. `device` is what the forward saves
    for the backward (every in-flight micro-batch); the other figures are what exists beside it at the
    phases of a step (trainer/planner/phases.py)."""

    per_layer_none: float  # one layer, one micro-batch, nothing recomputed
    per_layer_kept: float  # one layer, one micro-batch, under the policy
    layers: int
    checkpointed: int
    in_flight: float
    blocks: float  # all layers x in-flight micro-batches
    first_stage: float
    last_stage: float
    boundaries: float  # pipeline stage inputs received and outputs sent, kept for their backward
    device: float  # held in device memory
    host: float  # held in host memory (activation offload)
    recompute_transient: float  # one block's activations rebuilt during its backward
    notes: list[str] = field(default_factory=list)
    position_tables: float = 0.0  # under context parallelism: RoPE rows of the rank's global positions
    head_in_flight: float = 0.0  # micro-batches whose head activations the last stage holds (0 elsewhere)
    log_probs: float = 0.0  # what one micro-batch's loss saves (fp32 log-probabilities; in `last_stage`)
    held_logits: float = 0.0  # logits the training step holds until their backward ends (compute dtype)
    loss_backward: float = 0.0  # the loss's backward: its gradients (eager: fp32 w.r.t. log-probabilities and logits)
    cast_cache: float = 0.0  # autocast's cache of weight casts during the forward that nothing saves
    gradient_working_set: float = 0.0  # gradients one block's backward holds at once beside what it saved
    block_cast_bytes: float = 0.0  # autocast's copy of one block's matmul weights (0 without casts)


def matmul_weight_elements(specs: tuple[ParamSpec, ...] | list[ParamSpec], layout: Layout) -> tuple[float, float]:
    """(all, the largest) elements of the matmul weights among `specs` one rank holds for its forward:
    tensor-parallel shards, 1/ep of the routed experts."""
    sizes = []
    for spec in specs:
        if spec.matmul:
            numel = 1
            for size in spec.local_shape(layout.tp):
                numel *= size
            sizes.append(numel / (layout.ep if spec.expert else 1))
    return float(sum(sizes)), float(max(sizes, default=0.0))


def estimate_activations(inv: ModelInventory, layout: Layout, pp_rank: int,
                         device_type: str = "cuda") -> ActivationEstimate:
    """Activation memory of pipeline rank `pp_rank` (every rank without pipelining).

    Under context parallelism a rank holds s / cp tokens of each sequence, so every per-token term is
    divided by cp. Ring attention keeps q, k, v, the output and the log-sum-exp of its own tokens and
    never the scores (its blocks are computed and dropped); all_to_all runs the model's attention on
    n_heads / cp heads of the whole sequence, so materialized scores are a / cp x s x s.

    Number formats follow the layout (`Layout.residual_bytes`, `Layout.casts_weights`): under bf16/fp16
    autocast over fp32 weights the residual stream and the norms are fp32, each projection keeps its own
    cast of its input, and every matmul keeps autocast's copy of its weight (module docstring).
    """
    s, b, e, t, sp = layout.local_seq_len, layout.micro_batch_size, layout.compute_bytes, layout.tp, layout.sequence_parallel
    sp = sp and t > 1
    r, casts = layout.residual_bytes, layout.casts_weights
    fused_norm = device_type == "cuda"  # torch's fused RMSNorm kernel (the CPU runs the composite)
    mask_bytes = 1 if device_type == "cuda" else e
    materialized = inv.attn_impl == "materialized" or (inv.dropout > 0 and device_type == "cpu")
    if inv.kv_lora_rank and device_type == "cpu" and inv.value_dim != inv.head_dim:
        materialized = True  # the CPU's fused SDPA kernel needs one width for q, k and v: the math path
    if layout.cp > 1 and layout.cp_method == "ring":
        materialized = False
    a2a = layout.cp > 1 and layout.cp_method == "all_to_all"
    block_weights, largest_weight = matmul_weight_elements(inv.layer, layout)
    # one list of saved tensors per kind of block (DeepSeek-V3: dense first blocks, then MoE ones), and
    # the per-layer figures averaged over the layers
    def block_tensors(kind: ModelInventory) -> list[Saved]:
        return saved_tensors(kind, s, b, e, mask_bytes, materialized, score_len=layout.seq_len,
                             all_to_all=a2a and not materialized, residual_bytes=r, casts=casts,
                             fused_norm=fused_norm, cast_weights=block_weights)

    groups = [(count, block_tensors(block_inventory(inv, group))) for group, (count, _) in enumerate(inv.blocks())]

    def layer_average(kept_by: str) -> float:
        return sum(count * layer_bytes(tensors, kept_by, t, sp) for count, tensors in groups) / inv.n_layers

    policy = layout.checkpointing
    none = layer_average("none")
    part: RankPart = rank_part(inv, layout, pp_rank)
    in_flight = in_flight_microbatches(layout, pp_rank)
    checkpointed = checkpointed_layers(layout, inv, pp_rank)
    if policy in ("full", "every_n"):
        kept = layer_average("full")
        per_step_layers = checkpointed * kept + (part.layers - checkpointed) * none
        per_layer = per_step_layers / max(part.layers, 1)
    elif policy in ("attention", "selective"):
        per_layer = layer_average(policy)
    else:
        per_layer = none
    blocks = per_layer * part.layers * in_flight
    first = 0.0
    if part.first:
        first = in_flight * sum(x.bytes(t, sp) for x in embedding_saved_tensors(inv, s, b, mask_bytes))
    positions = 0.0
    if layout.cp > 1 and inv.family in ("llama", "deepseek_v3"):
        # each stage's forward gathers the RoPE rows of its tokens' global positions (fp32 cos and sin; MLA
        # rotates its rope_head_dim channels only)
        rotated = inv.rope_head_dim if inv.family == "deepseek_v3" else inv.head_dim
        positions = in_flight * len(part.stage_layers) * s * 2 * rotated * 4
    head_in_flight = float(layout.num_microbatches) if (layout.pp > 1 and layout.schedule == "gpipe") else 1.0
    last = log_probs = held_logits = loss_backward = 0.0
    if part.last:
        head_specs = [p for p in inv.head if p.matmul]
        if inv.tied_head is not None:  # the output head multiplies with the embedding's weight
            head_specs.append(inv.tied_head)
        head_cast = matmul_weight_elements(head_specs, layout)[0] if casts else 0.0
        vocab_sharded = layout.loss_parallel and t > 1
        fused_loss = layout.compiled and not vocab_sharded
        last = head_in_flight * sum(x.bytes(t, sp) for x in head_saved_tensors(
            inv, s, b, e, layout.loss_parallel, residual_bytes=r, fused_norm=fused_norm, cast_weights=head_cast,
            compiled_loss=fused_loss))
        # DeepSeek-V3's multi-token prediction: each depth's module runs outside the checkpointed blocks and
        # computes its own loss in the forward, so it keeps everything its block saves, plus its norms, its
        # projection's input and the fp32 log-probabilities of its head
        # (an MTP block is an MoE block: `inv`'s own ffn_dim and n_experts)
        # (each depth runs on all s tokens of the rank, the k + 1 past the window's end being padding; a
        # depth without a target in the window is skipped)
        mtp_block = layer_bytes(block_tensors(inv), "none", t, sp) if inv.mtp_blocks else 0.0
        for depth in range(1, inv.mtp_blocks + 1):
            if layout.seq_len - depth - 1 <= 0:
                break
            last += head_in_flight * (mtp_block + sum(x.bytes(t, sp) for x in mtp_saved_tensors(
                inv, s, b, e, r, fused_norm=fused_norm)))
        tokens_x_vocab = s * b * inv.vocab_size / (t if vocab_sharded else 1)
        # the step holds the logits (compute dtype) until its backward is done
        held_logits = head_in_flight * tokens_x_vocab * e
        if fused_loss:
            # Inductor's loss keeps each row's max and log-sum-exp (fp32) and its backward writes one
            # gradient, in the logits' dtype
            log_probs = s * b * 2 * 4
            loss_backward = tokens_x_vocab * e
        else:
            # the eager loss reads an fp32 copy (freed once its log-softmax has run: below the backward's
            # start, which adds two fp32 tensors of that size, the gradients w.r.t. the log-probabilities
            # and w.r.t. the fp32 logits)
            log_probs = tokens_x_vocab * 4
            loss_backward = 2 * tokens_x_vocab * 4
    recompute = 0.0
    if checkpointed or policy in ("attention", "selective"):
        recompute = none - (layer_average("full") if policy in ("full", "every_n") else per_layer)
    boundaries = 0.0
    if layout.pp > 1:
        # a stage keeps each in-flight micro-batch's received input and produced output (full hidden states,
        # the same on every tp rank) until that micro-batch's backward
        ends = sum(1 for _ in part.stage_layers) * 2 - (1 if part.first else 0) - (1 if part.last else 0)
        boundaries = ends * s * b * inv.dim * r * in_flight / len(part.stage_layers)
    # autocast caches each weight's cast until the forward's autocast region ends (a pipeline stage's
    # forward of one micro-batch); the blocks whose policy does not keep the casts hold them only there
    block_cast = block_weights * e if casts else 0.0
    uncached_layers = {"full": checkpointed, "every_n": checkpointed, "selective": part.layers,
                       "offload": part.layers}.get(policy, 0)
    # (compiled blocks cast inside their graphs, which free the casts they do not save)
    cast_cache = 0.0 if layout.compiled else \
        block_cast * uncached_layers / (len(part.stage_layers) if layout.pp > 1 else 1)
    # one block's backward: SwiGLU's (GeLU's) two ffn-wide input gradients at once, the residual stream's
    # gradient in and out, and under autocast the compute-dtype gradient of its largest weight before
    # the cast that accumulates it
    working = 0.0
    if part.layers:
        working = (2 * s * b * inv.ffn_dim / t * e + 2 * s * b * inv.dim * r / (t if sp else 1)
                   + (largest_weight * e if casts else 0.0))
    device = blocks + first + last + boundaries + positions
    host = 0.0
    notes = []
    if policy == "offload":
        if device_type == "cpu":
            notes.append("activation offload: already in host memory on the CPU, nothing moves")
        else:
            # the blocks' saved tensors go to host memory, one block's in flight; the embedding's and the
            # head's stay
            host, device = blocks, device - blocks + none
    return ActivationEstimate(
        per_layer_none=none, per_layer_kept=per_layer, layers=part.layers, checkpointed=checkpointed,
        in_flight=in_flight, blocks=blocks, first_stage=first, last_stage=last, boundaries=boundaries,
        device=device, host=host,
        recompute_transient=max(recompute, 0.0), notes=notes,
        position_tables=positions, head_in_flight=head_in_flight if part.last else 0.0, log_probs=log_probs,
        held_logits=held_logits, loss_backward=loss_backward, cast_cache=cast_cache,
        gradient_working_set=working, block_cast_bytes=block_cast,
    )
