"""`DecoderFamily`: the model-family contract (`trainer.interfaces.ModelFamily`) for the decoder layout the
project's families share (`CausalLM`: `tok_embeddings`, `layers` keyed by layer index, `norm`, `output`,
MoE feed-forwards), so that a family's `family.py` only declares what is its own (block split, sizes tp
must divide, the planner inventory, the Hugging Face adapter).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from trainer.interfaces.model_family import BlockSplit, ModelFamily, StageModules
from trainer.models.moe import MoE, collect_moe_stats, moe_layers, share_moe_rows_over_stages, update_router_biases

# The sub-layers of a pre-norm block `x + attention(attention_norm(x))`, `h + feed_forward(ffn_norm(h))`:
# attention gets (x, rope_cache, doc_ids); the feed-forward (x).
SWIGLU_COLUMN = ("feed_forward.w1", "feed_forward.w3")
SWIGLU_ROW = ("feed_forward.w2",)


def pre_norm_block_split(block: nn.Module, *, attention_args: int, column: tuple[str, ...],
                         row: tuple[str, ...], replicated: tuple[str, ...] = (),
                         head_norms: tuple[str, ...] = (), head_groups: tuple[str, ...] = ()) -> BlockSplit:
    """The split of a pre-norm block whose attention projections are `column`/`row` (names under the
    block): a dense feed-forward splits column- then row-parallel, an MoE runs whole on every tp rank."""
    moe = isinstance(block.feed_forward, MoE)
    present = {name for name, _ in block.named_modules()}
    missing = [name for name in (*column, *row, *replicated, *head_norms, *head_groups) if name not in present]
    if missing:
        raise ValueError(f"{type(block).__name__} has no {', '.join(missing)}: it does not split over tp as "
                         "its family declares")
    return BlockSplit(
        column=column + (() if moe else SWIGLU_COLUMN if "feed_forward.w3" in present else ("feed_forward.w1",)),
        row=row + (() if moe else SWIGLU_ROW),
        residual_norms=("attention_norm", "ffn_norm"),
        sublayers={"attention": attention_args, **({} if moe else {"feed_forward": 1})},
        replicated_sublayers=("feed_forward",) if moe else (),
        replicated=replicated,
        head_norms=head_norms,
        head_groups=head_groups,
    )


class DecoderFamily(ModelFamily):
    """The contract's structure hooks for `CausalLM` models; subclasses add `block_split`,
    `tensor_parallel_sizes`, `parameter_inventory` and their adapter."""

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return model.layers  # type: ignore[return-value]

    def num_layers(self, model: nn.Module) -> int:
        return int(model.config.n_layers)  # type: ignore[union-attr]

    def stage_only_modules(self, model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(model.first_stage_modules), tuple(model.last_stage_modules)  # type: ignore[arg-type]

    def stage_modules(self, model: nn.Module) -> StageModules:
        def held(name: str) -> Optional[str]:
            return name if getattr(model, name, None) is not None else None

        later_stage = getattr(model, "pp_stage_index", 0) > 0  # set by the pipeline's split
        return StageModules(embedding=held("tok_embeddings"), positions=held("pos_embeddings"), final_norm=held("norm"),
                            head=held("output"), hidden_states_in=later_stage or held("tok_embeddings") is None)

    def tied_weights(self, model: nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        embedding, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
        return (None if embedding is None else embedding.weight, None if output is None else output.weight)

    def shared_end_weights(self, model: nn.Module, *, last: bool) -> list[torch.Tensor]:
        weights: list[Optional[torch.Tensor]] = []
        if getattr(model.config, "tie_embeddings", False):  # the first stage's embedding is the last's head
            embedding, head = self.tied_weights(model)
            weights.append(head if last else embedding)
        for name in self.end_stage_copies(model):
            module = getattr(model, name, None)
            weights += [] if module is None else list(module.parameters())
        unique: dict[int, torch.Tensor] = {id(w): w for w in weights if w is not None}
        return list(unique.values())

    def expert_layers(self, model_parts: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
        return list(moe_layers(model_parts))

    def step_statistics(self, model_parts: Sequence[nn.Module],
                        reduce_mean: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[str, float], Any]:
        # MoE layers: aux losses and expert loads (one small all-reduce); DeepSeek-V3's MTP losses ride along.
        return collect_moe_stats(model_parts, reduce_mean)

    def moe_layer_keys(self, config: Any) -> list[str]:
        """The keys (as `moe_layers` names them: the block's index) of the whole model's MoE layers, on
        every pipeline stage alike. Default: every block when `config.is_moe`."""
        return [str(i) for i in range(config.n_layers)] if getattr(config, "is_moe", False) else []

    def sum_statistics_over_stages(self, model_parts: Sequence[nn.Module],
                                   all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # every MoE layer's step statistics on every stage, so that rank 0 logs the whole model's moe/* metrics
        config = model_parts[0].config
        keys = self.moe_layer_keys(config)
        if keys:
            share_moe_rows_over_stages(model_parts, keys, config.n_experts, all_reduce_sum)

    def after_optimizer_step(self, model_parts: Sequence[nn.Module], state: Any) -> None:
        if state:
            update_router_biases(model_parts, state)  # auxiliary-loss-free balancing, when on
