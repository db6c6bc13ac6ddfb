"""Context parallelism: every sequence split over the `cp` ranks, attention computed across them.

Everything outside attention (embeddings, norms, MLPs, the loss) works token by token, so a rank simply
runs it on its own slice of the sequence. Attention needs every earlier token's keys and values; the two
methods differ in how they bring them (`cp_method`):

- `ring` (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron-Core's context
  parallelism): the K/V blocks travel round the ring of cp ranks, one hop per step, while each rank
  computes its queries against the block it holds; the partial results are merged exactly with the
  log-sum-exp rule (as flash attention merges tiles). No rank ever holds more than two blocks of K/V.
  Causal load balancing: the sequence is cut into 2 x cp chunks and rank r holds chunks r and
  2cp-1-r, so every rank does the same share of the causal triangle (with a contiguous split the last
  rank would do cp times the first one's work). The backward runs the ring again with the K/V gradients
  travelling alongside their blocks back to their owners.
- `all_to_all` (Jacobs et al. 2023, "DeepSpeed Ulysses"): an all-to-all turns sequence shards of all
  heads into the whole sequence for heads / cp heads, ordinary attention runs on them, and a second
  all-to-all turns the result back. Needs the (tensor-parallel local) query and key/value head counts
  divisible by cp. The sequence is split contiguously.

torch's own `context_parallel` API dispatches only the CUDA attention kernels (flash, efficient,
cuDNN); this module builds both methods on `torch.distributed` point-to-point and all-to-all
collectives with their own backward, so they run on gloo/CPU as on NCCL. Per block, the CPU flash
kernel (`_scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp) computes the
forward and backward; with attention dropout, or on other devices, an exact blockwise math kernel does.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from trainer.models.documents import document_mask

METHODS: tuple[str, ...] = ("ring", "all_to_all")

LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---- layout: which tokens a rank holds ----------------------------------------------------------------
def load_balanced(method: str) -> bool:
    """Whether `method` uses the causal load-balanced layout (2 x cp chunks) rather than cp contiguous ones."""
    return method == "ring"


def sequence_divisor(cp: int, method: str) -> int:
    """The sequence length must be a multiple of this (the number of chunks the layout cuts it into)."""
    return 2 * cp if load_balanced(method) else cp


def sequence_chunks(rank: int, cp: int, balanced: bool) -> tuple[int, ...]:
    """Indices of the chunks rank `rank` holds, in the order it holds them."""
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def shard_sequence(tensor: torch.Tensor, rank: int, cp: int, balanced: bool, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (sequence on `dim`)."""
    chunks = tensor.chunk(2 * cp if balanced else cp, dim)
    return torch.cat([chunks[i] for i in sequence_chunks(rank, cp, balanced)], dim)


def unshard_sequence(shards: list[torch.Tensor], balanced: bool, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (rank order): the inverse of `shard_sequence`."""
    cp = len(shards)
    pieces: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        ids = sequence_chunks(rank, cp, balanced)
        for index, piece in zip(ids, shard.chunk(len(ids), dim)):
            pieces[index] = piece
    return torch.cat([pieces[i] for i in sorted(pieces)], dim)


def local_positions(local_len: int, rank: int, cp: int, balanced: bool,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (for RoPE and learned position tables) of the `local_len` tokens a rank holds."""
    ids = sequence_chunks(rank, cp, balanced)
    chunk = local_len // len(ids)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in ids])


# ---- the cp group as the model sees it -----------------------------------------------------------------
@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its context-parallel group and the method attention uses across it.

    Set on a model by `enable_context_parallel`; the model reads `positions` for its position encoding
    and its attention modules call `attention`.
    """

    group: dist.ProcessGroup
    rank: int
    size: int
    method: str = "ring"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"cp_method must be one of {', '.join(METHODS)}, got {self.method!r}")

    @property
    def balanced(self) -> bool:
        return load_balanced(self.method)

    def positions(self, local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        return local_positions(local_len, self.rank, self.size, self.balanced, device)

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(tensor, self.rank, self.size, self.balanced, dim)

    def gather(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence of a tensor of which each rank of the group holds its shard (the inverse of
        `shard`, gathered over the group; not differentiable: for token ids, which DeepSeek-V3's multi-token
        prediction shifts along the whole sequence)."""
        shards = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(shards, tensor.contiguous(), group=self.group)
        return unshard_sequence(shards, self.balanced, dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, local_attention: LocalAttention, *,
                  dropout_p: float = 0.0, doc_ids: torch.Tensor | None = None,
                  scale: float | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries `[B, H, S/cp, D]` over the whole sequence's keys/values
        (`[B, Hkv, S/cp, D]` and `[B, Hkv, S/cp, Dv]` held here, grouped-query when Hkv < H); the output is
        `[B, H, S/cp, Dv]` (the values' width, which may differ from the query/key width D: MLA's).

        `local_attention(q, k, v[, doc_ids])` is the model's own causal attention on whole sequences; the
        all-to-all method runs it on its head groups. The ring runs its own blockwise kernels (with
        `dropout_p`; a dropout seed is drawn from the current random stream) and softmax scale `scale`
        (None: 1 / sqrt(D), as SDPA; a model whose `local_attention` uses another passes it here). `doc_ids`
        (`[B, S]`, the whole sequence's document ids) keeps attention inside documents.
        """
        if self.method == "all_to_all":
            return ulysses_attention(q, k, v, self.group, local_attention, doc_ids)
        seed = int(torch.randint(0, 2**62, (1,))) if dropout_p > 0 else 0
        return _RingAttention.apply(q, k, v, self, dropout_p, seed, doc_ids, scale)


def enable_context_parallel(model: torch.nn.Module, context: ContextParallel | None) -> None:
    """Give `model` (or a pipeline stage of it) and every attention core in it the context-parallel group."""
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = context


# ---- all-to-all (Ulysses) -------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Split dim `scatter` into cp parts, send part i to rank i, concatenate what arrives on dim `gather`
    (in rank order). The backward is the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int) -> torch.Tensor:  # type: ignore[override]
        # weakly: a graph kept alive (a tensor that still has its grad_fn) must not keep the group alive past
        # its destruction, which aborts the process at exit
        ctx.group, ctx.scatter, ctx.gather = weakref.ref(group), scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return _all_to_all(grad, ctx.group(), ctx.gather, ctx.scatter), None, None, None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, scatter)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    if gather == 1:  # the output of attention: token-major, so the caller's [B, S, H*D] reshape is a view
        out = _heads_view_of_tokens_major(x, heads=x.shape[1] * size, seq=x.shape[2] // size)
        torch.cat(received.unbind(0), gather, out=out)
        return out
    return torch.cat(received.unbind(0), gather)


def _heads_view_of_tokens_major(like: torch.Tensor, heads: int | None = None, seq: int | None = None,
                                width: int | None = None) -> torch.Tensor:
    """An empty [B, H, S, D] tensor stored as [B, S, H, D], as SDPA lays out its output: the attention output's
    transpose-and-reshape to [B, S, H*D] for the output projection is then a view, not a second copy that
    autograd would keep beside the one attention saves. `like`'s shape, but for the given sizes."""
    b, h, s, d = like.shape
    h, s, d = heads or h, seq or s, width or d
    return torch.empty(b, s, h, d, dtype=like.dtype, device=like.device).transpose(1, 2)


@torch._dynamo.disable  # collectives inside: keep a compiled block's graph around it
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                      local_attention: LocalAttention, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence shards of all heads -> the whole sequence of heads/cp heads -> `local_attention` -> back.

    Query heads must divide by cp. Key/value heads that do not (grouped-query attention with fewer K/V
    heads than cp ranks) are repeated just enough to divide, keeping each query head with its own K/V
    head; autograd sums the copies' gradients.
    """
    cp = dist.get_world_size(group)
    repeat = kv_head_repeat(q.shape[1], k.shape[1], cp)
    k, v = _expand_kv(k, repeat), _expand_kv(v, repeat)
    whole = [_AllToAll.apply(t, group, 1, 2) for t in (q, k, v)]
    out = local_attention(*whole) if doc_ids is None else local_attention(*whole, doc_ids)
    return _AllToAll.apply(out, group, 2, 1)


def kv_head_repeat(heads: int, kv_heads: int, cp: int) -> int:
    """Under all_to_all: the least copy count of each K/V head that makes the K/V heads divisible by cp (dividing the group)."""
    if heads % cp:
        raise ValueError(f"all_to_all context parallelism needs the query heads ({heads} on this rank) "
                         f"divisible by cp={cp}")
    group = heads // kv_heads
    return next(f for f in range(1, group + 1) if group % f == 0 and (kv_heads * f) % cp == 0)


# ---- ring attention --------------------------------------------------------------------------------------
class _Ring:
    """Point-to-point exchange with the ring neighbours of the cp group: send to the next, receive from the
    previous (both at once, so a rank's send and receive cannot wait on each other)."""

    def __init__(self, context: ContextParallel) -> None:
        self.group = context.group
        self.next = dist.get_global_rank(self.group, (context.rank + 1) % context.size)
        self.prev = dist.get_global_rank(self.group, (context.rank - 1) % context.size)

    def start(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending: tuple[torch.Tensor, list[dist.Work]]) -> torch.Tensor:
        received, works = pending
        for work in works:
            work.wait()
        return received


def _pair_mask(doc_ids: torch.Tensor | None, q_chunk: int, k_chunk: int, chunks: int) -> torch.Tensor | None:
    """Document mask of one chunk pair (None without document masking), from the whole sequence's ids."""
    if doc_ids is None:
        return None
    q_ids, k_ids = doc_ids.chunk(chunks, 1)[q_chunk], doc_ids.chunk(chunks, 1)[k_chunk]
    return document_mask(q_ids, k_ids, causal=q_chunk == k_chunk)


def _block_pairs(q_ids: tuple[int, ...], k_ids: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, causal) for every pair that is not entirely in the future: key
    chunks before the query chunk are seen whole, the same chunk through the causal (diagonal) mask."""
    return [(a, b, ki == qi) for a, qi in enumerate(q_ids) for b, ki in enumerate(k_ids) if ki <= qi]


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _dropout_scale(shape: torch.Size, dropout_p: float, seed: int, device: torch.device) -> torch.Tensor:
    """Keep-mask / (1 - p) of one block, the same in forward and backward (drawn from its own seed)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    keep = torch.empty(shape, device=device).bernoulli_(1.0 - dropout_p, generator=generator)
    return keep / (1.0 - dropout_p)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in the accumulation dtype: fp32, or fp64 for fp64 inputs (gradient checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _masked_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
                   mask: torch.Tensor | None) -> torch.Tensor:
    scores = (_acc(q) @ _acc(k).transpose(-2, -1)) * scale
    if mask is not None:
        return scores.masked_fill(~mask, float("-inf"))
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """-inf (a row that sees nothing) as 0, so that exp(-inf - lse) is 0 rather than nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _use_flash(q: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """The CPU flash kernel: no dropout, fp32/bf16, and one head width for q, k and v (it has no other)."""
    return (q.device.type == "cpu" and dropout_p == 0.0 and q.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] == v.shape[-1])


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   dropout_p: float, seed: int, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key/value block: (output fp32, log-sum-exp fp32). `mask`
    (`[B, 1, Sq, Sk]`, True = may attend; the causal part included) replaces `causal`; a query that may
    attend no key of the block gets output 0 and log-sum-exp -inf."""
    if mask is None and _use_flash(q, v, dropout_p):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float()
    scores = _masked_scores(q, k, causal, scale, mask)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    if dropout_p > 0:
        probs = probs * _dropout_scale(probs.shape, dropout_p, seed, q.device)
    return probs @ _acc(v), lse


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float, dropout_p: float,
                    seed: int, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block pair given the merged output and log-sum-exp of the query block (flash
    attention's backward: P = exp(S - lse), dS = P * (dP - rowsum(dO * O)))."""
    if mask is None and _use_flash(q, v, dropout_p):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        return dq.float(), dk.float(), dv.float()
    qf, kf, vf, doutf = _acc(q), _acc(k), _acc(v), _acc(dout)
    scores = _masked_scores(q, k, causal, scale, mask)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # the merged lse: finite (a token sees itself)
    dprobs = doutf @ vf.transpose(-2, -1)
    if dropout_p > 0:
        mask = _dropout_scale(probs.shape, dropout_p, seed, q.device)
        dv = (probs * mask).transpose(-2, -1) @ doutf
        dprobs = dprobs * mask
    else:
        dv = probs.transpose(-2, -1) @ doutf
    delta = (doutf * _acc(out)).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    return dscores @ kf, dscores.transpose(-2, -1) @ qf, dv


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over the cp group (load-balanced layout); see the module docstring. Keys and
    values travel as one tensor, concatenated on the head width (their widths may differ: MLA's)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ContextParallel,  # type: ignore[override]
                dropout_p: float, seed: int, doc_ids: torch.Tensor | None = None,
                scale: float | None = None) -> torch.Tensor:
        cp, rank = context.size, context.rank
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        groups = q.shape[1] // k.shape[1]
        widths = [k.shape[-1], v.shape[-1]]
        q_ids = sequence_chunks(rank, cp, True)
        q_blocks = q.chunk(len(q_ids), 2)
        outs: list[torch.Tensor | None] = [None] * len(q_ids)
        lses: list[torch.Tensor | None] = [None] * len(q_ids)
        ring = _Ring(context)
        kv = torch.cat((k, v), -1)
        for step in range(cp):
            # the next block is on its way while this one is computed
            pending = ring.start(kv) if step < cp - 1 else None
            source = (rank - step) % cp
            k_ids = sequence_chunks(source, cp, True)
            k_held, v_held = kv.split(widths, -1)
            k_blocks, v_blocks = k_held.chunk(len(k_ids), 2), v_held.chunk(len(k_ids), 2)
            for a, b, causal in _block_pairs(q_ids, k_ids):
                block_seed = seed + q_ids[a] * 2 * cp + k_ids[b]
                out, lse = _block_forward(q_blocks[a], _expand_kv(k_blocks[b], groups),
                                          _expand_kv(v_blocks[b], groups), causal, scale, dropout_p, block_seed,
                                          _pair_mask(doc_ids, q_ids[a], k_ids[b], 2 * cp))
                outs[a], lses[a] = _merge(outs[a], lses[a], out, lse)
            if pending is not None:
                kv = ring.finish(pending)
        out = _heads_view_of_tokens_major(q, width=v.shape[-1])
        for a, block in enumerate(outs):
            out[:, :, a * q_blocks[0].shape[2]:(a + 1) * q_blocks[0].shape[2]] = block
        lse = torch.cat(lses, 2)  # type: ignore[arg-type]
        ctx.save_for_backward(q, k, v, out, lse, doc_ids)
        # weakly, as in _AllToAll
        ctx.context, ctx.dropout_p, ctx.seed, ctx.scale = weakref.ref(context), dropout_p, seed, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, doc_ids = ctx.saved_tensors
        context: ContextParallel = ctx.context()
        cp, rank = context.size, context.rank
        groups = q.shape[1] // k.shape[1]
        widths = [k.shape[-1], v.shape[-1]]
        q_ids = sequence_chunks(rank, cp, True)
        split = len(q_ids)
        q_blocks, out_blocks = q.chunk(split, 2), out.chunk(split, 2)
        dout_blocks, lse_blocks = dout.contiguous().chunk(split, 2), lse.chunk(split, 2)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq_blocks = [torch.zeros_like(b, dtype=acc_dtype) for b in q_blocks]
        ring = _Ring(context)
        kv = torch.cat((k, v), -1)
        dkv = torch.zeros_like(kv, dtype=acc_dtype)  # travels with its block, back to its owner
        for step in range(cp):
            pending = ring.start(kv) if step < cp - 1 else None
            source = (rank - step) % cp
            k_ids = sequence_chunks(source, cp, True)
            k_held, v_held = kv.split(widths, -1)
            k_blocks, v_blocks = k_held.chunk(len(k_ids), 2), v_held.chunk(len(k_ids), 2)
            dk_held, dv_held = dkv.split(widths, -1)  # views: adding into them adds into dkv
            dk_blocks, dv_blocks = dk_held.chunk(len(k_ids), 2), dv_held.chunk(len(k_ids), 2)
            for a, b, causal in _block_pairs(q_ids, k_ids):
                block_seed = ctx.seed + q_ids[a] * 2 * cp + k_ids[b]
                dq, dk, dv = _block_backward(dout_blocks[a], q_blocks[a], _expand_kv(k_blocks[b], groups),
                                             _expand_kv(v_blocks[b], groups), out_blocks[a], lse_blocks[a],
                                             causal, ctx.scale, ctx.dropout_p, block_seed,
                                             _pair_mask(doc_ids, q_ids[a], k_ids[b], 2 * cp))
                dq_blocks[a] += dq
                dk_blocks[b].add_(_reduce_kv(dk, groups))
                dv_blocks[b].add_(_reduce_kv(dv, groups))
            if pending is not None:
                kv = ring.finish(pending)
            # the gradients follow their block one hop; after the last step that hop takes them home
            if cp > 1:
                dkv = ring.finish(ring.start(dkv))
        dq = torch.cat(dq_blocks, 2).to(q.dtype)
        dk, dv = dkv.split(widths, -1)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalized partial results by their log-sum-exps (exact, fp32)."""
    if out is None or lse is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    base = _finite(merged)  # rows that have seen nothing yet (document masking) stay 0 with lse -inf
    out = out * torch.exp(lse - base).unsqueeze(-1) + block_out * torch.exp(block_lse - base).unsqueeze(-1)
    return out, merged
