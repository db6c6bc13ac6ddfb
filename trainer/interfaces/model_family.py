"""The model-family interface: everything the strategies, the activation checkpointing, the planner, the
Hugging Face converter and the loop need to know about a model, declared by the family in one place.

A family is one folder of trainer/models (model and config, `family.py` declaring this contract,
`hf_adapter.py`, `planner.py`) registered in `trainer.models.FAMILIES`. No strategy, planner or converter
module names a model's attributes: they ask the family (`trainer.models.family_of(model or config)`).
The hooks with a body are the defaults of a family without that feature (no experts, no per-step
statistics, no tensor-parallel restrictions); `trainer.models.decoder.DecoderFamily` implements the rest
for the decoder layout the project's families share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from trainer.interfaces.hf_adapter import HFAdapter
from trainer.interfaces.inventory import ModelInventory


@dataclass(frozen=True)
class BlockSplit:
    """How one transformer block splits over the tensor-parallel ranks (Megatron-LM's layout), by the role
    of its submodules (names relative to the block).

    The strategy maps roles to DTensor parallel styles; the family only says which submodule has which.
    """

    # Linears whose output features split: the query/key/value heads, the MLP's hidden units.
    column: tuple[str, ...] = ()
    # Linears whose input features split: partial sums reduced into the residual stream (wo, w2).
    row: tuple[str, ...] = ()
    # Norms on the residual stream: sequence-sharded under sequence parallelism, replicated otherwise.
    residual_norms: tuple[str, ...] = ()
    # Sub-layers fed the (normed) residual stream, with their positional argument count: the first
    # argument is gathered to the full sequence before it, the others (positions, document ids) pass as is.
    sublayers: dict[str, int] = field(default_factory=dict)
    # Sub-layers computed whole on every tp rank on the gathered sequence (a Mixture of Experts): weights
    # replicated, plain tensors in and out, output returned to the residual layout.
    replicated_sublayers: tuple[str, ...] = ()
    # Modules inside a split sub-layer that see every head or the full width on each rank (low-rank
    # down-projections and their norms, e.g. MLA's wq_a/wkv_a): weights replicated, computed on local tensors.
    replicated: tuple[str, ...] = ()
    # Per-head norms applied to each rank's own heads (Qwen3's q/k RMSNorm): weights replicated, their
    # gradients summed over the tp ranks (each rank's heads contribute a part).
    head_norms: tuple[str, ...] = ()
    # Modules holding a tensor that every head uses, computed whole on each rank (MLA's rotary key): their
    # `head_group` attribute is set to the tp group, over which they sum that tensor's gradient.
    head_groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageModules:
    """The top-level modules of a model (or of one pipeline stage), by role; None where the stage lacks
    one (`split` set it to None)."""

    embedding: Optional[str]  # token lookup (vocab-parallel under tp)
    positions: Optional[str]  # learned position table (GPT): replicated under tp
    final_norm: Optional[str]  # on the residual stream
    head: Optional[str]  # the output projection (vocab-parallel under tp)
    # Other top-level modules on the residual stream (DeepSeek-V3's multi-token-prediction module): norms
    # (sequence-sharded under sequence parallelism, replicated otherwise) and linears computed whole on
    # every rank whose input and output are the residual stream.
    residual_norms: tuple[str, ...] = ()
    residual_linears: tuple[str, ...] = ()
    # Whether the stage's input is the previous stage's hidden states (every pipeline stage but the first,
    # whatever copies of first-stage modules it holds), not token ids.
    hidden_states_in: bool = False


@dataclass(frozen=True)
class QKClipAttention:
    """One attention layer as QK-clip (MuonClip, `trainer.models.qk_clip`) sees it: the module whose forward
    gets the rotated queries and keys (`[B, H, S, D]`, a `CoreAttention`: it records each head's largest
    logit), and the projections whose rows make them (heads x head_dim rows, this rank's heads under tp)."""

    core: nn.Module
    query: torch.Tensor
    key: torch.Tensor
    head_dim: int


class ModelFamily:
    """The contract of a model family. Subclasses set `name`, `config_class`, `model_class` and
    `hf_adapter`, and implement the hooks without a default body."""

    name: str
    config_class: type
    model_class: type
    hf_adapter: Optional[HFAdapter] = None

    # ---- building ---------------------------------------------------------------------------------
    def build_meta_model(self, config: Any) -> nn.Module:
        """The model for `config` on the meta device (no memory); materialize with `to_empty` and
        `init_weights`."""
        with torch.device("meta"):
            return self.model_class(config)

    # ---- structure: pipeline split points, checkpointing and sharding units -------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        """The repeated blocks in layer order, keyed by their global layer index (a pipeline stage keeps
        its own keys): the pipeline's split points, the activation-checkpointing units, the FSDP units."""
        raise NotImplementedError

    def num_layers(self, model: nn.Module) -> int:
        """The whole model's number of blocks (a pipeline stage holds fewer)."""
        return len(self.blocks(model))

    def set_block(self, model: nn.Module, key: str, block: Optional[nn.Module]) -> None:
        """Replace block `key` (checkpoint wrapper), or remove it when `block` is None (a pipeline stage)."""
        blocks = self.blocks(model)
        if block is None:
            del blocks[key]
        else:
            blocks[key] = block

    def stage_only_modules(self, model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(names held by the first pipeline stage only, names held by the last stage only)."""
        raise NotImplementedError

    def stage_modules(self, model: nn.Module) -> StageModules:
        """The model's (or stage's) top-level modules by role."""
        raise NotImplementedError

    def end_stage_copies(self, model: nn.Module) -> tuple[str, ...]:
        """Names among the first stage's modules (`stage_only_modules`) that the last pipeline stage holds a
        copy of too (DeepSeek-V3's embedding, which its multi-token prediction reads): the pipeline keeps the
        copies equal (`shared_end_weights`). None by default."""
        del model
        return ()

    def tensor_parallel_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The blocks tensor parallelism splits (each by `block_split`): the pipeline's blocks, plus blocks
        outside them (DeepSeek-V3's multi-token-prediction blocks)."""
        return list(self.blocks(model).values())

    def tied_weights(self, model: nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(embedding weight, head weight) this model or stage holds (None for the one it lacks); for the
        whole model the two are the same tensor when the family ties them."""
        raise NotImplementedError

    def shared_end_weights(self, model: nn.Module, *, last: bool) -> list[torch.Tensor]:
        """The parameters of which the first and the last pipeline stage each hold a copy, as the first
        (`last=False`) or the last stage (`last=True`) holds them, in matching order: an output head tied to
        the embedding (the first stage's embedding table, the last stage's head), the parameters of
        `end_stage_copies`. The pipeline broadcasts them from the first stage at setup and sums their
        gradients over the two stages. On the whole model both calls give the same tensors; empty when the
        ends share nothing (the default)."""
        del model, last
        return []

    # ---- tensor parallelism ---------------------------------------------------------------------------
    def block_split(self, block: nn.Module) -> BlockSplit:
        """How `block` splits over the tp ranks (ValueError if it cannot)."""
        raise NotImplementedError

    def tensor_parallel_sizes(self, config: Any) -> list[tuple[str, int, str]]:
        """(config key, size, what) of each dimension tp must divide (heads, hidden width, ...)."""
        raise NotImplementedError

    def unsupported_parallelism(self, config: Any, *, tp: int, pp: int, cp: int) -> Optional[tuple[str, str]]:
        """(config key, why) of a parallel layout this family cannot run, else None."""
        del config, tp, pp, cp
        return None

    def unsupported_planning(self, config: Any) -> Optional[tuple[str, str]]:
        """(config key, why) when the planner cannot describe this model (the run may still train it)."""
        del config
        return None

    # ---- experts ------------------------------------------------------------------------------------
    def expert_layers(self, model_parts: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
        """(layer key, Mixture-of-Experts layer) of every such layer, in layer order: expert parallelism
        splits their `experts`, FSDP shards those as their own units. A dense family has none."""
        del model_parts
        return []

    # ---- per-step hooks ---------------------------------------------------------------------------
    def step_statistics(self, model_parts: Sequence[nn.Module],
                        reduce_mean: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[str, float], Any]:
        """Read (and clear) what the step's forwards accumulated (router loads, auxiliary losses), averaged
        over the data-parallel ranks with `reduce_mean` (a collective every rank calls, once): the metrics
        to log, and a state handed to `after_optimizer_step`. Called once per step after the backward."""
        del model_parts, reduce_mean
        return {}, None

    def after_optimizer_step(self, model_parts: Sequence[nn.Module], state: Any) -> None:
        """After an optimizer step that updated the weights (not a skipped one): e.g. router bias updates."""
        del model_parts, state

    def sum_statistics_over_stages(self, model_parts: Sequence[nn.Module],
                                   all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Under pipeline parallelism, on every pp rank after each training step's schedule (before
        `step_statistics`): statistics that one stage accumulates for the whole model (DeepSeek-V3's MTP
        losses, on the last stage) summed over the stages, so that every rank, the logging one included,
        reports them. `all_reduce_sum` returns a tensor's sum over the pp ranks (a collective: every rank
        calls it alike). Nothing by default."""
        del model_parts, all_reduce_sum

    # ---- QK-clip (MuonClip) ---------------------------------------------------------------------------
    def unsupported_qk_clip(self, config: Any) -> Optional[str]:
        """Why QK-clip (`optimizer.qk_clip_tau`) cannot act on this model, else None (validation's one line).
        Default: not implemented for the family."""
        del config
        return f"QK-clip is not implemented for the {self.name} family"

    def qk_clip_attention(self, model: nn.Module) -> list[tuple[str, QKClipAttention]]:
        """(layer key, attention) of every attention layer this model or pipeline stage holds, in layer
        order; only called when `unsupported_qk_clip` is None. Empty by default (`QKClip` refuses a model
        part without any)."""
        del model
        return []

    # ---- pipeline stages ------------------------------------------------------------------------------
    def carry_into_stage(self, model: nn.Module, carried: tuple[torch.Tensor, ...]) -> None:
        """Under pipeline parallelism, before every forward of a stage (`model`), metadata inference
        included: what the previous stage's forward passed on beside the hidden states (its
        `carry_out_of_stage`), empty on the first stage. Nothing by default."""
        del model, carried

    def carry_out_of_stage(self, model: nn.Module) -> tuple[torch.Tensor, ...]:
        """After every forward of a pipeline stage before the last: tensors to pass to the next stage beside
        the hidden states (the next stage's `carry_into_stage` gets them, in this order; every stage but the
        last passes the same number). The pipeline sends them as extra stage outputs, so a gradient comes
        back for each one that requires grad: the next stage's gradient of what it received, which lets a
        family send values backwards through the stages (Qwen3-MoE's pooled balance statistics). None by
        default."""
        del model
        return ()

    # ---- planner ------------------------------------------------------------------------------------
    def parameter_inventory(self, config: Any) -> ModelInventory:
        """Every parameter's shape and split, for the planner (never builds the model)."""
        raise NotImplementedError
