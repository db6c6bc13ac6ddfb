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
the global norm and `full_state_dict` gathers the unsharded weights. This file is the plan
(`apply_tensor_parallel`); the gradients, the initialization and the `strategy=tp` class are in
`tensor_parallel.py`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.placement_types import Placement
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.models.common import StreamDropout
from trainer.models.moe import MoE


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
    # Llama: (x, rope, doc_ids); GPT: (x, doc_ids) (doc_ids: None without document masking)
    attention_inputs = (residual, None, None) if hasattr(block.attention, "wq") else (residual, None)
    feed_forward: ParallelStyle = PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),))
    if isinstance(block.feed_forward, MoE):
        # A Mixture of Experts runs whole on every tp rank (its weights replicated, `_replicate_moe`) on the
        # all-gathered sequence, as plain tensors; its output goes back to the residual layout (a local
        # slice under sequence parallelism, whose backward all-gathers the output gradient).
        feed_forward = PrepareModuleInputOutput(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(residual,), use_local_output=not sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        # all-gather of the sequence-sharded normed input before the column-parallel projections
        "attention": PrepareModuleInput(input_layouts=attention_inputs,
                                        desired_input_layouts=(Replicate(),) + attention_inputs[1:]),
        "feed_forward": feed_forward,
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


def _replicate_moe(block: nn.Module, mesh: DeviceMesh) -> None:
    """Every weight of a block's MoE (router, experts, shared experts) becomes a Replicate DTensor on the tp
    mesh: each rank computes the whole layer on the same tokens, so their gradients agree without a
    reduction, and every parameter is a DTensor (gradient clipping refuses a mix). The layer multiplies
    with the local values."""
    moe = block.feed_forward
    if not isinstance(moe, MoE):
        return
    for module in moe.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


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
    if tp_mesh.device_type == "cpu":
        # DTensor cautions that its random ops lack full support on a CPU mesh; the random draws of split
        # activations here come from our own per-rank streams (`_give_split_dropout_own_streams`) and the
        # sharded init draws its own seeds (`materialize_tensor_parallel`), so the caution does not apply.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
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
        _replicate_moe(block, tp_mesh)
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
