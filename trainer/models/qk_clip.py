"""QK-clip (MuonClip, Kimi K2 tech report 2025, section 2.1): keep attention logits below `tau`.

During the forwards of one optimizer step each attention layer records, per query head h, the largest
pre-softmax logit S_h = max over allowed (i, j) of (q_i . k_j) * softmax_scale (`LogitMax`, set on the
layer's `CoreAttention`). After the optimizer step, `QKClip.after_optimizer_step` takes the maxima, reduces
them with MAX over the ranks that hold the same heads and see other tokens (data x context parallel:
`Strategy.reduce_max`), and for each head with S_h > tau multiplies its logits by gamma_h = tau / S_h:
sqrt(gamma_h) on the head's query-projection rows and sqrt(gamma_h) on its key-projection rows, or, when a
key head is shared by several query heads (grouped-query attention), all of gamma_h on the query rows and
nothing on the shared key (Kimi K2's rule for MLA's shared rotary key). RoPE is linear in q and k, so
scaling the rows scales the logits exactly. Heads at or below tau are left alone.

The maxima are exact, not bounds: `max_logits` computes q k^T again under no_grad, in query blocks of
bounded size, masked as the attention is (causal, within documents). That is one more QK^T per layer and
micro-batch (a third of the attention's forward matmuls, no backward), paid only when clipping is on.
Under context parallelism a rank holds its queries and gathers the whole sequence's keys (no gradient),
and the cp ranks' maxima meet in the MAX reduction.

The weights may be sharded: FSDP2's DTensors (rows over dp), tensor parallelism's (heads over tp: this
rank's forward sees its own heads only, which are the tp-local rows), both, or plain tensors (DDP, ZeRO-1/2
after their all-gather, pipeline stages: each stage clips its own layers). `_scale_rows` builds each
head's factor for the rows this rank's forward sees and lets DTensor cut the piece that matches the
weight's local shard (a local split, no communication).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainer.interfaces.model_family import ModelFamily, QKClipAttention
from trainer.models.moe import counts_statistics

__all__ = ["LogitMax", "QKClip", "max_logits"]

# The name of the tensor-parallel mesh dimension (trainer.parallel_dims.MESH_ORDER): a projection's rows
# split over it are the heads this rank's forward computes.
_TP = "tp"
# Logits computed at once per query block (elements of a [B, H, block, S] tensor): bounds the extra memory.
_BLOCK_ELEMENTS = 1 << 24


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, q_positions: torch.Tensor,
               k_positions: torch.Tensor, q_docs: Optional[torch.Tensor] = None,
               k_docs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`[H]` float32: each query head's largest logit (q . k) * scale over the pairs the causal mask allows
    (key position <= query position, same document when document ids `[B, S]` are given). `q` is
    `[B, H, Sq, D]`, `k` `[B, Hkv, Sk, D]` with H a multiple of Hkv (query head h reads key head
    h // (H / Hkv), as SDPA's enable_gqa); positions are `[Sq]` and `[Sk]`."""
    batch, heads, sq, _ = q.shape
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    qf, kf = q.float(), k.float()
    block = max(1, min(sq, _BLOCK_ELEMENTS // max(1, batch * heads * k.shape[2])))
    best = torch.full((heads,), -math.inf, dtype=torch.float32, device=q.device)
    for start in range(0, sq, block):
        end = min(start + block, sq)
        logits = torch.matmul(qf[:, :, start:end], kf.transpose(-2, -1)) * scale  # [B, H, b, Sk]
        allowed = k_positions[None, :] <= q_positions[start:end, None]  # [b, Sk]
        allowed = allowed[None, None]
        if q_docs is not None and k_docs is not None:
            allowed = allowed & (q_docs[:, None, start:end, None] == k_docs[:, None, None, :])
        logits = logits.masked_fill(~allowed, -math.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 2, 3)))
    return best


class LogitMax:
    """The running per-head maximum of one attention layer's logits over the training forwards since the
    last `take` (set as `CoreAttention.logit_max`; its forward calls `record` in training mode only, so
    validation does not count, and `record` leaves out a pipeline's metadata inference and an
    activation-checkpointing recompute)."""

    def __init__(self) -> None:
        self.value: Optional[torch.Tensor] = None

    @torch.no_grad()
    def record(self, q: torch.Tensor, k: torch.Tensor, scale: Optional[float], context_parallel: Any,
               doc_ids: Optional[torch.Tensor]) -> None:
        """Fold in the logits of queries `q` `[B, H, S_local, D]` against keys `k` `[B, Hkv, S_local, D]`
        (after RoPE); under context parallelism (`context_parallel`, a `ContextParallel`) against the whole
        sequence's keys, gathered. `doc_ids`: the whole sequence's document ids, or None."""
        # not a pipeline's metadata inference (a forward on stand-in inputs, inside `moe_stats_paused`) nor
        # an activation-checkpointing recompute (the same logits again)
        if q.is_meta or not counts_statistics():
            return
        local = q.shape[2]
        q_docs = k_docs = doc_ids
        if context_parallel is None:
            q_positions = k_positions = torch.arange(local, device=q.device)
        else:
            q_positions = context_parallel.positions(local, q.device)
            k = context_parallel.gather(k, dim=2)
            k_positions = torch.arange(k.shape[2], device=q.device)
            q_docs = None if doc_ids is None else context_parallel.shard(doc_ids)
        maxima = max_logits(q, k, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
                            q_positions, k_positions, q_docs, k_docs)
        self.value = maxima if self.value is None else torch.maximum(self.value, maxima)

    def take(self, heads: int, device: torch.device) -> torch.Tensor:
        """The maxima recorded (`[heads]`, -inf where nothing was), and a fresh start."""
        value = self.value
        self.value = None
        if value is None:
            return torch.full((heads,), -math.inf, dtype=torch.float32, device=device)
        assert value.numel() == heads, f"recorded {value.numel()} heads, the projection has {heads}"
        return value


def _local_rows(weight: torch.Tensor) -> int:
    """Rows of `weight` this rank's forward uses: all of them, or its tensor-parallel share."""
    rows = weight.shape[0]
    if isinstance(weight, DTensor):
        if _TP in (weight.device_mesh.mesh_dim_names or ()):
            rows //= weight.device_mesh[_TP].size()
    return rows


def _scale_rows(weight: torch.Tensor, factors: torch.Tensor) -> None:
    """Multiply row r of the rows this rank's forward uses (`_local_rows`) by `factors[r]`, in place, on
    whatever piece of them this rank holds."""
    column = factors.to(weight.dtype)[:, None]
    if not isinstance(weight, DTensor):
        weight.mul_(column)
        return
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or ()
    for name, placement in zip(names, weight.placements, strict=True):
        if name == _TP and placement != Shard(0):
            raise ValueError(f"QK-clip scales the heads' rows of a projection tensor parallelism splits by rows "
                             f"(Shard(0)); this one has {placement} on tp")
    # The factors as the forward sees them: split by heads over tp, the same on every other mesh dimension;
    # redistributed to the weight's own placements, each rank gets the factors of the rows it holds.
    spread = DTensor.from_local(column, mesh, [Shard(0) if name == _TP else Replicate() for name in names],
                                run_check=False, shape=(weight.shape[0], 1), stride=(1, 1))
    weight.to_local().mul_(spread.redistribute(mesh, weight.placements).to_local())


@dataclass
class _Layer:
    key: str
    attention: QKClipAttention
    recorder: LogitMax


class QKClip:
    """Clips every attention layer of the model parts after each optimizer step (see the module docstring).

    Args:
        tau: the largest logit a head may reach (Kimi K2: 100).
        model_parts: the trained model parts (a pipeline rank's stages; one model otherwise).
        family: their model family, which names the attention layers (`qk_clip_attention`).
    """

    def __init__(self, tau: float, model_parts: Sequence[nn.Module], family: ModelFamily) -> None:
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"qk_clip_tau must be a positive number, got {tau}")
        self.tau = float(tau)
        self.layers: list[_Layer] = []
        for part in model_parts:
            found = family.qk_clip_attention(part)
            if not found:  # a family that allows QK-clip but names no layer would clip nothing, silently
                raise ValueError(f"QK-clip found no attention layer in {type(part).__name__} "
                                 f"(the {family.name} family's qk_clip_attention)")
            for key, attention in found:
                recorder = LogitMax()
                attention.core.logit_max = recorder  # type: ignore[assignment]
                self.layers.append(_Layer(key, attention, recorder))

    @torch.no_grad()
    def after_optimizer_step(self, reduce_max: Callable[[torch.Tensor], torch.Tensor],
                             over_model: Callable[[torch.Tensor, str], torch.Tensor],
                             stepped: bool = True) -> dict[str, torch.Tensor]:
        """Take the step's maxima (every rank, every step: the reductions are collectives), reduce them with
        `reduce_max` over the ranks holding the same heads and, when the optimizer `stepped`, clip the heads
        above tau. Returns the whole model's `qk_clip/max_logit` (the largest logit before clipping) and
        `qk_clip/clipped_heads` (0 after a skipped update), made of every stage's and tp rank's with
        `over_model(tensor, op)`."""
        heads = [_local_rows(layer.attention.query) // layer.attention.head_dim for layer in self.layers]
        device = _local(self.layers[0].attention.query).device
        recorded = [layer.recorder.take(n, device) for layer, n in zip(self.layers, heads, strict=True)]
        maxima = reduce_max(torch.cat(recorded))
        over = maxima > self.tau
        if stepped:
            gamma = torch.where(over, self.tau / maxima, torch.ones_like(maxima))
            for layer, layer_gamma in zip(self.layers, gamma.split(heads), strict=True):
                self._clip(layer.attention, layer_gamma)
        clipped = over.sum() if stepped else torch.zeros((), dtype=torch.int64, device=device)
        return {"qk_clip/max_logit": over_model(maxima.max(), "max"),
                "qk_clip/clipped_heads": over_model(clipped, "sum")}

    @staticmethod
    def _clip(attention: QKClipAttention, gamma: torch.Tensor) -> None:
        """Scale one layer's heads' logits by `gamma` (`[query heads]`, 1 for the heads left alone)."""
        if bool((gamma == 1).all()):
            return
        dim = attention.head_dim
        key_heads = _local_rows(attention.key) // dim
        if key_heads == gamma.numel():  # one key head per query head: half the scale on each side
            root = gamma.sqrt()
            _scale_rows(attention.query, root.repeat_interleave(dim))
            _scale_rows(attention.key, root.repeat_interleave(dim))
        else:  # a key head shared by several query heads: all of it on the query, the key left alone
            _scale_rows(attention.query, gamma.repeat_interleave(dim))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
