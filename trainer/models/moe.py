"""Mixture-of-Experts feed-forward layer (Mixtral / DeepSeek-V3 style) with optional expert parallelism.

One `MoE` replaces a block's SwiGLU `FeedForward` when `LlamaConfig.n_experts > 0`:

- **Router** (`router`, HF `gate`): token-choice top-k over a softmax of the router logits, computed in
  fp32. Mixtral renormalises the k chosen probabilities to sum to 1 (`router_renormalize`; never with
  k = 1, where it would make every weight 1 and cut the router's gradient, Switch's case).
- **Balancing**: the Switch / Mixtral auxiliary loss `E * sum_e f_e * P_e` (f_e: the fraction of the T x k
  assignments that chose expert e, P_e: the mean router probability of e; 1.0 when perfectly balanced),
  times `router_aux_loss_coef`; the router z-loss `mean(logsumexp(logits)^2)` (ST-MoE) times
  `router_z_loss_coef`; and DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the
  scores for the top-k choice only (never to the weights), moved by `router_bias_update_rate` x
  sign(mean load - load) after every optimizer step (`update_router_biases`).
- **Dropless** by default; `capacity_factor > 0` keeps at most ceil(cf x T x k / E) assignments per expert
  per micro-batch (first come, first served in token order, as Switch does) and counts the rest as dropped
  (a dropped assignment adds nothing; the token keeps its residual stream).
- **Grouped expert compute**: the T x k assignments are sorted by expert, and `GroupedExperts` multiplies
  every expert's rows at once with torch's grouped matmul (`torch._grouped_mm`, used where its 16-byte
  stride rule holds), else one matmul per expert. Never a Python loop over tokens.
- **Expert parallelism** (`expert_parallel` set by the strategy): this rank holds E / ep experts (a DTensor
  `Shard(0)` of each expert weight over the ep mesh); the sorted rows go to the rank of their expert and come
  back with two variable-split all-to-alls (their sizes exchanged first by a fixed-size one). While an
  `ExpertCommGate` is set (`expert_comm_gate_set`), the forward tells it where each exchange begins and
  ends, and so does the backward for the exchanges' gradients: DualPipeV's overlap (pipeline_overlap.py)
  pairs one micro-batch's all-to-all with another's compute there, and measures what stays exposed.

The auxiliary losses reach the gradients without passing through the loss function: `_AttachAuxLoss`
returns the layer's output unchanged and, in the backward, hands the aux loss the gradient
`aux_loss_grad_scale()`, which the strategy sets to what the language-model loss is multiplied by before
its backward (1 / micro-batches, times a loss scaler's scale). So every strategy, pipeline stages included,
trains the aux losses of the layers it holds without the loss path knowing about them (Megatron-LM's
`MoEAuxLossAutoScaler` does the same).

Statistics for logging (aux loss, tokens per expert, dropped assignments) accumulate on each layer during
training forwards (not during activation-checkpointing recomputes, a pipeline's metadata inference, or
evaluation) until `collect_moe_stats` reads and clears them once per step.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

# The gradient the aux losses receive in the backward (see the module docstring); a strategy sets it for
# each step's backward with `aux_loss_grad_scale_set`.
_AUX_LOSS_GRAD_SCALE: float = 1.0


def aux_loss_grad_scale() -> float:
    """What the aux losses' gradient is multiplied by (the factor the LM loss is multiplied by)."""
    return _AUX_LOSS_GRAD_SCALE


@contextlib.contextmanager
def aux_loss_grad_scale_set(scale: float) -> Iterator[None]:
    """Within the block, backward passes give the MoE aux losses the gradient `scale`."""
    global _AUX_LOSS_GRAD_SCALE
    previous, _AUX_LOSS_GRAD_SCALE = _AUX_LOSS_GRAD_SCALE, float(scale)
    try:
        yield
    finally:
        _AUX_LOSS_GRAD_SCALE = previous


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `output`; in the backward the scalar `aux_loss` gets gradient `aux_loss_grad_scale()`."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, aux_loss_grad_scale())


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (the CPU grouped-matmul backward
    rejects expanded gradients, e.g. that of a `.sum()`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient too: every rank of the group uses the
    summed value, so each one's input gets the sum of their gradients. The group is held weakly (a graph
    kept past the group's destruction must not keep a gloo group alive; see context_parallel.py)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = weakref.ref(group)
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group())
        return grad, None


_STATS_PAUSED = False


class ExpertCommGate:
    """Told where the expert all-to-alls begin and end (see `_CommBoundary`); the default does nothing.

    `boundary(name, backward)` is called with name "dispatch" (before the token counts and rows are sent),
    "dispatched" (after they arrived), "combine" (before the results go back) and "combined" (after), in
    that order in a forward; in a backward in the reverse order, where "combined" and "dispatched" begin
    an exchange (the gradients of the results and of the rows go back to their senders) and "combine" and
    "dispatch" end it. `begins_exchange` says which.
    """

    def boundary(self, name: str, backward: bool) -> None:
        del name, backward

    @staticmethod
    def begins_exchange(name: str, backward: bool) -> bool:
        return (name in ("dispatch", "combine")) != backward


_COMM_GATE: Optional[ExpertCommGate] = None


@contextlib.contextmanager
def expert_comm_gate_set(gate: Optional[ExpertCommGate]) -> Iterator[None]:
    """Expert-parallel MoE layers whose forward runs within the block report their all-to-alls (forward and
    backward) to `gate`. Global, not per thread: DualPipeV's overlap runs a forward and a backward on two
    threads at once and both must report."""
    global _COMM_GATE
    previous, _COMM_GATE = _COMM_GATE, gate
    try:
        yield
    finally:
        _COMM_GATE = previous


class _CommBoundary(torch.autograd.Function):
    """Identity that reports an all-to-all boundary to the gate set at forward time, in the forward and,
    for the gradient's exchange, again in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: ExpertCommGate, name: str) -> torch.Tensor:
        ctx.gate, ctx.name = gate, name
        gate.boundary(name, backward=False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.gate.boundary(ctx.name, backward=True)
        return grad, None, None


def _comm_boundary(x: torch.Tensor, name: str) -> torch.Tensor:
    gate = _COMM_GATE
    return x if gate is None else _CommBoundary.apply(x, gate, name)


@contextlib.contextmanager
def moe_stats_paused() -> Iterator[None]:
    """Forwards within the block are not counted in the MoE statistics (a pipeline's metadata inference
    runs the first stage on a real micro-batch that the schedule then runs again)."""
    global _STATS_PAUSED
    previous, _STATS_PAUSED = _STATS_PAUSED, True
    try:
        yield
    finally:
        _STATS_PAUSED = previous


def _in_backward() -> bool:
    """True while autograd runs a backward: an activation-checkpointing recompute, whose statistics the
    first forward already counted."""
    return torch._C._current_graph_task_id() != -1


def counts_statistics() -> bool:
    """Whether a forward running now is one whose training statistics count: not inside `moe_stats_paused`
    (a pipeline's metadata inference) nor an activation-checkpointing recompute in a backward."""
    return not _STATS_PAUSED and not _in_backward()


@dataclass
class ExpertParallel:
    """This rank's expert-parallel group: `size` ranks, each holding n_experts / size experts."""

    group: dist.ProcessGroup
    rank: int
    size: int


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _grouped_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped matmul needs 16-byte aligned strides (and exists on this build)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    size = x.element_size()
    return all((n * size) % 16 == 0 for n in (x.shape[-1], weight.shape[-1], weight.shape[-2]))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """`x` [N, in] holds the rows of expert 0, then expert 1, ... (`counts` [E] rows each, on the CPU);
    returns [N, out] with each expert's rows multiplied by its `weight[e]` ([E, out, in], nn.Linear's layout).

    `grouped`: one grouped matmul (torch._grouped_mm) where it applies, else one matmul per expert.
    """
    if grouped and _grouped_mm_ok(x, weight) and x.dtype == weight.dtype:
        offsets = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
        return torch._grouped_mm(_ContiguousGrad.apply(x), weight.transpose(-2, -1), offs=offsets)
    pieces = torch.split(x, counts.tolist())
    return torch.cat([piece @ weight[e].t() for e, piece in enumerate(pieces)]) if pieces else x.new_zeros(0, weight.shape[1])


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU experts stored as stacked weights: w1, w3 [E, hidden, dim], w2 [E, dim, hidden].

    Under expert parallelism each weight is a DTensor sharded on the expert dimension, and this rank
    multiplies with its local experts.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, grouped: bool = True) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.grouped = grouped
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` sorted by (local) expert, `counts` rows per local expert (CPU int64)."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        gate = grouped_linear(x, w1, counts, self.grouped)
        up = grouped_linear(x, w3, counts, self.grouped)
        return grouped_linear(F.silu(gate) * up, w2, counts, self.grouped)

    def init_weights(self, std: float, residual_std: float) -> None:
        # Expert by expert in index order, so a model's draws do not depend on how the experts are split.
        with torch.no_grad():
            for weight, w_std in ((self.w1, std), (self.w3, std), (self.w2, residual_std)):
                nn.init.normal_(weight, mean=0.0, std=w_std)


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable variable-split all-to-all of the rows of `x` (the backward sends gradients back)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), recv, send, group))


class MoE(nn.Module):
    """Router + grouped experts (+ shared experts) replacing a block's feed-forward; see the module doc."""

    # Set by the strategy under expert parallelism (None: every expert on this rank).
    expert_parallel: Optional[ExpertParallel] = None
    # Set by the strategy under context parallelism: the ranks holding the other parts of the same
    # sequences. The load-balancing loss then uses the whole sequences' statistics (Megatron-LM reduces
    # them over its tp x cp group too), so it is the single process's, not a mean of per-part losses.
    sequence_group: Optional[dist.ProcessGroup] = None

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, *,
                 shared_experts: Optional[nn.Module] = None, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 capacity_factor: float = 0.0, renormalize: bool = True, grouped_mm: bool = True) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.bias_update_rate = bias_update_rate
        self.capacity_factor = capacity_factor
        self.renormalize = renormalize and top_k > 1
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden_dim, grouped=grouped_mm)
        # Shared experts (DeepSeek): a dense feed-forward every token goes through (the model family's own).
        self.shared_experts = shared_experts
        # DeepSeek-V3's selection bias; a buffer (no gradient), saved in checkpoints so resume is exact.
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=bias_update_rate > 0)
        self.reset_stats()

    # ---- statistics ----------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Clear what `collect_moe_stats` reads (plain attributes: never in state dicts or wrappers' views)."""
        self.stat_tokens: Optional[torch.Tensor] = None  # [E] assignments per expert since the last read
        self.stat_dropped = 0.0
        self.stat_aux = 0.0
        self.stat_z = 0.0
        self.stat_calls = 0

    def _record(self, counts: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        if not self.training or _STATS_PAUSED or _in_backward():
            return
        counts = counts.detach().double().cpu()
        self.stat_tokens = counts if self.stat_tokens is None else self.stat_tokens + counts
        self.stat_dropped += float(dropped)
        self.stat_aux += float(aux.detach())
        self.stat_z += float(z.detach())
        self.stat_calls += 1

    # ---- forward -------------------------------------------------------------------------------------
    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits [T, E] (fp32), probabilities [T, E], chosen experts [T, k], their weights [T, k]."""
        logits = F.linear(flat.float(), _local(self.router.weight).float())
        probs = logits.softmax(dim=-1)
        scores = probs if self.bias_update_rate <= 0 else probs + self.expert_bias.float()
        chosen = scores.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, chosen, weights

    def forward(self, x: torch.Tensor, counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`x` `[..., dim]`. `counted` (bool, `x`'s shape without `dim`): the tokens whose routing the statistics
        and the balancing losses count (None: all of them); the others are routed and computed alike, but
        are padding whose outputs the caller ignores (DeepSeek-V3's multi-token prediction past the end of
        the window)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        tokens = flat.shape[0]
        logits, probs, chosen, weights = self.route(flat)
        assignments = chosen.reshape(-1)  # [T * k], token-major
        counts = torch.bincount(assignments, minlength=self.n_experts)
        # Stable sort: each expert's rows stay in token order (capacity keeps the first ones).
        order = torch.argsort(assignments, stable=True)
        kept_counts = counts
        dropped = torch.zeros((), dtype=torch.long)
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[assignments[order]]
            keep = rank_in_expert < capacity
            order = order[keep]
            kept_counts = counts.clamp(max=capacity)
            dropped = (~keep).sum()
        token_index = order // self.top_k
        rows = flat[token_index]
        if self.expert_parallel is None:
            out_rows = self.experts(rows, kept_counts.cpu())
        else:
            out_rows = self._expert_parallel_forward(rows, kept_counts)
        combine = weights.reshape(-1)[order].to(out_rows.dtype)
        out = torch.zeros_like(flat).index_add(0, token_index, out_rows * combine[:, None])
        if self.shared_experts is not None:
            out = out + self._shared(flat)

        seq_len = shape[-2] if x.dim() > 2 else tokens
        if counted is None:
            aux = self.balance_loss(counts, probs, tokens, chosen=chosen, seq_len=seq_len)
            z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        else:
            keep = counted.reshape(-1).to(device=flat.device, dtype=torch.bool)
            counts = torch.bincount(chosen[keep].reshape(-1), minlength=self.n_experts)
            # (only passed when given: a subclass's balance loss without the argument never gets masked tokens)
            aux = self.balance_loss(counts, probs, tokens, chosen=chosen, seq_len=seq_len, counted=keep)
            z = torch.logsumexp(logits[keep], dim=-1).pow(2).mean()
        self._record(counts, dropped, aux, z)
        total = self.aux_loss_coef * aux + self.z_loss_coef * z
        if self.training and torch.is_grad_enabled() and (self.aux_loss_coef > 0 or self.z_loss_coef > 0):
            out = _AttachAuxLoss.apply(out, total)
        return out.view(shape)

    def balance_loss(self, counts: torch.Tensor, probs: torch.Tensor, tokens: int, *,
                     chosen: Optional[torch.Tensor] = None, seq_len: Optional[int] = None,
                     counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Switch / Mixtral `E * sum_e f_e P_e` over this micro-batch's tokens: with a sequence group, the
        assignment counts and router probabilities of all its ranks (training forwards only; the value is
        the same on every rank, and `_SumOverGroup` gives each rank's probabilities their share of the
        gradient, which the cp gradient averaging then turns into the single process's).

        `chosen` ([T, k] experts per token) and `seq_len` (tokens per sequence) are for subclasses whose
        loss is per sequence (DeepSeek-V3's sequence-wise balance loss); this batch-wise one ignores them.
        `counted` ([T] bool, see `forward`): the tokens the loss counts (`counts` already counts only them)."""
        del chosen, seq_len
        if counted is not None:
            assigned, prob_sum = counts.detach().float(), probs[counted].sum(dim=0)
            number = counted.sum().to(prob_sum.dtype).reshape(1)
            if self.sequence_group is not None and self.training:  # the ranks may count different numbers
                summed = _SumOverGroup.apply(torch.cat([assigned, number, prob_sum]), self.sequence_group)
                assigned, number, prob_sum = summed[:self.n_experts].detach(), summed[self.n_experts], \
                    summed[self.n_experts + 1:]
            number = number.detach().reshape(())
            return self.n_experts * torch.sum(assigned / (number * self.top_k) * prob_sum / number)
        assigned, prob_sum = counts.detach().float(), probs.sum(dim=0)
        if self.sequence_group is not None and self.training:
            size = dist.get_world_size(self.sequence_group)
            summed = _SumOverGroup.apply(torch.cat([assigned, prob_sum]), self.sequence_group)
            assigned, prob_sum, tokens = summed[:self.n_experts].detach(), summed[self.n_experts:], tokens * size
        return self.n_experts * torch.sum(assigned / (tokens * self.top_k) * prob_sum / tokens)

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared experts' SwiGLU `w2(silu(w1 x) * w3 x)` with local weights (under tensor parallelism
        they are replicated DTensors and the layer works on plain tensors)."""
        ffn = self.shared_experts
        assert ffn is not None
        w1, w2, w3 = (_local(getattr(ffn, name).weight) for name in ("w1", "w2", "w3"))
        return F.linear(F.silu(F.linear(flat, w1)) * F.linear(flat, w3), w2)

    def _expert_parallel_forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each row to the rank holding its expert, compute there, bring the results back.

        `rows` are sorted by global expert, so the rows for rank r (experts r x E/ep ...) are contiguous.
        """
        ep = self.expert_parallel
        assert ep is not None
        local_experts = self.n_experts // ep.size
        rows = _comm_boundary(rows, "dispatch")
        # Fixed-size exchange of the counts: recv[r * local + j] = rows rank r sends to my local expert j.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=ep.group)
        send_splits = counts.view(ep.size, local_experts).sum(1).tolist()
        recv_matrix = recv_counts.view(ep.size, local_experts).cpu()
        recv_splits = recv_matrix.sum(1).tolist()
        received = _comm_boundary(_all_to_all(rows, send_splits, recv_splits, ep.group), "dispatched")
        # Received rows are grouped by source rank, then expert: regroup them by expert for the matmuls.
        expert_of_row = torch.repeat_interleave(torch.arange(local_experts).repeat(ep.size), recv_matrix.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True).to(rows.device)
        computed = self.experts(received[perm], recv_matrix.sum(0))
        restored = _comm_boundary(computed.index_select(0, torch.argsort(perm)), "combine")
        return _comm_boundary(_all_to_all(restored, recv_splits, send_splits, ep.group), "combined")

    def init_weights(self, std: float, residual_std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        self.experts.init_weights(std, residual_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, residual_std)
        with torch.no_grad():
            self.expert_bias.zero_()
        self.reset_stats()


def moe_layers(model_parts: Sequence[nn.Module]) -> list[tuple[str, MoE]]:
    """(layer key, MoE) of every MoE layer these model parts hold, in layer order."""
    found = []
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                key = next((p for p in name.split(".") if p.isdigit()), name)
                found.append((key, module))
    return sorted(found, key=lambda item: int(item[0]) if item[0].isdigit() else 0)


class StepStatistics:
    """Mixin of a module, other than an MoE layer, that accumulates training statistics between two reads
    of `collect_moe_stats` (DeepSeek-V3's multi-token-prediction losses): they are averaged over the
    data-parallel ranks in the same collective as the MoE rows and logged with them, so the loop logs them
    without knowing the module. Every rank must report the same number of values (fixed by the config).

    (`DecoderFamily.step_statistics`, the family hook the loop calls, reads them with the MoE rows.)"""

    def stat_names(self) -> list[str]:
        """The metric names of `read_stats`' values, in order."""
        raise NotImplementedError

    def read_stats(self) -> list[float]:
        """The values accumulated since the last read (means over the training forwards), then cleared."""
        raise NotImplementedError


def _stat_row(layer: MoE) -> torch.Tensor:
    """One layer's statistics since the last read, as `collect_moe_stats` reduces them (float64): tokens per
    expert, dropped assignments, and the mean aux and z losses over its training forwards."""
    tokens = layer.stat_tokens if layer.stat_tokens is not None else torch.zeros(layer.n_experts, dtype=torch.float64)
    calls = max(layer.stat_calls, 1)
    return torch.cat([tokens, torch.tensor([layer.stat_dropped, layer.stat_aux / calls, layer.stat_z / calls],
                                           dtype=torch.float64)])


# The attribute of the first model part under which `share_moe_rows_over_stages` leaves the rows of the MoE
# layers other pipeline stages hold, for `collect_moe_stats` (a plain attribute: never in state dicts).
_OTHER_STAGES_ROWS = "pipeline_moe_rows"


def share_moe_rows_over_stages(model_parts: Sequence[nn.Module], layer_keys: Sequence[str], n_experts: int,
                               all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Under pipeline parallelism, after a step's schedule (`ModelFamily.sum_statistics_over_stages`): the
    statistics rows of the model's MoE layers (`layer_keys`, every stage's, all of `n_experts` experts)
    summed over the pp ranks with `all_reduce_sum` (a collective: every rank calls it alike, with a table
    of the same shape), so that the next `collect_moe_stats` on any stage reports every layer, as the
    single process does. The rows of this rank's own layers stay where they are (read and cleared there)."""
    own = dict(moe_layers(model_parts))
    table = torch.zeros(len(layer_keys), n_experts + 3, dtype=torch.float64)
    for index, key in enumerate(layer_keys):
        if key in own:
            table[index] = _stat_row(own[key])
    total = all_reduce_sum(table).to(torch.float64)
    rows = {key: total[index] for index, key in enumerate(layer_keys) if key not in own}
    setattr(model_parts[0], _OTHER_STAGES_ROWS, rows)


def collect_moe_stats(model_parts: Sequence[nn.Module],
                      reduce_mean: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Read (and clear) the step's statistics of the MoE layers these parts hold, averaged over the
    data-parallel ranks with `reduce_mean` (a collective every rank of the group calls, with its layers'
    statistics in one tensor; pipeline stages each reduce their own layers, and the rows of other stages'
    layers where the family shared them, `share_moe_rows_over_stages`).

    Returns the metrics: `moe/aux_loss`, `moe/z_loss` (means over layers and micro-batches, before their
    coefficients), `moe/max_load` (the largest max/mean tokens-per-expert ratio over the layers; 1.0 is
    perfect balance, n_experts / top_k the worst), `moe/dropped` (dropped assignments per data-parallel
    rank, all layers) and per layer `moe/max_load/<layer>`; and each layer's load (mean assignments per
    expert over the ranks) of the layers these parts hold, for `update_router_biases`. The values of
    `StepStatistics` modules (DeepSeek-V3's `mtp/loss`) travel in the same reduction. Empty for a dense
    model without such modules.
    """
    layers = moe_layers(model_parts)
    shared: dict[str, torch.Tensor] = {}
    for part in model_parts:
        shared.update(getattr(part, _OTHER_STAGES_ROWS, None) or {})
        if _OTHER_STAGES_ROWS in vars(part):
            delattr(part, _OTHER_STAGES_ROWS)
    others = [module for part in model_parts for module in part.modules() if isinstance(module, StepStatistics)]
    if not layers and not shared and not others:
        return {}, []
    keyed = [(key, _stat_row(layer)) for key, layer in layers]
    for _, layer in layers:
        layer.reset_stats()
    keyed += [(key, row) for key, row in shared.items() if key not in dict(layers)]
    order = sorted(range(len(keyed)), key=lambda i: int(keyed[i][0]) if keyed[i][0].isdigit() else 0)
    rows = [keyed[i][1] for i in order]
    keys = [keyed[i][0] for i in order]
    extra = [torch.tensor(module.read_stats(), dtype=torch.float64) for module in others]
    width = rows[0].numel() if rows else 0
    device = next((t.device for part in model_parts for t in part.parameters()), torch.device("cpu"))
    flat = torch.cat([*(row for row in rows), *extra]) if rows or extra else torch.zeros(0, dtype=torch.float64)
    reduced_flat = reduce_mean(flat.to(device)).cpu()
    reduced = reduced_flat[:width * len(rows)].view(len(rows), width)
    metrics: dict[str, float] = {}
    offset = width * len(rows)
    for module, values in zip(others, extra, strict=True):
        read_back = reduced_flat[offset:offset + values.numel()].tolist()
        for name, value in zip(module.stat_names(), read_back, strict=True):
            metrics[name] = value
        offset += values.numel()
    if not rows:
        return metrics, []
    for key, row in zip(keys, reduced, strict=True):
        load = row[:-3]
        metrics[f"moe/max_load/{key}"] = float(load.max() / load.mean()) if float(load.sum()) > 0 else 1.0
    position = {index: place for place, index in enumerate(order)}
    loads = [reduced[position[index], :-3] for index in range(len(layers))]  # this rank's layers, in order
    metrics["moe/aux_loss"] = float(reduced[:, -2].mean())
    metrics["moe/z_loss"] = float(reduced[:, -1].mean())
    metrics["moe/max_load"] = max(v for k, v in metrics.items() if k.startswith("moe/max_load/"))
    metrics["moe/dropped"] = float(reduced[:, -3].sum())
    return metrics, loads


def update_router_biases(model_parts: Sequence[nn.Module], loads: Sequence[torch.Tensor]) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each layer's selection bias
    moves by `bias_update_rate` towards under-loaded experts (sign(mean load - load)). `loads` come from
    `collect_moe_stats` (the same on every data-parallel rank, so the biases stay replicated)."""
    for (_, layer), load in zip(moe_layers(model_parts), loads):
        if layer.bias_update_rate > 0:
            with torch.no_grad():
                step = layer.bias_update_rate * torch.sign(load.mean() - load)
                layer.expert_bias.add_(step.to(layer.expert_bias.device, layer.expert_bias.dtype))
