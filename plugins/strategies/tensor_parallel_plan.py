"""Tensor parallelism (Megatron-LM style) on DTensor, with sequence parallelism and a vocab-parallel loss.

Every transformer block is split over the `tp` ranks of the mesh (Shoeybi et al. 2019, "Megatron-LM"). The
model's family declares which submodule has which role (`ModelFamily.block_split`, a `BlockSplit`); this
file maps the roles to DTensor styles and never names a model's attributes:

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
- what every head reads is computed whole on each rank (`BlockSplit.replicated`: DeepSeek-V3's low-rank
  latents), and per-head norms (`BlockSplit.head_norms`: Qwen3's q/k RMSNorm) run on each rank's heads
  with their shared gain's gradient summed over the ranks;
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
from trainer.interfaces.model_family import BlockSplit
from trainer.models import family_of


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


def _block_plan(split: BlockSplit, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The parallel style of each submodule of one transformer block, from the roles its family declares."""
    # With sequence parallelism the residual stream is a DTensor sharded on the sequence (dim 1); it is
    # kept as a DTensor (use_local_output=False) so that its shape stays global: the Llama reads the
    # sequence length from it to slice the RoPE table.
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for name, num_args in split.sublayers.items():
        # all-gather of the sequence-sharded normed input before the column-parallel projections; the
        # other arguments (RoPE table, document ids) pass untouched
        inputs = (residual,) + (None,) * (num_args - 1)
        plan[name] = PrepareModuleInput(input_layouts=inputs, desired_input_layouts=(Replicate(),) + inputs[1:])
    for name in split.replicated_sublayers:
        # A Mixture of Experts runs whole on every tp rank (its weights replicated, `_replicate_whole`) on the
        # all-gathered sequence, as plain tensors; its output goes back to the residual layout (a local
        # slice under sequence parallelism, whose backward all-gathers the output gradient).
        plan[name] = PrepareModuleInputOutput(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(residual,), use_local_output=not sequence_parallel)
    # heads split (and the MLP's hidden width): each rank computes its columns
    plan.update({name: ColwiseParallel() for name in split.column})
    # partial sums over heads / hidden units: reduce-scatter to the sequence shards (SP) or all-reduce
    plan.update({name: RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel)
                 for name in split.row})
    # latents every head reads (low-rank down-projections and their norms): whole on every rank
    plan.update({name: ReplicateParallel() for name in split.replicated})
    # per-head norms see this rank's heads (dim 2 of [B, S, heads, head_dim]): as a sequence-parallel norm
    # over the head dimension, the shared gain's gradient is summed over the tp ranks
    plan.update({name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in split.head_norms})
    norm_style: ParallelStyle = SequenceParallel() if sequence_parallel else ReplicateParallel()
    plan.update({name: norm_style for name in split.residual_norms})
    return plan


def _replicate_whole(block: nn.Module, split: BlockSplit, mesh: DeviceMesh) -> None:
    """Every weight of a block's whole-computed sub-layers (an MoE's router, experts, shared experts)
    becomes a Replicate DTensor on the tp mesh: each rank computes the whole layer on the same tokens, so
    their gradients agree without a reduction, and every parameter is a DTensor (gradient clipping refuses a
    mix). The layer multiplies with the local values."""
    for name in split.replicated_sublayers:
        for module in block.get_submodule(name).modules():
            for param_name, param in list(module.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    continue
                replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
                module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _give_split_dropout_own_streams(model: nn.Module, tp_rank: int, sequence_parallel: bool) -> None:
    """Per-rank random streams for the dropout of split activations (see `rng_stream`): the attention
    core always (each rank holds its own heads), the residual dropouts when they see sequence shards."""
    for module in model.modules():
        if hasattr(module, "rng_stream") and (not isinstance(module, StreamDropout) or sequence_parallel):
            module.rng_stream = tp_rank + 1


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
                          loss_parallel: bool = True) -> None:
    """Shard `model` (or one of its pipeline stages) in place over the 1-D mesh `tp_mesh`.

    Works on a materialized model (weights already identical on every rank: each rank keeps its shard)
    and on a meta model (the DTensor parameters are materialized and initialized afterwards with
    `to_empty` + `init_weights`). With `loss_parallel` the logits are a DTensor sharded on the vocabulary
    (Shard(-1)); `trainer.loss.cross_entropy_loss` computes the loss on the shards. Otherwise they are
    gathered into a plain tensor.

    Works for every family that declares its blocks' split. Pipeline stages (modules set to None) are
    supported. A stage's hidden-state input and output are
    plain full tensors [B, S, dim], identical on the tp ranks, whatever `sequence_parallel` is, so the
    pipeline sends the same shapes with and without tensor parallelism.
    """
    if tp_mesh.device_type == "cpu":
        # DTensor cautions that its random ops lack full support on a CPU mesh; the random draws of split
        # activations here come from our own per-rank streams (`_give_split_dropout_own_streams`) and the
        # sharded init draws its own seeds (`materialize_tensor_parallel`), so the caution does not apply.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    family = family_of(model)
    # the family's declaration of each block; ValueError before anything is split if one cannot be
    splits = [(block, family.block_split(block)) for block in family.tensor_parallel_blocks(model)]
    residual = Shard(1) if sequence_parallel else Replicate()
    ends = family.stage_modules(model)
    embedding, head = family.tied_weights(model)
    tied = embedding is not None and head is embedding

    plan: dict[str, ParallelStyle] = {}
    if ends.embedding is not None:
        # vocab-parallel lookup: rows Shard(0), out-of-range ids masked, partial sums reduced to the residual
        # layout (reduce-scatter with SP, all-reduce without)
        plan[ends.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                               use_local_output=not sequence_parallel)
    if ends.positions is not None:
        # replicated table; the lookup ([1, S, dim]) is sliced to the sequence shards under SP
        plan[ends.positions] = ReplicateParallel(output_layout=residual if sequence_parallel else None)
    if ends.final_norm is not None:
        plan[ends.final_norm] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    # other modules on the residual stream (a multi-token-prediction module's norms and projection)
    plan.update({name: SequenceParallel() if sequence_parallel else ReplicateParallel() for name in ends.residual_norms})
    plan.update({name: ReplicateParallel(output_layout=residual if sequence_parallel else None)
                 for name in ends.residual_linears})
    if ends.head is not None:
        # weight Shard(0) on the vocabulary; the sequence-sharded input is all-gathered first
        plan[ends.head] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for block, split in splits:
        parallelize_module(block, tp_mesh, _block_plan(split, sequence_parallel))
        _replicate_whole(block, split, tp_mesh)
        for name in split.head_groups:
            block.get_submodule(name).head_group = tp_mesh.get_group()
    _give_split_dropout_own_streams(model, tp_mesh.get_local_rank(), sequence_parallel)

    if tied:
        # parallelize_module replaced the embedding's weight by a new DTensor parameter and distributed the
        # head's separately; both are [vocab, dim] sharded Shard(0) on the same mesh, so one parameter
        # serves both again (its gradient sums the lookup's and the head's contributions).
        assert ends.embedding is not None and ends.head is not None
        model.get_submodule(ends.head).weight = model.get_submodule(ends.embedding).weight

    if sequence_parallel:
        # Stage boundaries of a pipeline carry full replicated hidden states (see the docstring): a later
        # stage slices its sequence shard locally (no communication) and a non-final stage all-gathers
        # its output sequence.
        if ends.hidden_states_in:
            parallelize_module(model, tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False))
        if ends.head is None:
            parallelize_module(model, tp_mesh, PrepareModuleOutput(
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
