"""Tensor parallelism (Megatron-LM style) on DTensor, with sequence parallelism and a vocab-parallel loss.

Every transformer block is split over the `tp` ranks of the mesh (Shoeybi et al. 2019, "Megatron-LM"):

- attention by heads: the query/key/value projections column-parallel, the output projection wo
  row-parallel. Llama's separate wq/wk/wv give each rank n_heads/tp query heads and n_kv_heads/tp
  key/value heads (grouped-query attention keeps its grouping locally); GPT's fused wqkv is laid out head
  by head ([n_heads, 3, head_dim], Megatron's layout), so its contiguous row split gives each rank whole
  heads with their q, k and v;
- the MLP column- then row-parallel: Llama's SwiGLU w1/w3 and GPT's GELU w1 column-parallel, w2
  row-parallel. Column-parallel biases are split with their rows; row-parallel biases are replicated and
  added once, after the reduction;
- with `sequence_parallel` (Korthikanti et al. 2022), the norms, the dropouts and the residual stream
  between blocks are sharded on the sequence dimension: the all-reduce after wo/w2 becomes a
  reduce-scatter and the input of attention/MLP an all-gather (same bytes moved, activation memory of
  norms, dropouts and residuals / tp);
- the token embedding is split on the vocabulary (row-parallel lookup, masked on each rank and summed)
  and the output head on the vocabulary (column-parallel); with `loss_parallel` the logits stay sharded
  on the vocabulary and the cross entropy runs on the shards (`trainer.loss.cross_entropy_loss`), which
  never materializes the full [batch, seq, vocab] logits on one rank. GPT's learned position table is
  replicated (small: max_seq_len x dim) and its lookup sliced to the residual layout.
- dropout of what is split across ranks (attention probabilities of each rank's heads; sequence shards)
  draws from a per-rank random stream (`trainer.models.common.rng_stream`, Megatron's model-parallel RNG
  tracker); dropout of replicated activations stays on the shared stream, identical on every rank.

Every parameter becomes a DTensor on the `tp` mesh (sharded or replicated), so gradient clipping sees
the global norm and `full_state_dict` gathers the unsharded weights.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.placement_types import Placement
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.plugins.activation_checkpointing import ActivationCheckpointing
from trainer.plugins.precision import Precision
from trainer.plugins.strategies.distributed import DistributedStrategy
from trainer.models.common import StreamDropout


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters over the mesh; its input stays a plain tensor, and so does its
    output unless `output_layout` asks for a DTensor in that layout (a local slice: Replicate to Shard
    needs no communication).

    Used for the norms when sequence parallelism is off: their input is the full (replicated) residual
    stream, so each rank computes them whole. Making their weights Replicate DTensors anyway keeps every
    parameter a DTensor, so torch's gradient clipping and the optimizer never mix plain and distributed
    tensors (which they refuse). Also GPT's position table, whose lookup joins the residual stream.
    """

    def __init__(self, output_layout: Placement | None = None) -> None:
        super().__init__()
        self.output_layout = output_layout

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        del name
        for param_name, param in list(module.named_parameters(recurse=False)):
            # from_local, not distribute_tensor: every rank already holds the same values (full init or
            # ones), and on the meta device there is nothing to broadcast.
            replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))

    @staticmethod
    def _to_replicated(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        del module
        first, *rest = inputs
        if not isinstance(first, DTensor):
            first = DTensor.from_local(first, mesh, [Replicate()], run_check=False)
        return (first, *rest)

    def _to_output_layout(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        del module
        if not isinstance(output, DTensor):
            return output
        if self.output_layout is None:
            return output.to_local()
        return output.redistribute(mesh, [self.output_layout])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._to_replicated,
                                 self._to_output_layout)


# Submodule names of the blocks of each family, by parallel style.
COLUMN_PARALLEL = ("attention.wq", "attention.wk", "attention.wv", "attention.wqkv", "feed_forward.w1",
                   "feed_forward.w3")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The parallel style of each submodule of one transformer block (Llama or GPT)."""
    # With sequence parallelism the residual stream is a DTensor sharded on the sequence (dim 1); it is
    # kept as a DTensor (use_local_output=False) so that its shape stays global: the Llama reads the
    # sequence length from it to slice the RoPE table.
    residual = Shard(1) if sequence_parallel else Replicate()
    attention_inputs = (residual, None) if hasattr(block.attention, "wq") else (residual,)  # Llama: (x, rope)
    plan: dict[str, ParallelStyle] = {
        # all-gather of the sequence-sharded normed input before the column-parallel projections
        "attention": PrepareModuleInput(input_layouts=attention_inputs,
                                        desired_input_layouts=(Replicate(),) + attention_inputs[1:]),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
    }
    present = {name for name, _ in block.named_modules()}
    # heads split (and the MLP's hidden width): each rank computes its columns
    plan.update({name: ColwiseParallel() for name in COLUMN_PARALLEL if name in present})
    # partial sums over heads / hidden units: reduce-scatter to the sequence shards (SP) or all-reduce
    plan.update({name: RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel)
                 for name in ROW_PARALLEL if name in present})
    norm_style: ParallelStyle = SequenceParallel() if sequence_parallel else ReplicateParallel()
    plan["attention_norm"] = norm_style
    plan["ffn_norm"] = norm_style
    return plan


def _check_splittable(model: nn.Module) -> None:
    for name, block in model.layers.items():  # type: ignore[union-attr]
        attention = getattr(block, "attention", None)
        projections = [p for p in ("wq", "wk", "wv", "wqkv", "wo") if hasattr(attention, p)]
        if projections not in (["wq", "wk", "wv", "wo"], ["wqkv", "wo"]):
            raise TypeError(
                f"tensor parallelism needs wq/wk/wv/wo (Llama) or a head-major wqkv + wo (GPT) projections; "
                f"layer {name} of {type(model).__name__} has {type(attention).__name__}"
            )


def _give_split_dropout_own_streams(model: nn.Module, tp_rank: int, sequence_parallel: bool) -> None:
    """Per-rank random streams for the dropout of split activations (see `rng_stream`): the attention
    core always (each rank holds its own heads), the residual dropouts when they see sequence shards."""
    for module in model.modules():
        if hasattr(module, "rng_stream") and (not isinstance(module, StreamDropout) or sequence_parallel):
            module.rng_stream = tp_rank + 1


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
                          loss_parallel: bool = True) -> None:
    """Shard `model` (a Llama or one of its pipeline stages) in place over the 1-D mesh `tp_mesh`.

    Works on a materialized model (weights already identical on every rank: each rank keeps its shard)
    and on a meta model (the DTensor parameters are materialized and initialized afterwards with
    `to_empty` + `init_weights`). With `loss_parallel` the logits are a DTensor sharded on the vocabulary
    (Shard(-1)); `trainer.loss.cross_entropy_loss` computes the loss on the shards. Otherwise they are
    gathered into a plain tensor.

    Works for the Llama and GPT families. Pipeline stages (modules set to None) are supported. A stage's hidden-state input and output are
    plain full tensors [B, S, dim], identical on the tp ranks, whatever `sequence_parallel` is, so the
    pipeline sends the same shapes with and without tensor parallelism.
    """
    _check_splittable(model)
    residual = Shard(1) if sequence_parallel else Replicate()
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)

    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        # vocab-parallel lookup: rows Shard(0), out-of-range ids masked, partial sums reduced to the residual
        # layout (reduce-scatter with SP, all-reduce without)
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                                 use_local_output=not sequence_parallel)
    if getattr(model, "pos_embeddings", None) is not None:
        # replicated table; the lookup ([1, S, dim]) is sliced to the sequence shards under SP
        plan["pos_embeddings"] = ReplicateParallel(output_layout=residual if sequence_parallel else None)
    if model.norm is not None:
        plan["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    if model.output is not None:
        # weight Shard(0) on the vocabulary; the sequence-sharded input is all-gathered first
        plan["output"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():  # type: ignore[union-attr]
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
    _give_split_dropout_own_streams(model, tp_mesh.get_local_rank(), sequence_parallel)

    if tied:
        # parallelize_module replaced tok_embeddings.weight by a new DTensor parameter and distributed
        # output.weight separately; both are [vocab, dim] sharded Shard(0) on the same mesh, so one
        # parameter serves both again (its gradient sums the lookup's and the head's contributions).
        model.output.weight = model.tok_embeddings.weight

    if sequence_parallel:
        # Stage boundaries of a pipeline carry full replicated hidden states (see the docstring): a later
        # stage slices its sequence shard locally (no communication) and a non-final stage all-gathers
        # its output sequence.
        if model.tok_embeddings is None:
            parallelize_module(model, tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False))
        if model.output is None:
            parallelize_module(model, tp_mesh, PrepareModuleOutput(
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))


def settle_tensor_parallel_grads(model_parts: Sequence[nn.Module]) -> None:
    """Bring every DTensor gradient to its parameter's placements, once per optimizer step.

    Under sequence parallelism the norms' weights get Partial(sum) gradients (each rank summed over its
    own sequence shard). That is correct, and DTensor would reduce them lazily, but then every consumer
    (the norm for clipping, then the optimizer) would pay the all-reduce again; here it is paid once.
    (The embedding's Replicate gradient is sliced as it is produced, by `keep_grads_in_param_layout`;
    anything left in another layout is converted here too.) Call it before computing the gradient norm;
    a combined strategy whose `clip_grad_norm` does not reach this class's should call it itself. Skipping
    it costs time, not correctness.
    """
    for part in model_parts:
        for param in part.parameters():
            grad = param.grad
            if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
                param.grad = grad.redistribute(param.device_mesh, param.placements)


def keep_grads_in_param_layout(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Convert, as autograd produces them, gradients that reach a tp-sharded parameter replicated.

    The vocab-parallel embedding's backward yields a full-size Replicate gradient for its Shard(0)
    weight; slicing it to the parameter's shard is local (no communication), so doing it per backward
    keeps a single full-vocabulary gradient from being accumulated over the micro-batches, and makes the
    stored gradient match its parameter's shape on every rank (which a pipeline's all-reduce of the tied
    embedding/head gradient between stages relies on). Partial gradients need an all-reduce and are left
    to `settle_tensor_parallel_grads`, once per step.

    Register after materialization: `to_empty` swaps parameter storage and drops tensor hooks.
    Parameters managed by FSDP (on a larger mesh) are skipped: FSDP redistributes their gradients itself.
    """

    def make_hook(param: DTensor) -> Any:
        def to_param_layout(grad: torch.Tensor) -> torch.Tensor:
            if (isinstance(grad, DTensor) and grad.placements != param.placements
                    and not any(p.is_partial() for p in grad.placements)):
                return grad.redistribute(param.device_mesh, param.placements)
            return grad
        return to_param_layout

    seen: set[int] = set()
    for param in model.parameters():
        if (id(param) not in seen and isinstance(param, DTensor) and param.requires_grad
                and param.device_mesh == tp_mesh and any(p.is_shard() for p in param.placements)):
            seen.add(id(param))
            param.register_hook(make_hook(param))


def _divisibility_problems(model_cfg: Any, tp: int) -> list[str]:
    sizes = [("model.n_heads", model_cfg.n_heads, "query heads")]
    if hasattr(model_cfg, "num_kv_heads"):  # GPT has as many key/value heads as query heads
        sizes.append(("model.n_kv_heads", model_cfg.num_kv_heads, "key/value heads"))
    sizes.append(("model.ffn_hidden_dim", model_cfg.hidden_dim, "MLP hidden width"))
    problems = [f"{key}={value} ({what}) is not divisible by tp={tp}" for key, value, what in sizes if value % tp]
    if model_cfg.vocab_size % tp:
        # Not padded silently (it changes the model and its checkpoints); Megatron-LM pads to 128 x tp.
        multiple = 128 * tp
        padded = -(-model_cfg.vocab_size // multiple) * multiple
        problems.append(f"model.vocab_size={model_cfg.vocab_size} (vocabulary rows) is not divisible by tp={tp} "
                        f"(pad it: model.vocab_size={padded}, a multiple of 128 x tp)")
    return problems


def _dtensor_rng_supported(mesh: DeviceMesh) -> bool:
    from torch.distributed.tensor._random import is_rng_supported_mesh

    with warnings.catch_warnings():  # it warns on every call for the CPU
        warnings.simplefilter("ignore")
        return is_rng_supported_mesh(mesh)


class TensorParallel(DistributedStrategy):
    """Tensor parallelism over all ranks (tp = world size): every rank sees the whole batch and holds
    1/tp of each block's weights.

    Composable: `apply_model_parallel` shards each part it is given (a pipeline stage as well as the
    whole model) and calls `super()` first, so a `class ThreeD(PipelineParallel, TensorParallel)` gets
    the pipeline split, then TP, then the data-parallel wrapping of the base `setup_model`. Gradients
    are brought to their parameters' layouts in `clip_grad_norm` (`settle_tensor_parallel_grads`); a
    combined strategy whose norm comes from another base should call that function first.
    """

    name = "tp"
    uses_tp = True
    uses_dp = False

    def __init__(self, sequence_parallel: bool = True, loss_parallel: bool = True, init: str = "auto",
                 name: str | None = None, **kwargs: Any) -> None:
        # **kwargs: options of the other bases of a combined strategy, passed along the MRO
        super().__init__(init=init, name=name, **kwargs)
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel

    @classmethod
    def check_tensor_parallel(cls, model_cfg: Any, tp: int, seq_len: int, sequence_parallel: bool = True) -> None:
        """Raise ValueError (one line) when `model_cfg` cannot be split over `tp` ranks.

        Called by `trainer.config` before any process starts. Sizes are not padded: tp must divide the
        query heads, the key/value heads, the MLP hidden width and the vocabulary (and, with sequence
        parallelism, the sequence length).
        """
        uses_other = cls.uses_dp or cls.uses_pp  # a combined strategy may legitimately run with tp=1
        if tp == 1 and not uses_other:
            raise ValueError(f"strategy={cls.name} needs tp >= 2 (tp=1 splits nothing): e.g. tp=2 "
                             "trainer.devices=2, or strategy=single for one process")
        if tp == 1:
            return
        problems = _divisibility_problems(model_cfg, tp)
        if sequence_parallel and seq_len % tp:
            problems.append(f"trainer.seq_len={seq_len} (sequence parallelism) is not divisible by tp={tp}")
        if problems:
            raise ValueError(f"cannot split model {model_cfg.name} over tp={tp} ranks: " + "; ".join(problems))

    def apply_model_parallel(self, model: nn.Module) -> None:
        super().apply_model_parallel(model)
        if self.dims.tp_enabled:
            apply_tensor_parallel(model, self.dims.mesh["tp"], sequence_parallel=self.sequence_parallel,
                                  loss_parallel=self.loss_parallel)

    def setup_model(self, model: nn.Module, activation_checkpointing: ActivationCheckpointing,
                    precision: Precision, compile: bool) -> list[nn.Module]:
        parts = super().setup_model(model, activation_checkpointing, precision, compile)
        if self.dims.tp_enabled:
            for part in parts:  # after materialization, which drops tensor hooks
                keep_grads_in_param_layout(part, self.dims.mesh["tp"])
        return parts

    def materialize(self, model: nn.Module) -> None:
        """Allocate and initialize the weights: the whole model before TP (init=full, bitwise the
        single-process weights), or only this rank's shards after it (init=sharded, auto for big models).

        For the sharded case on CUDA, DTensor's offset-based RNG gives each shard its slice of the
        single-process random stream. Devices without it (the CPU) would draw the same values on every tp
        rank, so every rank's heads would start, and stay, identical copies of each other; there each tp
        rank draws from its own seed instead (not the single-process weights: use init=full for those),
        and replicated parameters are then made equal by a broadcast from the first tp rank.
        """
        tp_mesh = self.dims.mesh["tp"] if self.dims.tp_enabled else None
        # the full init (before TP) draws the whole model, like one process: nothing to change there
        sharded = tp_mesh is not None and any(isinstance(p, DTensor) for p in model.parameters())
        if not sharded or _dtensor_rng_supported(tp_mesh):
            super().materialize(model)
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch.initial_seed() + 1 + tp_mesh.get_local_rank())
            super().materialize(model)
        group = tp_mesh.get_group()
        with torch.no_grad():
            for param in model.parameters():
                if isinstance(param, DTensor) and param.device_mesh == tp_mesh and all(
                        p.is_replicate() for p in param.placements):
                    dist.broadcast(param.to_local(), src=dist.get_global_rank(group, 0), group=group)

    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        settle_tensor_parallel_grads(model_parts)
        return super().clip_grad_norm(model_parts, max_norm)


@dataclass
class TensorParallelConfig:
    """Schema of `strategy=tp`: tensor parallelism over `tp` = trainer.devices x trainer.num_nodes ranks."""

    _target_: str = "trainer.plugins.strategies.tensor_parallel.TensorParallel"
    # Name in logs and summaries.
    name: str = "tp"
    # Shard norms and the residual stream on the sequence (activation memory / tp; reduce-scatter +
    # all-gather instead of all-reduce). Needs tp to divide trainer.seq_len.
    sequence_parallel: bool = True
    # Keep the logits sharded on the vocabulary and compute the cross entropy on the shards.
    loss_parallel: bool = True
    # Weight initialization: auto (full when the fp32 weights fit in 4 GiB), full (every rank builds the
    # whole model, bitwise the single-process weights, then keeps its shard) or sharded (each rank
    # initializes only its shards; for big models).
    init: str = "auto"
