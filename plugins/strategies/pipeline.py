"""Pipeline parallelism with `torch.distributed.pipelining`: the model's layers cut into stages.

`strategy=pp` is pipeline parallelism alone over the `pp` mesh dimension (world size = pp). The pieces
it is made of are shared with `strategy=3d` and live next to it:

- `pipeline_split.py`: where the model is cut (`stage_layer_ranges`, `stage_indices_of_rank`,
  `split_model`; pure functions, re-exported here);
- `pipeline_schedule.py`: the options (`PipelineOptions`: schedule, virtual stages, layer split, and
  their checks) and the schedules torch runs;
- `pipeline_runtime.py`: the `Pipeline` component (this rank's stages, the schedule step, the loss,
  the norm and the weights across stages), with `pipeline_tied.py` for an embedding tied to the head.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
from trainer.interfaces.precision import Precision
from trainer.interfaces.strategy import MicroBatch
from trainer.loss import cross_entropy_loss
from trainer.plugins.strategies.distributed import DistributedStrategy
from trainer.plugins.strategies.pipeline_runtime import Pipeline, local_grad_norm, stage_init_seed
from trainer.plugins.strategies.pipeline_schedule import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    PipelineOptions,
)
from trainer.plugins.strategies.pipeline_split import split_model, stage_indices_of_rank, stage_layer_ranges

__all__ = [
    "PipelineParallel", "PipelineParallelConfig", "Pipeline", "PipelineOptions", "SCHEDULES",
    "MULTI_STAGE_SCHEDULES", "stage_layer_ranges", "stage_indices_of_rank", "split_model", "local_grad_norm",
]


class PipelineParallel(DistributedStrategy):
    """Pipeline parallelism over the `pp` mesh dimension (no tensor or data parallelism).

    The hooks below follow the order every strategy applies to the model: 1. pipeline split
    (`split_pipeline`: the `Pipeline` component cuts the model) -> 2. tensor parallel (none here) ->
    3. activation checkpointing -> 4. compile (both done by `DistributedStrategy.setup_model`) ->
    5. data-parallel wrapping (none here). Everything after the split goes through the component.
    """

    name = "pp"
    uses_pp = True
    uses_dp = False

    def __init__(self, schedule: str = "1f1b", virtual_stages: int = 1,
                 layers_per_stage: Optional[Sequence[int]] = None, embedding_weight: float = 1.0,
                 head_weight: float = 1.0, init: str = "auto", name: Optional[str] = None) -> None:
        super().__init__(init=init, name=name)
        self.pipeline_options = PipelineOptions(schedule=schedule, virtual_stages=virtual_stages,
                                                layers_per_stage=layers_per_stage,
                                                embedding_weight=embedding_weight, head_weight=head_weight)
        # This rank's stages and schedule, made by `split_pipeline` (None before, or with pp=1).
        self.pipeline: Pipeline | None = None

    # ---- checks and layout (config validation and the planner call these before launch) ------------
    @property
    def pipeline_schedule(self) -> str | None:
        return self.pipeline_options.schedule

    def planner_layout(self, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
        return {**super().planner_layout(dp, tp, pp, cp), **self.pipeline_options.planner_fields(pp)}

    def validate_pipeline(self, *, num_layers: int, pp: int, num_microbatches: int, compile: bool = False,
                          data_parallel: int = 1) -> None:
        """Raise ValueError (one line) when the pipeline cannot be built or torch's schedule would refuse."""
        if pp < 2:
            raise ValueError(f"strategy={self.name} needs pp >= 2 pipeline stages, got pp={pp}: set pp=2 "
                             "trainer.devices=2 (one process per stage), or use strategy=single for one process")
        self.pipeline_options.validate(num_layers=num_layers, pp=pp, num_microbatches=num_microbatches,
                                       compile=compile)

    def connect_precision(self, precision: Precision) -> None:
        super().connect_precision(precision)
        if self.pipeline is not None:
            self.pipeline.precision = precision

    # ---- model (in the fixed order) -----------------------------------------------------------------
    def split_pipeline(self, model: nn.Module) -> list[nn.Module]:
        """1. pipeline split: this rank's stages, in increasing stage order (the order the schedule expects)."""
        if not self.dims.pp_enabled:
            return [model]
        self.pipeline = Pipeline(self.pipeline_options, self.dims, self.device, self.precision,
                                 compute_loss=self._compute_loss, log_layout=self.is_global_zero)
        return self.pipeline.split(model)

    def materialize(self, model: nn.Module) -> None:
        """Initialize the whole model (init=full) or one stage on its own, from its own seed (big models)."""
        with stage_init_seed(self.unwrap(model), self.device):
            super().materialize(model)

    def setup_model(self, model: nn.Module, activation_checkpointing: ActivationCheckpointing,
                    compile: bool) -> list[nn.Module]:
        parts = super().setup_model(model, activation_checkpointing, compile)
        if self.pipeline is not None:  # after materialization: tied weights, per-stage dropout streams
            self.pipeline.finish_setup(parts, self.unwrap)
        return parts

    def make_optimizer(self, optimizer_cfg: DictConfig, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
        modules = self.pipeline.optimizer_modules(model_parts) if self.pipeline is not None else list(model_parts)
        return super().make_optimizer(optimizer_cfg, modules)

    # ---- step ---------------------------------------------------------------------------------------
    def compute_loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Mean (or, under document masking, summed) token loss of one micro-batch on the last stage."""
        return cross_entropy_loss(logits, targets, reduction, compiled=self.compiled_loss)

    def _compute_loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        # looked up at each call, so that replacing `compute_loss` on the instance (benchmarks/pipeline_bubble.py
        # times it) reaches the schedule
        return self.compute_loss(logits, targets, reduction)

    def forward_backward(self, model_parts: Sequence[nn.Module], microbatches: Sequence[MicroBatch],
                         on_before_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run the pipeline schedule over this rank's micro-batches; the mean loss on every pp rank.

        `on_before_backward` is not called: the backward passes happen inside torch's schedule (see
        `Callback.on_before_backward`).
        """
        if self.pipeline is None:
            return super().forward_backward(model_parts, microbatches, on_before_backward)
        loss = self.pipeline.forward_backward(model_parts, microbatches, self.loss_normalizer(microbatches))
        self.reduce_gradients(model_parts)  # over the cp ranks, if any
        return loss

    @torch.no_grad()
    def evaluate(self, model_parts: Sequence[nn.Module], batches: Sequence[MicroBatch]) -> float:
        if self.pipeline is None:
            return super().evaluate(model_parts, batches)
        return self.reduce_mean(self.pipeline.evaluate(model_parts, batches, self.loss_normalizer(batches))).item()

    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        if self.pipeline is None:
            return super().clip_grad_norm(model_parts, max_norm)
        return self.pipeline.clip_grad_norm(model_parts, max_norm)

    # ---- checkpoint / comparison ----------------------------------------------------------------------
    def full_state_dict(self, model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        if self.pipeline is None:
            return super().full_state_dict(model_parts)
        return self.pipeline.full_state_dict(model_parts)

    def teardown(self) -> None:
        # The stages and the schedule hold the model parts, which must be released before the process
        # group is destroyed.
        if self.pipeline is not None:
            self.pipeline.release()
        gc.collect()
        super().teardown()


@dataclass
class PipelineParallelConfig:
    """Schema of `strategy=pp`: pipeline parallelism over `pp` ranks (world size = pp)."""

    _target_: str = "trainer.plugins.strategies.PipelineParallel"
    name: str = "pp"
    # Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (needs virtual_stages >= 2 to interleave) or
    # zero_bubble (torch's ScheduleInterleavedZeroBubble; virtual_stages >= 2, no trainer.compile), zbv
    # (ScheduleZBVZeroBubble) or dualpipev (ScheduleDualPipeV, M >= 2 pp): virtual_stages=2 in a V, no compile.
    schedule: str = "1f1b"
    # Stages per rank: rank r holds stages r, r + pp, r + 2 pp, ... (1 for gpipe and 1f1b; for zbv and
    # dualpipev exactly 2, r and 2 pp - 1 - r).
    virtual_stages: int = 1
    # Transformer blocks of each stage, in stage order (pp x virtual_stages entries, each >= 1, summing
    # to model.n_layers); null balances them automatically using the two weights below.
    layers_per_stage: Optional[list[int]] = None
    # Cost of the token embedding on the first stage, in units of one transformer block.
    embedding_weight: float = 1.0
    # Cost of the final norm, output head and loss on the last stage, in units of one transformer block
    # (roughly vocab_size / (12 x dim) for a standard block; raise it for big vocabularies).
    head_weight: float = 1.0
    # Weight initialization: full (whole model on every rank, then split: bitwise the single-process
    # weights), sharded (each rank initializes only its stages: for models too big for host memory) or auto.
    init: str = "auto"
