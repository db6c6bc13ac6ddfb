"""3D parallelism: pipeline x data x tensor parallel, with any data-parallel flavour.

`strategy=3d tp=2 pp=2 trainer.devices=8` derives dp = 8 / (2 x 2) = 2. Each rank holds its pipeline
stage(s); every stage part goes through the fixed order tensor parallel -> activation checkpointing ->
compile -> data-parallel wrapping, where the data-parallel flavour is ddp, zero1 (ddp + sharded
optimizer states), shard_grad_op (FSDP2: gradients and optimizer states sharded, parameters gathered for
each micro-batch), zero3, fsdp or hybrid_shard. Textbook ZeRO-2 (`strategy=zero2`: replicated parameters,
gradients reduce-scattered once per step) is not offered under 3d: its global gradient norm over
reduce-scattered rows of tensor-parallel and pipeline-split parameters is not built yet.
The replicating flavours use torch's `replicate` (DDP semantics on FSDP2's machinery): the classic
DistributedDataParallel breaks inside pipeline schedules (its reducer counts parameters twice when it
rebuilds buckets), and `replicate` also takes tensor-parallel DTensor parameters as they are.

`ThreeD` is composed of the pieces the single-dimension strategies use, not derived from them: the
`Pipeline` component (as `strategy=pp`), the tensor-parallel functions (as `strategy=tp`), and for the
data-parallel dimension `wrap_replicate`, or an `FSDPSharding` of the same `FSDPOptions` as `strategy=fsdp`
(`ThreeDConfig` inherits their fields), and a `ShardedOptimizerStates` for zero1 (as `strategy=zero1`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
from trainer.interfaces.precision import Precision
from trainer.interfaces.strategy import MicroBatch
from trainer.models import family_of
from trainer.plugins.strategies.ddp import ShardedOptimizerStates
from trainer.plugins.strategies.distributed import DistributedStrategy
from trainer.plugins.strategies.fsdp import FSDPOptions, FSDPSharding, accumulation_flags, reshard_gathered
from trainer.plugins.strategies.pipeline_overlap import ExpertOverlap, overlap_refusal
from trainer.plugins.strategies.pipeline_runtime import Pipeline, stage_init_seed
from trainer.plugins.strategies.pipeline_schedule import PipelineOptions
from trainer.plugins.strategies.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel_sizes,
    keep_grads_in_param_layout,
    materialize_tensor_parallel,
    settle_tensor_parallel_grads,
)

DATA_PARALLEL = ("ddp", "zero1", "shard_grad_op", "zero3", "fsdp", "hybrid_shard")
REPLICATING = ("ddp", "zero1")
# The FSDP sharding mode of each sharded flavour (the replicating ones keep the default: its checks only).
SHARDING = {"shard_grad_op": "shard_grad_op", "hybrid_shard": "hybrid_shard"}

log = logging.getLogger("trainer")


def wrap_replicate(model: nn.Module, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy,
                   edp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Replicated data parallelism per transformer block and the root, gradients all-reduced. Under
    expert parallelism each MoE layer's experts are replicated over their own ranks (edp) first, so the
    blocks' units skip them."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    family = family_of(model)
    if edp_mesh is not None:
        for _, layer in family.expert_layers([model]):
            replicate(layer.experts, mesh=edp_mesh, mp_policy=mp_policy)
    for block in family.blocks(model).values():
        replicate(block, mesh=mesh, mp_policy=mp_policy)
    replicate(model, mesh=mesh, mp_policy=mp_policy)
    return model


class ThreeD(DistributedStrategy):
    """Pipeline stages of tensor-parallel blocks, replicated or sharded over the data-parallel ranks.

    The model hooks follow the fixed order: 1. pipeline split (`split_pipeline`) -> 2. tensor parallel
    (`apply_model_parallel`) -> 3. activation checkpointing -> 4. compile (both done by
    `DistributedStrategy.setup_model`) -> 5. data-parallel wrapping (`wrap_data_parallel`). Any of the
    three dimensions may be 1; then its piece is skipped. With data_parallel=zero1 the optimizer states
    are sharded by a `ShardedOptimizerStates`.

    The sharded flavours take FSDP2's options as `strategy=fsdp` does: every keyword not named here is a
    field of `FSDPOptions` (flat in the config node, as Hydra hands it over), made into one `FSDPOptions`
    and kept whole in `self.fsdp`, with the sharding mode of the flavour.
    """

    name = "3d"
    uses_dp = True
    uses_tp = True
    uses_pp = True
    supports_ep = True
    wraps_experts_apart = True  # shard_experts, or wrap_replicate's experts

    def __init__(self, data_parallel: str = "fsdp", *, schedule: str = "1f1b", virtual_stages: int = 1,
                 layers_per_stage: Optional[Sequence[int]] = None, embedding_weight: float = 1.0,
                 head_weight: float = 1.0, expert_overlap: bool = False, sequence_parallel: bool = True,
                 loss_parallel: bool = True, init: str = "auto", name: Optional[str] = None, **options: Any) -> None:
        super().__init__(init=init, name=name)
        fsdp_options = FSDPOptions(**options)
        self.pipeline_options = PipelineOptions(schedule=schedule, virtual_stages=virtual_stages,
                                                layers_per_stage=layers_per_stage,
                                                embedding_weight=embedding_weight, head_weight=head_weight,
                                                expert_overlap=expert_overlap)
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        if data_parallel == "zero2":
            raise ValueError("data_parallel=zero2 (textbook ZeRO-2, replicated parameters) is not available "
                             "under 3d; data_parallel=shard_grad_op is FSDP2's variant (gradients and optimizer "
                             "states sharded, parameters gathered per micro-batch), or use zero1 or zero3")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {', '.join(DATA_PARALLEL)}, got {data_parallel!r}")
        if data_parallel in REPLICATING and fsdp_options.offload_params:
            raise ValueError(f"data_parallel={data_parallel} cannot offload parameters (every data-parallel rank "
                             "keeps its whole stage); that needs data_parallel=zero3, fsdp or hybrid_shard")
        if data_parallel == "ddp" and fsdp_options.offload_optimizer:
            raise ValueError("data_parallel=ddp cannot offload the optimizer (every rank holds all of its states); "
                             "data_parallel=zero1 and the sharded flavours offload their partition")
        self.data_parallel = data_parallel
        # FSDP2 as strategy=fsdp applies it, with the flavour's mode (used by the sharded flavours; the
        # replicating ones read offload_optimizer from its options and are checked by it all the same).
        self.fsdp = FSDPSharding(SHARDING.get(data_parallel, "full_shard"), fsdp_options)
        # This rank's stages and schedule, made by `split_pipeline` (None before, or with pp=1).
        self.pipeline: Pipeline | None = None
        self.sharded_states: ShardedOptimizerStates | None = None

    @property
    def replicating(self) -> bool:
        return self.data_parallel in REPLICATING

    @property
    def gathers_parameters(self) -> bool:
        return not self.replicating

    # ---- checks and layout (config validation and the planner call these before launch) ------------
    @property
    def label(self) -> str:
        return f"{super().label} (data_parallel={self.data_parallel})"

    @property
    def pipeline_schedule(self) -> str | None:
        return self.pipeline_options.schedule

    def data_parallel_split(self, dp: int) -> tuple[int, int]:
        return (dp, 1) if self.replicating else self.fsdp.data_parallel_split(dp)

    @property
    def optimizer_host(self) -> torch.device | None:
        if self.replicating:  # zero1: its partition of the optimizer states (ddp refused it above)
            return torch.device("cpu") if self.fsdp.options.offload_optimizer else None
        return self.fsdp.optimizer_host

    def planner_layout(self, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
        layout = {**super().planner_layout(dp, tp, pp, cp),  # dp_replicate x dp_shard from data_parallel_split
                  "tp": tp, "sequence_parallel": self.sequence_parallel, "loss_parallel": self.loss_parallel,
                  **self.pipeline_options.planner_fields(pp)}
        if self.replicating:
            return {**layout, "dp_flavour": self.data_parallel if dp * cp > 1 else "none",
                    "offload_optimizer": self.optimizer_host is not None}
        return {**layout, **self.fsdp.planner_fields()}

    def validate_pipeline(self, *, num_layers: int, pp: int, num_microbatches: int, compile: bool = False,
                          data_parallel: int = 1) -> None:
        if pp < 2:
            return  # without pipelining: the other dimensions are checked elsewhere
        self.pipeline_options.validate(num_layers=num_layers, pp=pp, num_microbatches=num_microbatches,
                                       compile=compile)
        # Every data_parallel flavour runs every schedule, the split-backward ones (zero_bubble, zbv, dualpipev)
        # included: `PrecisionStage` gathers FSDP2's units before torch's input- and weight-gradient passes
        # (pipeline_schedule.py's docstring says why they would miss resharded parameters otherwise).

    def check_expert_overlap(self, *, pp: int, ep: int, tp: int, cp: int, checkpointing: str) -> None:
        if not self.pipeline_options.expert_overlap:
            return
        refusal = "pp=1 has no pipeline" if pp < 2 else overlap_refusal(
            schedule=self.pipeline_options.schedule, ep=ep, tp=tp, cp=cp, checkpointing=checkpointing)
        if refusal is not None:
            raise ValueError(f"true cannot run: {refusal}")

    def check_tensor_parallel(self, model_cfg: Any, tp: int, seq_len: int, sequence_parallel: bool = True) -> None:
        if tp > 1:  # tp=1 is legitimate here: the other dimensions still split the work
            check_tensor_parallel_sizes(model_cfg, tp, seq_len, sequence_parallel)

    def connect_precision(self, precision: Precision) -> None:
        super().connect_precision(precision)
        if self.pipeline is not None:
            self.pipeline.precision = precision

    # ---- model (in the fixed order) -----------------------------------------------------------------
    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D tensor-parallel mesh (None with tp=1)."""
        return self.dims.mesh["tp"] if self.dims.tp_enabled else None

    def split_pipeline(self, model: nn.Module) -> list[nn.Module]:
        """1. pipeline split: this rank's stages (the whole model with pp=1)."""
        if not self.dims.pp_enabled:
            return [model]
        self.pipeline = Pipeline(self.pipeline_options, self.dims, self.device, self.precision,
                                 log_layout=self.is_global_zero)
        return self.pipeline.split(model)

    def apply_model_parallel(self, model: nn.Module) -> None:
        """2. tensor parallel on each stage part."""
        if self.tp_mesh is not None:
            apply_tensor_parallel(model, self.tp_mesh, sequence_parallel=self.sequence_parallel,
                                  loss_parallel=self.loss_parallel)

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        """5. data-parallel wrapping of each (TP-sharded, checkpointed, compiled) stage part."""
        if not self.dims.dp_cp_enabled:
            return model
        if self.replicating:
            # DDP semantics on FSDP2's machinery (`replicate`): unlike DistributedDataParallel it works
            # inside pipeline schedules and with tensor-parallel DTensor parameters.
            return wrap_replicate(model, self.dims.dp_cp_mesh(), self.precision.fsdp_mixed_precision(),
                                  self.dims.edp_mesh())
        return self.fsdp.wrap(model, self.dims.fsdp_mesh(), self.dims.edp_mesh(),
                              mp_policy=self.precision.fsdp_mixed_precision(), device=self.device,
                              is_global_zero=self.is_global_zero)

    def materialize(self, model: nn.Module) -> None:
        """The whole model (init=full), or one wrapped stage part: its stage's seed around the TP-aware init."""
        with stage_init_seed(self.unwrap(model), self.device):
            materialize_tensor_parallel(model, self.tp_mesh, super().materialize)

    def setup_model(self, model: nn.Module, activation_checkpointing: ActivationCheckpointing,
                    compile: bool) -> list[nn.Module]:
        parts = super().setup_model(model, activation_checkpointing, compile)
        # after materialization, which drops tensor hooks
        if self.tp_mesh is not None:
            for part in parts:
                keep_grads_in_param_layout(part, self.tp_mesh)
        if self.pipeline is not None:
            self.pipeline.finish_setup(parts, self.unwrap)
            self.pipeline.expert_overlap = self._expert_overlap(activation_checkpointing)
        return parts

    def _expert_overlap(self, policy: ActivationCheckpointing) -> Optional[ExpertOverlap]:
        """DualPipeV's expert overlap, when `strategy.expert_overlap=true` (config validation refused a layout
        where it cannot run; checked again here for a strategy built without it)."""
        if not self.pipeline_options.expert_overlap:
            return None
        dims = self.dims
        try:
            self.check_expert_overlap(pp=dims.pp, ep=dims.ep, tp=dims.tp, cp=dims.cp, checkpointing=policy.name)
        except ValueError as refused:
            raise ValueError(f"strategy.expert_overlap={refused}") from None
        if self.is_global_zero:
            log.info("dualpipev: each overlapped forward + backward pair runs on two threads that take turns at the "
                     "expert all-to-alls")
        return ExpertOverlap()

    def make_optimizer(self, optimizer_cfg: DictConfig, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
        modules = self.pipeline.optimizer_modules(model_parts) if self.pipeline is not None else list(model_parts)
        if self.data_parallel == "zero1" and self.dims.dp_cp_enabled:
            self.sharded_states = ShardedOptimizerStates(self.dims.dp_cp_mesh(), self.device,  # type: ignore[arg-type]
                                                         self.dims.edp_mesh(), self.expert_parameters(model_parts))
            return self.sharded_states.build_optimizer(optimizer_cfg, modules)
        return super().make_optimizer(optimizer_cfg, modules)

    def optimizer_tensor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.sharded_states.optimizer_tensor_pairs() if self.sharded_states is not None else []

    # ---- step ---------------------------------------------------------------------------------------
    def forward_backward(self, model_parts: Sequence[nn.Module], microbatches: Sequence[MicroBatch],
                         on_before_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        if self.pipeline is None:
            return super().forward_backward(model_parts, microbatches, on_before_backward)
        loss = self.pipeline.forward_backward(model_parts, microbatches, self.loss_normalizer(microbatches))
        self.reduce_gradients(model_parts)
        return loss

    def backward_sync(self, model: nn.Module, last_microbatch: bool) -> ContextManager[None]:
        """Accumulation without a pipeline (a pipeline schedule sets FSDP2's controls itself: one reduction
        per step, parameters kept gathered between its micro-batches). The replicating flavours all-reduce
        once per step, as DDP's no_sync does (their gradients are whole anyway); the sharded ones follow
        grad_sync and reshard_after_backward."""
        if not isinstance(model, FSDPModule):  # dp = 1: nothing wrapped
            return contextlib.nullcontext()
        if self.replicating:
            return accumulation_flags(model, last_microbatch, sync=False, reshard=True)
        return self.fsdp.backward_sync(model, last_microbatch)

    def reduce_gradients(self, model_parts: Sequence[nn.Module]) -> None:
        super().reduce_gradients(model_parts)
        self.scale_expert_gradients(model_parts)  # their units averaged over edp only

    @torch.no_grad()
    def evaluate(self, model_parts: Sequence[nn.Module], batches: Sequence[MicroBatch]) -> float:
        if self.pipeline is None:
            loss = super().evaluate(model_parts, batches)
        else:
            loss = self.reduce_mean(self.pipeline.evaluate(model_parts, batches, self.loss_normalizer(batches))).item()
        reshard_gathered(model_parts)
        return loss

    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        # sequence-parallel norm weights hold partial gradients: reduce them before any norm is taken
        settle_tensor_parallel_grads(model_parts)
        if self.pipeline is None:
            return super().clip_grad_norm(model_parts, max_norm)
        return self.pipeline.clip_grad_norm(model_parts, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.sharded_states is not None:
            return self.sharded_states.optimizer_step(optimizer, self.precision)
        return super().optimizer_step(optimizer)

    # ---- checkpoint / comparison ----------------------------------------------------------------------
    def full_state_dict(self, model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        if self.pipeline is None:
            return super().full_state_dict(model_parts)
        return self.pipeline.full_state_dict(model_parts)

    def teardown(self) -> None:
        # The stages and the schedule hold the model parts (and any reducer inside them), which must be
        # released before the process group is destroyed.
        if self.pipeline is not None:
            self.pipeline.release()
        gc.collect()
        super().teardown()


@dataclass
class ThreeDConfig(FSDPOptions):
    """Schema of `strategy=3d` (pipeline x data x tensor parallel; sizes from the top-level pp, dp, tp): the
    `FSDPOptions` fields, flat as in strategy=fsdp (`strategy.prefetch_blocks=2`), for the sharded flavours
    (offload_optimizer also for zero1; without a pipeline grad_sync and reshard_after_backward decide the
    accumulation, under one the schedule reduces once per step and keeps the parameters gathered), and 3d's
    own."""

    _target_: str = "trainer.plugins.strategies.ThreeD"
    name: str = "3d"
    # Data-parallel flavour: ddp, zero1, shard_grad_op, zero3, fsdp or hybrid_shard (its FSDP sharding mode:
    # shard_grad_op, full_shard for zero3 and fsdp, hybrid_shard).
    data_parallel: str = "fsdp"
    # Pipeline: schedule (gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev; the last two need
    # virtual_stages=2, placed in a V; every schedule with every data_parallel flavour), stages per rank,
    # layer split.
    schedule: str = "1f1b"
    virtual_stages: int = 1
    layers_per_stage: Optional[list[int]] = None
    embedding_weight: float = 1.0
    head_weight: float = 1.0
    # dualpipev with ep > 1: run each overlapped pair's forward and backward on two threads that take turns at
    # the expert all-to-alls, so one micro-batch's exchange hides behind the other's compute (not with tp, cp or
    # activation checkpointing: refused). Off by default: on the 2-core CPU it was measured on it hid a quarter
    # of the exchange time but made the step slower (docs/BENCHMARKS.md); not measured on a GPU.
    expert_overlap: bool = False
    # Tensor parallel: sequence parallelism for norms/residuals, vocab-parallel loss.
    sequence_parallel: bool = True
    loss_parallel: bool = True
    # Weight initialization: auto, full or sharded.
    init: str = "auto"
