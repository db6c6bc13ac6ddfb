"""Pipeline parallelism with `torch.distributed.pipelining`: the model's layers cut into stages.

Each rank of the `pp` mesh dimension holds one stage (or, for the interleaved schedules, several
"virtual" stages r, r + P, r + 2P, ...: Narayanan et al. 2021). A stage is a copy of the model that
keeps only its own transformer blocks (`layers` keys unchanged, so checkpoints and optimizer states
keep their names); the token embedding lives on the first stage, the final norm and the output head
on the last (`CausalLM.first_stage_modules` / `last_stage_modules`), and the model's forward skips
the modules that are None.

One optimizer step is one schedule step over this rank's micro-batches: the data loader already
cuts the global batch into `global_batch / (micro_batch x dp)` micro-batches, which become the
pipeline's micro-batches, so the arithmetic is exactly that of gradient accumulation. The loss
function divides each micro-batch loss by their number (the schedule's own gradient scaling is off),
so gradients equal those of the single-process mean loss.

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
  torch's other zero-bubble schedule, `ScheduleZBVZeroBubble`, places stages in a V (rank 0 holds the
  first and the last stage) and needs exactly 2 stages per rank; it is not exposed here.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor

from trainer.plugins.activation_checkpointing import ActivationCheckpointing
from trainer.plugins.precision import Precision
from trainer.plugins.strategies.base import MicroBatch
from trainer.plugins.strategies.distributed import DistributedStrategy
from trainer.loss import cross_entropy_loss

log = logging.getLogger("trainer")

SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
# Schedules that drive several stages per rank (torch's PipelineScheduleMulti family).
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


# ---- stage layout (pure functions, unit-tested without processes) --------------------------------------
def stage_layer_ranges(num_layers: int, num_stages: int, *, layers_per_stage: Optional[Sequence[int]] = None,
                       embedding_weight: float = 1.0, head_weight: float = 1.0) -> list[range]:
    """Contiguous layer ranges, one per pipeline stage, covering `range(num_layers)` exactly.

    With `layers_per_stage` the counts are taken as given (validated: one count per stage, each >= 1,
    summing to `num_layers`). Otherwise the layers are balanced by cost: one transformer block costs 1,
    the first stage also pays `embedding_weight` and the last `head_weight` (the output head is a
    vocab x dim matmul plus the loss; for a large vocabulary it is worth several blocks). The split
    minimizes the most expensive stage (the pipeline runs at the pace of its slowest stage) and, among
    those, the sum of squared stage costs (spread the remaining slack evenly). Every stage gets at
    least one block.
    """
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} layers (one per stage), "
                         f"the model has {num_layers}")
    if layers_per_stage is not None:
        counts = [int(c) for c in layers_per_stage]
        if len(counts) != num_stages:
            raise ValueError(f"layers_per_stage has {len(counts)} entries but there are {num_stages} stages "
                             f"(pp x virtual_stages): give one count per stage")
        if any(c < 1 for c in counts):
            raise ValueError(f"layers_per_stage={counts}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ValueError(f"layers_per_stage={counts} sums to {sum(counts)}, but the model has {num_layers} "
                             f"layers: the counts must add up to model.n_layers")
    else:
        if embedding_weight < 0 or head_weight < 0:
            raise ValueError(f"embedding_weight and head_weight must be >= 0, got {embedding_weight} and "
                             f"{head_weight}")
        counts = _balanced_counts(num_layers, num_stages, float(embedding_weight), float(head_weight))
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _balanced_counts(num_layers: int, num_stages: int, embedding_weight: float, head_weight: float) -> list[int]:
    """Exact two-pass dynamic program over contiguous splits (S x L^2, microseconds for real sizes)."""

    def cost(stage: int, count: int) -> float:
        extra = (embedding_weight if stage == 0 else 0.0) + (head_weight if stage == num_stages - 1 else 0.0)
        return count + extra

    def splits(score: Callable[[float], float], combine: Callable[[float, float], float],
               cap: float) -> tuple[float, list[int]]:
        # best[s][n]: best score of the first s stages holding the first n layers
        inf = math.inf
        best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
        choice = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, num_stages + 1):
            for n in range(s, num_layers - (num_stages - s) + 1):  # leave >= 1 layer per later stage
                for count in range(1, n - (s - 1) + 1):
                    prev = best[s - 1][n - count]
                    c = cost(s - 1, count)
                    if prev == inf or c > cap + 1e-9:
                        continue
                    value = combine(prev, score(c))
                    if value < best[s][n] - 1e-12:
                        best[s][n], choice[s][n] = value, count
        counts, n = [], num_layers
        for s in range(num_stages, 0, -1):
            counts.append(choice[s][n])
            n -= choice[s][n]
        return best[num_stages][num_layers], counts[::-1]

    bottleneck, _ = splits(lambda c: c, max, math.inf)
    _, counts = splits(lambda c: c * c, lambda a, b: a + b, bottleneck)
    return counts


def stage_indices_of_rank(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """Stages held by `pp_rank` under the looped placement: r, r + P, r + 2P, ..."""
    return [pp_rank + v * pp_size for v in range(virtual_stages)]


def split_model(model: nn.Module, ranges: Sequence[range], stage_indices: Sequence[int]) -> list[nn.Module]:
    """Copies of `model` (meta or materialized) holding only the given stages' layers.

    Stage `s` keeps the blocks `ranges[s]` (ModuleDict keys unchanged), the first-stage modules only if
    `s == 0` and the last-stage modules only if `s == len(ranges) - 1`; everything else is None. The
    copy skips the dropped modules, so a rank never holds more than its stages' weights (beyond the
    model it was given). Parameters shared by kept modules stay shared within a stage (a tied head on
    a stage that also holds the embedding); across stages they become separate copies.
    """
    num_stages = len(ranges)
    layers: nn.ModuleDict = model.layers  # type: ignore[assignment]
    covered = sorted(i for r in ranges for i in r)
    if covered != list(range(len(layers))):
        raise ValueError(f"the stage ranges cover layers {covered}, not exactly the model's {len(layers)} layers")
    first_only = tuple(getattr(model, "first_stage_modules", ("tok_embeddings",)))
    last_only = tuple(getattr(model, "last_stage_modules", ("norm", "output")))
    stages = []
    for stage in stage_indices:
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage index {stage} is out of range for {num_stages} stages")
        keep = {str(i) for i in ranges[stage]}
        dropped = [m for key, m in layers.items() if key not in keep]
        dropped += [getattr(model, name) for name in first_only if stage != 0]
        dropped += [getattr(model, name) for name in last_only if stage != num_stages - 1]
        # deepcopy consults its memo before copying: mapping a module to None makes the copy hold None
        # in its place without ever copying that module's weights.
        memo: dict[int, Any] = {id(m): None for m in dropped if m is not None}
        part = copy.deepcopy(model, memo)
        for key in [k for k, m in part.layers.items() if m is None]:
            del part.layers[key]
        for name in first_only + last_only:
            if (name in first_only and stage != 0) or (name in last_only and stage != num_stages - 1):
                setattr(part, name, None)
        part.pp_stage_index = stage  # read by materialize (per-stage init seed) and the tests
        stages.append(part)
    return stages


# ---- the stage torch drives ---------------------------------------------------------------------------
class _PrecisionStage(PipelineStage):
    """A PipelineStage whose forward passes run inside the precision plugin's autocast region.

    Autocast must cover the forward (and the shape inference that sizes the receive buffers, so that
    their dtype matches what the previous stage actually sends) but not the backward, so it is entered
    per forward call instead of around the whole schedule step.
    """

    def __init__(self, *args: Any, autocast: Callable[[], ContextManager[Any]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._autocast = autocast

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        with self._autocast():
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
        # the forward of torch's metadata inference (first step, and after each eval/train switch)
        with self._autocast():
            return super()._compute_outputs(*args, module=module, **kwargs)


# ---- the strategy -------------------------------------------------------------------------------------
class PipelineParallel(DistributedStrategy):
    """Pipeline parallelism over the `pp` mesh dimension (no data parallelism on its own).

    Only pipeline concerns live here (the split, the schedule, the cross-stage loss, norm and
    weights), and every hook calls `super()` for the rest, so that a combined strategy
    `class ThreeD(PipelineParallel, TensorParallel)` with data-parallel wrapping gets TP and DP per
    stage part from the other classes in its MRO.
    """

    name = "pp"
    uses_pp = True
    uses_dp = False

    def __init__(self, schedule: str = "1f1b", virtual_stages: int = 1,
                 layers_per_stage: Optional[Sequence[int]] = None, embedding_weight: float = 1.0,
                 head_weight: float = 1.0, init: str = "auto", name: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(init=init, name=name, **kwargs)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
        if virtual_stages > 1 and schedule not in MULTI_STAGE_SCHEDULES:
            raise ValueError(f"schedule={schedule} runs one stage per rank; virtual_stages={virtual_stages} "
                             f"needs schedule={' or '.join(MULTI_STAGE_SCHEDULES)}")
        if embedding_weight < 0 or head_weight < 0:
            raise ValueError(f"embedding_weight and head_weight must be >= 0, got {embedding_weight} and "
                             f"{head_weight}")
        if layers_per_stage is not None and any(int(c) < 1 for c in layers_per_stage):
            raise ValueError(f"layers_per_stage={list(layers_per_stage)}: every stage needs at least one layer")
        self.schedule_name = schedule
        self.virtual_stages = virtual_stages
        self.layers_per_stage = None if layers_per_stage is None else [int(c) for c in layers_per_stage]
        self.embedding_weight = embedding_weight
        self.head_weight = head_weight
        # Filled by split_pipeline / built lazily on the first step (the schedule needs the number of
        # micro-batches, which only the loop knows).
        self.stage_ranges: list[range] = []
        self.stage_indices: list[int] = []
        self.num_stages = 0
        self._stages: list[_PrecisionStage] = []
        self._schedule: Any = None
        self._schedule_microbatches = 0
        self._precision: Precision | None = None
        self._scale_in_loss = False
        self._recorded_losses: list[torch.Tensor] = []
        # Tied input embedding and output head on different stages (GPT): each end holds a copy; the
        # group joins this rank's first- and last-stage ranks, the parameter is this rank's copy.
        self._tied_group: dist.ProcessGroup | None = None
        self._tied_param: nn.Parameter | None = None
        self._tied_is_mirror = False

    # ---- validation (called by trainer.config before any process starts) ---------------------------
    def validate_pipeline(self, *, num_layers: int, pp: int, num_microbatches: int, compile: bool = False) -> None:
        """Raise ValueError (one line) when the pipeline cannot be built or torch's schedule would refuse.

        `num_microbatches` is the number of micro-batches per optimizer step on one data-parallel rank,
        global_batch_size / (micro_batch_size x dp): the schedule's micro-batches.
        """
        if pp < 2:
            if self.uses_dp or self.uses_tp:
                return  # a combined strategy without pipelining: its other dimensions are checked elsewhere
            raise ValueError(f"strategy={self.name} needs pp >= 2 pipeline stages, got pp={pp}: set pp=2 "
                             "trainer.devices=2 (one process per stage), or use strategy=single for one process")
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
        if self.schedule_name in MULTI_STAGE_SCHEDULES:
            # torch's looped schedules run the micro-batches in max(1, M // pp) rounds of equal size and
            # refuse an M that does not split evenly (ScheduleInterleaved1F1B / ...ZeroBubble __init__).
            rounds = max(1, num_microbatches // pp)
            if num_microbatches % rounds:
                raise ValueError(f"{where}, but schedule={self.schedule_name} runs them in max(1, M // pp) = "
                                 f"{rounds} rounds and torch needs M divisible by that: use a multiple of pp={pp}")
        if self.schedule_name == "zero_bubble" and compile:
            raise ValueError("schedule=zero_bubble splits each backward into input- and weight-gradient parts, "
                             "which torch does not support for compiled modules: set trainer.compile=false or "
                             "pick schedule=interleaved_1f1b")

    # ---- topology -----------------------------------------------------------------------------------
    @property
    def pipelining(self) -> bool:
        """Whether there is a pipeline (a combined strategy may run with pp=1: then every hook here
        defers to the next class in the MRO)."""
        return self.dims.pp_enabled

    @property
    def pp_mesh(self) -> Any:
        return self.dims.mesh["pp"]

    @property
    def pp_rank(self) -> int:
        return self.pp_mesh.get_local_rank()

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pp_mesh.get_group()

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    @property
    def last_stage_pp_rank(self) -> int:
        """pp-group rank of the stage that computes the loss (looped placement: stage s on rank s % P)."""
        return (self.num_stages - 1) % self.pp_size

    # ---- model --------------------------------------------------------------------------------------
    def split_pipeline(self, model: nn.Module) -> list[nn.Module]:
        """This rank's stages, in increasing stage order (the order the schedule expects)."""
        if not self.pipelining:
            return super().split_pipeline(model)
        num_layers = len(model.layers)  # type: ignore[arg-type]
        self.num_stages = self.pp_size * self.virtual_stages
        self.stage_ranges = stage_layer_ranges(num_layers, self.num_stages, layers_per_stage=self.layers_per_stage,
                                               embedding_weight=self.embedding_weight,
                                               head_weight=self.head_weight)
        self.stage_indices = stage_indices_of_rank(self.pp_rank, self.pp_size, self.virtual_stages)
        if self.is_global_zero:
            layout = ", ".join(f"{s}: layers {r.start}-{r.stop - 1}" for s, r in enumerate(self.stage_ranges))
            log.info(f"pipeline: {self.num_stages} stages over pp={self.pp_size} ({self.schedule_name}); {layout}")
        parts = split_model(model, self.stage_ranges, self.stage_indices)
        self._make_tied_group(model)
        # Cooperative: a subclass combining PP with other model parallelism may split further.
        result: list[nn.Module] = []
        for part in parts:
            result.extend(super().split_pipeline(part))
        return result

    def setup_model(self, model: nn.Module, activation_checkpointing: ActivationCheckpointing, precision: Precision,
                    compile: bool) -> list[nn.Module]:
        parts = super().setup_model(model, activation_checkpointing, precision, compile)
        if not self.pipelining:
            return parts
        self._find_tied_param(parts)
        if self._tied_param is not None:
            # Identical copies to start with (they differ only after a sharded init, which draws the
            # head separately): the first stage's embedding wins.
            with torch.no_grad():
                dist.broadcast(_local(self._tied_param.data), group=self._tied_group, group_src=0)
        if self.pp_rank > 0:
            # Every rank was seeded alike; without an offset, dropout on stage s would draw the same masks
            # as on stage 0. (Data order does not use torch's generator.)
            torch.manual_seed(torch.initial_seed() + 1_000_003 * self.pp_rank)
        return parts

    def build_optimizer(self, optimizer_cfg: DictConfig, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
        return super().build_optimizer(optimizer_cfg, self.optimizer_modules(model_parts))

    def optimizer_modules(self, model_parts: Sequence[nn.Module]) -> list[nn.Module]:
        """The modules whose parameters the optimizer groups are made from."""
        if self._tied_is_mirror and self._tied_param is not None:
            # The head copy is owned by a Linear here, which would put it in the weight-decay group; in the
            # unsplit model it is the embedding table (no decay). An extra owner of embedding type keeps
            # both copies in the same group, so they receive identical updates.
            owner = nn.Embedding(1, 1, device="meta")
            owner.weight = self._tied_param
            return [*model_parts, owner]
        return list(model_parts)

    def _make_tied_group(self, model: nn.Module) -> None:
        """A process group per pipeline line joining the first- and last-stage ranks, when the model ties
        its output head to its input embedding (new_group is collective: every rank creates every pair)."""
        embedding, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
        if embedding is None or head is None or head.weight is not embedding.weight:
            return
        mesh = self.dims.mesh
        names = list(mesh.mesh_dim_names or ())
        lines = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, self.pp_size)
        last = self.last_stage_pp_rank
        for line in lines.tolist():
            group = dist.new_group([line[0], line[last]])
            if dist.get_rank() in (line[0], line[last]):
                self._tied_group = group

    def _find_tied_param(self, parts: Sequence[nn.Module]) -> None:
        if self._tied_group is None:
            return
        for part in parts:
            module = self.unwrap(part)
            stage = getattr(module, "pp_stage_index", None)
            if stage == 0:
                self._tied_param = module.tok_embeddings.weight  # type: ignore[union-attr]
            elif stage == self.num_stages - 1:
                self._tied_param, self._tied_is_mirror = module.output.weight, True  # type: ignore[union-attr]

    def _sync_tied_grad(self) -> None:
        """Sum the embedding's and the head's gradients: both copies get the tied parameter's gradient."""
        if self._tied_param is None or self._tied_param.grad is None:
            return
        dist.all_reduce(_local(self._tied_param.grad), op=dist.ReduceOp.SUM, group=self._tied_group)

    def materialize(self, model: nn.Module) -> None:
        """Initialize a stage on its own (big models); each stage draws from its own seed.

        Every rank starts from the same seed, so without an offset stages that lack the embedding
        would draw identical numbers and initialize their blocks identically. (Models that fit are
        initialized in full before the split instead, and never get here.)
        """
        stage = getattr(self.unwrap(model), "pp_stage_index", 0)
        if stage == 0:
            super().materialize(model)
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(torch.initial_seed() + 1_000_003 * stage)
            super().materialize(model)

    # ---- step ---------------------------------------------------------------------------------------
    def compute_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss of one micro-batch on the last stage (a TP subclass may use loss parallelism)."""
        return cross_entropy_loss(logits, targets)

    def _pipeline_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: 1/M of the micro-batch loss, loss-scaled when training.

        Dividing by M here (and telling the schedule not to rescale gradients) makes the accumulated
        gradient that of the mean loss over the step, as in single-process gradient accumulation.
        The unscaled value is recorded for reporting. torch's shape inference also calls this once
        before the real micro-batches (first step, and after each evaluation), hence "the last M".
        """
        loss = self.compute_loss(output, targets) / self._schedule_microbatches
        self._recorded_losses.append(loss.detach())
        if self._scale_in_loss and self._precision is not None:
            return self._precision.scale_loss(loss)
        return loss

    def _build_schedule(self, model_parts: Sequence[nn.Module], num_microbatches: int,
                        precision: Precision) -> Any:
        if self._schedule is not None and self._schedule_microbatches == num_microbatches:
            return self._schedule
        if len(model_parts) != len(self.stage_indices):
            raise RuntimeError(f"expected {len(self.stage_indices)} model parts (this rank's stages), "
                               f"got {len(model_parts)}")
        self._stages = [
            _PrecisionStage(part, index, self.num_stages, self.device, group=self.pp_group,
                            autocast=precision.autocast)
            for part, index in zip(model_parts, self.stage_indices)
        ]
        schedule_class = SCHEDULES[self.schedule_name]
        stages: Any = self._stages if self.schedule_name in MULTI_STAGE_SCHEDULES else self._stages[0]
        self._schedule_microbatches = num_microbatches
        # scale_grads=False: the loss function already divides by the number of micro-batches
        self._schedule = schedule_class(stages, n_microbatches=num_microbatches, loss_fn=self._pipeline_loss,
                                        scale_grads=False)
        return self._schedule

    def _run_schedule(self, model_parts: Sequence[nn.Module], microbatches: Sequence[MicroBatch],
                      precision: Precision, train: bool) -> torch.Tensor:
        """One schedule step (train) or forward pass (eval); the mean loss, on the last stage only."""
        num = len(microbatches)
        schedule = self._build_schedule(model_parts, num, precision)
        self._precision = precision
        self._scale_in_loss = train
        self._recorded_losses = []
        args: tuple[torch.Tensor, ...] = ()
        if self.holds_first_stage:  # the schedule cuts the local batch back into the same micro-batches
            args = (torch.cat([x for x, _ in microbatches]).to(self.device, non_blocking=True),)
        target = None
        losses: list[torch.Tensor] | None = None
        if self.holds_last_stage:
            target = torch.cat([y for _, y in microbatches]).to(self.device, non_blocking=True)
            losses = []
        if train:
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        if not self.holds_last_stage:
            return torch.zeros((), device=self.device)
        assert losses is not None and len(losses) == num, f"expected {num} micro-batch losses, got {losses}"
        return torch.stack(self._recorded_losses[-num:]).sum()

    def _from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """The last stage's value on every rank of the pp group (so every rank can log it)."""
        value = value.detach().clone().float()
        dist.broadcast(value, group=self.pp_group, group_src=self.last_stage_pp_rank)
        return value

    def forward_backward(self, model_parts: Sequence[nn.Module], microbatches: Sequence[MicroBatch],
                         precision: Precision,
                         on_before_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run the pipeline schedule over this rank's micro-batches; the mean loss on every pp rank.

        `on_before_backward` is not called: the backward passes happen inside torch's schedule (see
        `Callback.on_before_backward`). The loss goes through `precision.scale_loss` in the loss
        function, so a loss scaler scales what the schedule back-propagates.
        """
        if not self.pipelining:
            return super().forward_backward(model_parts, microbatches, precision, on_before_backward)
        loss = self._run_schedule(model_parts, microbatches, precision, train=True)
        self._sync_tied_grad()
        return self._from_last_stage(loss)

    @torch.no_grad()
    def evaluate(self, model_parts: Sequence[nn.Module], batches: Sequence[MicroBatch], precision: Precision) -> float:
        """Mean loss over the validation micro-batches, forward only through the pipeline (`schedule.eval`).

        The batches are run in groups of the training schedule's micro-batch count (run.py builds the
        validation set as `val_batches` such groups), so the same stages and buffers serve both.
        """
        if not self.pipelining:
            return super().evaluate(model_parts, batches, precision)
        num = self._schedule_microbatches or len(batches)
        if len(batches) % num:
            raise ValueError(f"{len(batches)} validation micro-batches do not split into pipeline steps of {num}")
        for part in model_parts:
            part.eval()
        try:
            total = torch.zeros((), device=self.device)
            for start in range(0, len(batches), num):
                total += self._run_schedule(model_parts, batches[start:start + num], precision, train=False)
        finally:
            for part in model_parts:
                part.train()
        mean = self._from_last_stage(total / (len(batches) // num))
        return self.reduce_mean(mean).item()

    # ---- gradient norm ------------------------------------------------------------------------------
    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        """Global L2 norm over every stage's gradients; clip all of them by the same factor.

        Each rank sums the squares of its stages' gradient norms, the sums are all-reduced over the pp
        group, and every rank scales its gradients by max_norm / (norm + 1e-6) capped at 1 (the formula
        of `torch.nn.utils.clip_grad_norm_`). Sharded gradients (DTensor, from FSDP or TP) contribute
        their full norm, reduced over their own mesh.
        """
        if not self.pipelining:
            return super().clip_grad_norm(model_parts, max_norm)
        params: dict[int, nn.Parameter] = {}
        for part in model_parts:
            for p in part.parameters():
                if p.grad is not None:
                    params.setdefault(id(p), p)
        grads = [p.grad for p in params.values()]
        # a tied head's copy holds the same gradient as the embedding on the first stage: count it once
        counted = [p.grad for p in params.values() if not (self._tied_is_mirror and p is self._tied_param)]
        squared = local_grad_norm(counted) ** 2  # type: ignore[arg-type]
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pp_group)
        total = squared.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            with torch.no_grad():
                for grad in grads:
                    local = _local(grad)  # type: ignore[arg-type]
                    local.mul_(coef.to(local.device, local.dtype))
        return total

    # ---- checkpoint / comparison ----------------------------------------------------------------------
    def teardown(self) -> None:
        # The stages and the schedule hold the model parts (and any reducer inside them), which must
        # be released before the process group is destroyed.
        self._stages, self._schedule, self._tied_param = [], None, None
        gc.collect()
        super().teardown()

    def full_state_dict(self, model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        """Every stage's full weights, gathered to pp rank 0 (other ranks get only their own stages).

        Keys are those of the unsplit model, so the result loads into a single-process model.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.pipelining:
            return super().full_state_dict(model_parts)
        # Not the base class's options: with cpu_offload torch returns the full weights on global rank 0
        # only, and the other stages' ranks would send nothing. Gathered unsharded on every rank of the
        # stage's own dp/tp mesh, then moved to CPU here.
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        local: dict[str, torch.Tensor] = {}
        for part in model_parts:
            for key, value in get_model_state_dict(part, options=options).items():
                local[key] = value.detach().cpu()
        gathered: list[Any] | None = [None] * self.pp_size if self.pp_rank == 0 else None
        dist.gather_object(local, gathered, group=self.pp_group, group_dst=0)
        if gathered is None:
            return local
        merged: dict[str, torch.Tensor] = {}
        for stage_weights in gathered:
            merged.update(stage_weights)
        return merged


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (shares storage, so in-place ops write through), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of `grads` (plain tensors and DTensors, possibly on different meshes), as a plain tensor.

    DTensors are grouped by mesh and placements (torch's foreach norm needs one layout per call); the
    norm of a sharded group is a Partial DTensor whose `full_tensor()` sums over that mesh, and that of
    a replicated one is already complete.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else ("plain", grad.device)
        groups.setdefault(key, []).append(grad)
    squares: list[torch.Tensor] = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if not squares:
        device = grads[0].device if grads else torch.device("cpu")
        return torch.zeros((), device=device)
    device = squares[0].device
    return torch.stack([s.to(device) for s in squares]).sum().sqrt()


@dataclass
class PipelineParallelConfig:
    """Schema of `strategy=pp`: pipeline parallelism over `pp` ranks (world size = pp)."""

    _target_: str = "trainer.plugins.strategies.pipeline.PipelineParallel"
    name: str = "pp"
    # Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (needs virtual_stages >= 2 to interleave) or
    # zero_bubble (torch's ScheduleInterleavedZeroBubble; virtual_stages >= 2, no trainer.compile).
    schedule: str = "1f1b"
    # Stages per rank: rank r holds stages r, r + pp, r + 2 pp, ... (1 for gpipe and 1f1b).
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
