"""The pipeline's options and schedules: which torch schedule runs the stages, and whether it can.

Schedules (`strategy.schedule`):
- `gpipe`: all forwards, then all backwards (Huang et al. 2019). Bubble (P-1)/(M+P-1); keeps the
  activations of all M micro-batches.
- `1f1b`: one forward one backward in the steady state (PipeDream-Flush, Narayanan et al. 2021).
  Same bubble, at most P micro-batches of activations in flight.
- `interleaved_1f1b`: V virtual stages per rank (`strategy.virtual_stages`); the bubble shrinks by
  about V at the price of V times more point-to-point messages.
- `zero_bubble`: torch's `ScheduleInterleavedZeroBubble` (ZB1P of Qi et al. 2024): the backward is
  split into input-gradient and weight-gradient parts, and the weight parts fill the bubbles. It uses
  the same looped stage placement as interleaved 1F1B (rank r holds stages r, r + P, ...).
- `zbv`: torch's `ScheduleZBVZeroBubble` (ZB-V, Qi et al. 2024 section 6): exactly 2 stages per rank
  (`strategy.virtual_stages=2`) placed in a V: rank r holds stages r and 2P-1-r, so rank 0 holds the
  first and the last stage (the loss is computed there, and a head tied to the embedding is a local
  tie) and the hand-over between a rank's two stages (P-1 -> P on the last rank) is local. Backward
  split into input- and weight-gradient parts as zero_bubble. Any M >= P.
- `dualpipev`: torch's `ScheduleDualPipeV` (DeepSeek-V3's DualPipe folded into a V, as DeepSeek's
  open-source DualPipeV): the same V placement; in the steady state each rank runs "overlapped" actions,
  the forward of one micro-batch on one of its stages beside the full backward of another micro-batch on
  its other stage. torch runs the two sub-actions one after the other unless a function is registered for
  them (`register_custom_function(OVERLAP_F_B, ...)`); with expert parallelism and
  `strategy.expert_overlap=true` this trainer registers `ExpertOverlap.run_pair` (pipeline_overlap.py), which
  runs them on two threads that take turns at the all-to-alls, so one micro-batch's exchange hides behind the
  other's compute.
  Needs M >= 2P (torch refuses fewer).

Both V schedules: evaluation runs a forward-only order over the V (`v_forward_only_order`; torch's `eval()`
of these schedules fails at the local gradient hand-over between a rank's two stages).
`activation_checkpointing=selective` is refused under them as under zero_bubble.

The split backward under data parallelism (`strategy=3d`, any data_parallel flavour, dp x cp > 1, so with ep
too): torch 2.13's input-gradient pass (pipelining/_backward.py `stage_backward_input`) records which
parameters the weight pass will differentiate for by looking up the stage module's registered parameters
(`submod.parameters()`), and the weight pass (`stage_backward_weight`) writes into those. FSDP2 registers the
gathered parameters only while a unit is unsharded; a unit that was resharded after its forward (zero3, fsdp,
hybrid_shard: every block but a stage's last, and the root, which FSDP2 keeps gathered only when
reshard_after_forward is left unset) shows its sharded DTensors instead, which the forward's graph never used,
so its weight gradients were silently dropped (measured: pp=2 x dp=2 fsdp, first-step gradient norm 2.217
instead of 2.544). `PrecisionStage` gathers every FSDP2 unit of the stage before both passes
(`gather_stage_parameters`, the loop torch's own UNSHARD action runs), so the gradients land on the gathered
parameters and the schedule's final post-backward reduce-scatters them. `replicate` (ddp, zero1) keeps its
parameters gathered and matched without it.

`PipelineOptions` holds what `strategy=pp` and `strategy=3d` share (schedule, virtual stages, layer
split), checked on creation and against the model and batch sizes before launch (`validate`);
`PrecisionStage` is the stage torch drives, with the precision plugin's autocast around its forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from trainer.models.moe import moe_stats_paused
from trainer.plugins.strategies.pipeline_split import V_SCHEDULES, stage_layer_ranges

SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
# Schedules that drive several stages per rank (torch's PipelineScheduleMulti family).
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble", *V_SCHEDULES)
# Looped placement (rank r holds r, r + P, ...), micro-batches in max(1, M // P) rounds of equal size.
LOOPED_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
# Schedules that split each backward into input- and weight-gradient passes (no torch.compile, no
# selective activation checkpointing: two autograd passes over one forward).
SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", *V_SCHEDULES)


@dataclass
class PipelineOptions:
    """How the layers are cut into stages and which schedule runs them (checked on creation)."""

    schedule: str = "1f1b"
    # Stages per rank: rank r holds stages r, r + pp, r + 2 pp, ... (zbv, dualpipev: exactly 2, r and 2 pp - 1 - r)
    virtual_stages: int = 1
    # Blocks of each stage in stage order (pp x virtual_stages entries); None: balanced by the weights.
    layers_per_stage: Optional[Sequence[int]] = None
    embedding_weight: float = 1.0
    head_weight: float = 1.0
    # DualPipeV with expert parallelism: run each overlapped forward + backward pair on two threads that take
    # turns at the all-to-alls (pipeline_overlap.py; config validation says why a layout cannot). False:
    # torch's order, the pair's forward then its backward.
    expert_overlap: bool = False

    def __post_init__(self) -> None:
        schedule, virtual_stages = self.schedule, self.virtual_stages
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
        if virtual_stages > 1 and schedule not in MULTI_STAGE_SCHEDULES:
            raise ValueError(f"schedule={schedule} runs one stage per rank; virtual_stages={virtual_stages} "
                             f"needs schedule={' or '.join(MULTI_STAGE_SCHEDULES)}")
        if schedule in V_SCHEDULES and virtual_stages != 2:
            raise ValueError(f"schedule={schedule} places exactly 2 stages per rank in a V (rank r holds stages r "
                             f"and 2 pp - 1 - r): set strategy.virtual_stages=2, got {virtual_stages}")
        if self.embedding_weight < 0 or self.head_weight < 0:
            raise ValueError(f"embedding_weight and head_weight must be >= 0, got {self.embedding_weight} and "
                             f"{self.head_weight}")
        if self.layers_per_stage is not None:
            if any(int(c) < 1 for c in self.layers_per_stage):
                raise ValueError(f"layers_per_stage={list(self.layers_per_stage)}: every stage needs at least "
                                 "one layer")
            self.layers_per_stage = [int(c) for c in self.layers_per_stage]

    @property
    def multi_stage(self) -> bool:
        """Whether the schedule drives several stages per rank (it is given a list of stages)."""
        return self.schedule in MULTI_STAGE_SCHEDULES

    @property
    def v_shape(self) -> bool:
        """Whether the stages are placed in a V (rank r holds stages r and 2P - 1 - r; rank 0 the loss)."""
        return self.schedule in V_SCHEDULES

    def stage_ranges(self, num_layers: int, num_stages: int) -> list[range]:
        """The layers of every stage, as given or balanced (`stage_layer_ranges`)."""
        return stage_layer_ranges(num_layers, num_stages, layers_per_stage=self.layers_per_stage,
                                  embedding_weight=self.embedding_weight, head_weight=self.head_weight)

    def planner_fields(self, pp: int) -> dict[str, Any]:
        """The pipeline's fields of the planner's `Layout`."""
        return {"pp": pp, "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "layers_per_stage": None if self.layers_per_stage is None else tuple(self.layers_per_stage),
                "embedding_weight": float(self.embedding_weight), "head_weight": float(self.head_weight)}

    def validate(self, *, num_layers: int, pp: int, num_microbatches: int, compile: bool = False) -> None:
        """Raise ValueError (one line) when `pp` >= 2 stages cannot be built or torch's schedule would refuse.

        `num_microbatches` is the number of micro-batches per optimizer step on one data-parallel rank,
        global_batch_size / (micro_batch_size x dp): the schedule's micro-batches.
        """
        stages = pp * self.virtual_stages
        if pp > num_layers:
            raise ValueError(f"pp={pp} is more than the model's {num_layers} layers: every pipeline stage needs "
                             f"at least one transformer block (use pp <= {num_layers})")
        if stages > num_layers:
            raise ValueError(f"pp x strategy.virtual_stages = {pp} x {self.virtual_stages} = {stages} stages need "
                             f"at least {stages} layers, the model has {num_layers}")
        if self.layers_per_stage is not None:
            stage_layer_ranges(num_layers, stages, layers_per_stage=self.layers_per_stage)
        where = ("micro-batches per step = trainer.global_batch_size / (trainer.micro_batch_size x dp) = "
                 f"{num_microbatches}")
        if num_microbatches < pp:
            raise ValueError(f"{where}, fewer than the pp={pp} pipeline stages (each stage would idle most of "
                             "the step): raise trainer.global_batch_size or lower trainer.micro_batch_size")
        if self.schedule in LOOPED_SCHEDULES:
            # torch's looped schedules run the micro-batches in max(1, M // pp) rounds of equal size and
            # refuse an M that does not split evenly (ScheduleInterleaved1F1B / ...ZeroBubble __init__).
            rounds = max(1, num_microbatches // pp)
            if num_microbatches % rounds:
                raise ValueError(f"{where}, but schedule={self.schedule} runs them in max(1, M // pp) = "
                                 f"{rounds} rounds and torch needs M divisible by that: use a multiple of pp={pp}")
        if self.schedule == "dualpipev" and num_microbatches < 2 * pp:
            # ScheduleDualPipeV.__init__: at least as many micro-batches as stages (2 per rank)
            raise ValueError(f"{where}, but schedule=dualpipev needs at least as many as its 2 x pp = {2 * pp} "
                             "stages: raise trainer.global_batch_size or lower trainer.micro_batch_size")
        if self.schedule in SPLIT_BACKWARD_SCHEDULES and compile:
            raise ValueError(f"schedule={self.schedule} splits each backward into input- and weight-gradient "
                             "parts, which torch does not support for compiled modules: set trainer.compile=false "
                             "or pick schedule=interleaved_1f1b")


def v_forward_only_order(schedule: Any, pp: int, num_microbatches: int) -> dict[int, list[Any]]:
    """The operations (with their sends and receives) of a forward-only step of a V schedule: rank r runs
    every micro-batch's forward on stage r, then on stage 2P - 1 - r (GPipe's forward half over the V).

    Lowered as torch lowers a schedule's own order (`_PipelineScheduleRuntime._prepare_schedule_with_comms`,
    torch's pipelining IR, which torchtitan's custom schedules use too), without its check that every
    micro-batch has a backward.
    """
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _add_unshard_reshard,
        _ComputationType,
    )

    forward = _ComputationType.FORWARD
    order = {rank: _add_unshard_reshard([_Action(stage, forward, mb) for stage in (rank, 2 * pp - 1 - rank)
                                         for mb in range(num_microbatches)]) for rank in range(pp)}
    return _add_send_recv(order, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s],
                          num_stages=2 * pp)


def gather_stage_parameters(module: nn.Module) -> None:
    """All-gather every FSDP2 (or `replicate`) unit of a stage part that is not gathered now, so that its
    registered parameters are the tensors the forward used. Units already gathered skip it without a
    collective; every data-parallel rank of a stage runs the same schedule, so they gather together."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()


class PrecisionStage(PipelineStage):
    """A PipelineStage whose forward passes run inside the precision plugin's autocast region, and which
    passes the model family's carried tensors between stages.

    Autocast must cover the forward (and the shape inference that sizes the receive buffers, so that
    their dtype matches what the previous stage actually sends) but not the backward, so it is entered
    per forward call instead of around the whole schedule step.

    Carried tensors (`ModelFamily.carry_out_of_stage`: Qwen3-MoE's pooled balance statistics) are extra
    outputs of every stage but the last, after the hidden states, and so extra inputs of every stage but
    the first: torch sends them with the hidden states, and sends their gradients back with the hidden
    states' gradient. The model itself keeps one input and one output (what tensor parallelism's plan
    and FSDP's hooks see); the family hands the extras to it and takes them from it.
    """

    def __init__(self, *args: Any, autocast: Callable[[], ContextManager[Any]], family: Any = None,
                 split_backward: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._autocast = autocast
        # Under a schedule that splits the backward (zero_bubble, zbv, dualpipev) torch detaches the stage's
        # outputs in place after the input-gradient pass, which autograd refuses for a view: a tensor-parallel
        # stage's output is one (DTensor.to_local), so such outputs are copied (`_own_outputs`).
        self._split_backward = split_backward
        self._family = family  # the model's family (`ModelFamily`): the carry hooks; None carries nothing
        # The token ids and (under document masking) the document ids of each micro-batch of the step, set
        # by the pipeline: a stage receives only hidden states, so they reach its model as `pipeline_tokens`
        # (read by the models that need them on a later stage: DeepSeek-V3's multi-token prediction) and
        # `pipeline_doc_ids`.
        self.chunk_tokens: list[Any] = []
        self.chunk_doc_ids: list[Any] = []

    def _set_chunk(self, fwd_chunk_id: int) -> None:
        if fwd_chunk_id < len(self.chunk_tokens):
            self.submod.pipeline_tokens = self.chunk_tokens[fwd_chunk_id]
        if fwd_chunk_id < len(self.chunk_doc_ids):
            self.submod.pipeline_doc_ids = self.chunk_doc_ids[fwd_chunk_id]

    def _carrying(self, run: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """`run(*model_args)` with the carried tensors split off the stage's inputs (a later stage's are
        the hidden states, then what the previous stage carried) and appended to its outputs (but the
        last stage's, which go to the loss)."""
        if self._family is None:
            return run(*args)
        carried: tuple[Any, ...] = ()
        if not self.is_first:
            args, carried = args[:1], tuple(args[1:])
        self._family.carry_into_stage(self.submod, carried)
        output = run(*args)
        if self.is_last:
            return output
        extra = self._family.carry_out_of_stage(self.submod)
        return (output, *extra) if extra else output

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self._set_chunk(fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        parent = super(PrecisionStage, self)
        with self._autocast():
            output = self._carrying(lambda *inputs: parent.forward_maybe_with_nosync(*inputs, **kwargs), args)
        return self._own_outputs(output) if self._split_backward and not self.is_last else output

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict[str, Any],
                                   last_backward: bool = False) -> Any:
        # The split passes (zero_bubble, zbv, dualpipev) find the parameters through `submod.parameters()`,
        # which under FSDP2 are the gathered ones only while each unit is unsharded (see the module's docstring)
        if backward_type in ("input", "weight"):
            gather_stage_parameters(self.submod)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    @staticmethod
    def _own_outputs(output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output.clone() if output._is_view() else output
        if isinstance(output, tuple):
            return tuple(t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t for t in output)
        return output

    def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
        # the forward of torch's metadata inference (first step, and after each eval/train switch): not a
        # training forward, so MoE layers leave it out of their load statistics (and QK-clip's attention
        # layers out of their logit maxima)
        # (on the first micro-batch's token and document ids, the shapes of every micro-batch's)
        self._set_chunk(0)
        parent = super(PrecisionStage, self)
        with self._autocast(), moe_stats_paused():
            return self._carrying(lambda *inputs: parent._compute_outputs(*inputs, module=module, **kwargs), args)
