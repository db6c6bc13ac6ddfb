"""The pipeline component: this rank's stages, the schedule that drives them, and what crosses stages.

Each rank of the `pp` mesh dimension holds one stage (or, for the interleaved schedules, several
"virtual" stages r, r + P, r + 2P, ...: Narayanan et al. 2021; for ZBV and DualPipeV two stages in a V,
r and 2P - 1 - r, so that rank 0 holds the first and the last stage and computes the loss). A stage is a copy of the model that
keeps only its own transformer blocks (`layers` keys unchanged, so checkpoints and optimizer states
keep their names); the token embedding lives on the first stage, the final norm and the output head
on the last (`CausalLM.first_stage_modules` / `last_stage_modules`; DeepSeek-V3's last stage also holds
its multi-token-prediction module and a copy of the embedding, `pipeline_tied.py`), and the model's
forward skips the modules that are None. Every stage gets its micro-batch's token and document ids
(`pipeline_tokens`, `pipeline_doc_ids`): a later stage receives only hidden states.

One optimizer step is one schedule step over this rank's micro-batches: the data loader already
cuts the global batch into `global_batch / (micro_batch x dp)` micro-batches, which become the
pipeline's micro-batches, so the arithmetic is exactly that of gradient accumulation. The loss
function divides each micro-batch loss by their number (the schedule's own gradient scaling is off),
so gradients equal those of the single-process mean loss.

`Pipeline` is held by `strategy=pp` and `strategy=3d` (made when they split the model, pp > 1); it is
given the options, the process topology, the device and the precision plugin, and knows nothing of
tensor or data parallelism: the parts it is handed may be TP-sharded and FSDP-wrapped.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.interfaces.precision import Precision
from trainer.interfaces.strategy import MicroBatch
from trainer.loss import cross_entropy_loss
from trainer.models import family_of
from trainer.models.moe import aux_loss_grad_scale_set, expert_comm_gate_set
from trainer.parallel_dims import ParallelDims
from trainer.plugins.strategies.pipeline_overlap import ExpertOverlap
from trainer.plugins.strategies.pipeline_schedule import (
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    PipelineOptions,
    PrecisionStage,
    v_forward_only_order,
)
from trainer.plugins.strategies.pipeline_split import last_stage_rank, split_model, stage_indices_of_rank
from trainer.plugins.strategies.distributed import local_grad_norm
from trainer.plugins.strategies.pipeline_tied import TiedWeights, local_tensor

log = logging.getLogger("trainer")
# Stage s > 0 offsets the seed by s x this prime (sharded init of its weights, then its dropout masks).
STAGE_SEED_STRIDE = 1_000_003


@contextlib.contextmanager
def stage_init_seed(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Around the initialization of one stage on its own (big models): each stage draws from its own seed.

    Every rank starts from the same seed, so without an offset stages that lack the embedding would draw
    identical numbers and initialize their blocks identically. (Models that fit are initialized in full
    before the split instead: their `pp_stage_index` is that of the whole model, 0.)
    """
    stage = getattr(module, "pp_stage_index", 0)
    if stage == 0:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(torch.initial_seed() + STAGE_SEED_STRIDE * stage)
        yield


class Pipeline:
    """This rank's pipeline stages over the `pp` mesh dimension and the schedule that runs them."""

    def __init__(self, options: PipelineOptions, dims: ParallelDims, device: torch.device, precision: Precision,
                 *, compute_loss: Callable[..., torch.Tensor] = cross_entropy_loss,
                 log_layout: bool = False) -> None:
        self.options = options
        self.dims = dims
        self.device = device
        self.precision = precision  # autocast of the stages' forwards, scaling of the loss
        # the token loss of one micro-batch on the last stage: (logits, targets, reduction="mean" | "sum")
        self.compute_loss = compute_loss
        self._normalizer: torch.Tensor | None = None  # document masking: `Strategy.loss_normalizer`
        self.log_layout = log_layout
        self.num_stages = self.pp_size * options.virtual_stages
        # Filled by `split` / built lazily on the first step (the schedule needs the number of
        # micro-batches, which only the loop knows).
        self.stage_ranges: list[range] = []
        self.stage_indices: list[int] = []
        self.stages: list[PrecisionStage] = []
        self._schedule: Any = None
        self._forward_order: Any = None  # V schedules' evaluation: forwards only, with their sends/receives
        self._schedule_microbatches = 0
        self._scale_in_loss = False
        self._recorded_losses: list[torch.Tensor] = []
        self.tied = TiedWeights()
        self.family: Any = None  # the model's family (`split`)
        # DualPipeV's expert overlap (its `pairing`), or only the timing of the expert all-to-alls (a benchmark's
        # `ExpertOverlap(pairing=False)`); None: neither. Set before the first step (`ThreeD.setup_model`).
        self.expert_overlap: ExpertOverlap | None = None

    # ---- topology -----------------------------------------------------------------------------------
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
        """pp-group rank of the stage that computes the loss (looped placement: stage s on rank s % P; in a
        V: rank 0)."""
        return last_stage_rank(self.pp_size, self.options.virtual_stages, self.options.v_shape)

    # ---- model --------------------------------------------------------------------------------------
    def split(self, model: nn.Module) -> list[nn.Module]:
        """This rank's stages of `model`, in increasing stage order (the order the schedule expects)."""
        self.family = family_of(model)
        self.stage_ranges = self.options.stage_ranges(len(self.family.blocks(model)), self.num_stages)
        self.stage_indices = stage_indices_of_rank(self.pp_rank, self.pp_size, self.options.virtual_stages,
                                                   self.options.v_shape)
        if self.log_layout:
            layout = ", ".join(f"{s}: layers {r.start}-{r.stop - 1}" for s, r in enumerate(self.stage_ranges))
            placement = ""
            if self.options.v_shape:
                placement = "; V placement, " + ", ".join(
                    f"rank {r}: stages {stage_indices_of_rank(r, self.pp_size, 2, True)}" for r in range(self.pp_size))
            log.info(f"pipeline: {self.num_stages} stages over pp={self.pp_size} ({self.options.schedule}); "
                     f"{layout}{placement}")
        parts = split_model(model, self.stage_ranges, self.stage_indices)
        self.tied.make_group(model, self.dims.mesh, self.pp_size, self.last_stage_pp_rank)
        return parts

    def finish_setup(self, parts: Sequence[nn.Module], unwrap: Callable[[nn.Module], nn.Module]) -> None:
        """After the parts are materialized and wrapped: one value for the tied weights, and each stage's
        own dropout stream."""
        self.tied.find(parts, unwrap, self.num_stages)
        self.tied.broadcast_from_first_stage()
        if self.pp_rank > 0:
            # Every rank was seeded alike; without an offset, dropout on stage s would draw the same masks
            # as on stage 0. (Data order does not use torch's generator.)
            torch.manual_seed(torch.initial_seed() + STAGE_SEED_STRIDE * self.pp_rank)

    def optimizer_modules(self, model_parts: Sequence[nn.Module]) -> list[nn.Module]:
        """The modules whose parameters the optimizer groups are made from."""
        return self.tied.optimizer_modules(model_parts)

    # ---- step ---------------------------------------------------------------------------------------
    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: 1/M of the micro-batch loss, loss-scaled when training.

        Dividing by M here (and telling the schedule not to rescale gradients) makes the accumulated
        gradient that of the mean loss over the step, as in single-process gradient accumulation.
        Under document masking the summed token loss is divided by the strategy's normalizer instead
        (`Strategy.loss_normalizer`). The unscaled value is recorded for reporting. torch's shape
        inference also calls this once before the real micro-batches (first step, and after each
        evaluation), hence "the last M".
        """
        if self._normalizer is None:
            loss = self.compute_loss(output, targets) / self._schedule_microbatches
        else:
            loss = self.compute_loss(output, targets, reduction="sum") / self._normalizer
        self._recorded_losses.append(loss.detach())
        if self._scale_in_loss:
            return self.precision.scale_loss(loss)
        return loss

    def _build_schedule(self, model_parts: Sequence[nn.Module], num_microbatches: int) -> Any:
        if self._schedule is not None and self._schedule_microbatches == num_microbatches:
            return self._schedule
        if len(model_parts) != len(self.stage_indices):
            raise RuntimeError(f"expected {len(self.stage_indices)} model parts (this rank's stages), "
                               f"got {len(model_parts)}")
        self.stages = [
            PrecisionStage(part, index, self.num_stages, self.device, group=self.pp_group,
                           autocast=self.precision.autocast, family=self.family,
                           split_backward=self.options.schedule in SPLIT_BACKWARD_SCHEDULES)
            for part, index in zip(model_parts, self.stage_indices)
        ]
        schedule_class = SCHEDULES[self.options.schedule]
        stages: Any = self.stages if self.options.multi_stage else self.stages[0]
        self._schedule_microbatches = num_microbatches
        # scale_grads=False: the loss function already divides by the number of micro-batches
        self._schedule = schedule_class(stages, n_microbatches=num_microbatches, loss_fn=self._loss,
                                        scale_grads=False)
        if self.expert_overlap is not None and self.expert_overlap.pairing and self.options.schedule == "dualpipev":
            from torch.distributed.pipelining.schedules import OVERLAP_F_B

            self._schedule.register_custom_function(OVERLAP_F_B, self.expert_overlap.run_pair)
        self._forward_order = None
        if self.options.v_shape:
            self._forward_order = v_forward_only_order(self._schedule, self.pp_size, num_microbatches)
        return self._schedule

    def _run_schedule(self, model_parts: Sequence[nn.Module], microbatches: Sequence[MicroBatch],
                      train: bool) -> torch.Tensor:
        """One schedule step (train) or forward pass (eval); the mean loss, on the last stage only."""
        num = len(microbatches)
        schedule = self._build_schedule(model_parts, num)
        self._scale_in_loss = train
        self._recorded_losses = []
        args: tuple[torch.Tensor, ...] = ()
        if self.holds_first_stage:  # the schedule cuts the local batch back into the same micro-batches
            args = (torch.cat([batch[0] for batch in microbatches]).to(self.device, non_blocking=True),)
        target = None
        losses: list[torch.Tensor] | None = None
        if self.holds_last_stage:
            target = torch.cat([batch[1] for batch in microbatches]).to(self.device, non_blocking=True)
            losses = []
        # each stage reads its micro-batch's token and document ids (every rank has them)
        tokens = [batch[0].to(self.device, non_blocking=True) for batch in microbatches]
        doc_ids = [batch[2].to(self.device) if len(batch) > 2 else None for batch in microbatches]
        for stage in self.stages:
            stage.chunk_tokens, stage.chunk_doc_ids = tokens, doc_ids
        if train:
            with expert_comm_gate_set(self.expert_overlap):
                schedule.step(*args, target=target, losses=losses, return_outputs=False)
        elif self._forward_order is not None:
            # torch's V schedules run their backward actions in eval too (skipped, except the local hand-over
            # of a gradient between a rank's two stages, which then fails): evaluate with forwards only
            training_order = schedule.pipeline_order_with_comms
            schedule.pipeline_order_with_comms = self._forward_order
            try:
                schedule.eval(*args, target=target, losses=losses, return_outputs=False)
            finally:
                schedule.pipeline_order_with_comms = training_order
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
                         normalizer: torch.Tensor | None = None) -> torch.Tensor:
        """Run the schedule over this rank's micro-batches; the mean loss on every pp rank.

        The backward passes happen inside torch's schedule (so a strategy's `on_before_backward` is not
        called). The loss goes through `precision.scale_loss` in the loss function, so a loss scaler
        scales what the schedule back-propagates. `normalizer`: see `_loss`.
        """
        # MoE aux losses (on any stage) get the gradient each micro-batch's LM loss gets in the loss function.
        unit = torch.ones((), device=self.device) / len(microbatches)
        self._normalizer = normalizer
        try:
            with aux_loss_grad_scale_set(float(self.precision.scale_loss(unit))):
                loss = self._run_schedule(model_parts, microbatches, train=True)
        finally:
            self._normalizer = None
        self.tied.sum_grads()
        # what one stage accumulated for the whole model (DeepSeek-V3's MTP losses), on every pp rank
        if self.family is not None:
            self.family.sum_statistics_over_stages(model_parts, self._sum_over_stages)
        return self._from_last_stage(loss)

    def _sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        total = value.to(self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pp_group)
        return total.cpu()

    @torch.no_grad()
    def evaluate(self, model_parts: Sequence[nn.Module], batches: Sequence[MicroBatch],
                 normalizer: torch.Tensor | None = None) -> torch.Tensor:
        """Mean loss over the validation micro-batches, forward only (`schedule.eval`), on every pp rank
        (not yet averaged over data-parallel ranks). With a `normalizer` (document masking: the
        strategy's `loss_normalizer` of all the batches), the sum of their token losses divided by it.

        The batches are run in groups of the training schedule's micro-batch count (run.py builds the
        validation set as `val_batches` such groups), so the same stages and buffers serve both.
        """
        num = self._schedule_microbatches or len(batches)
        if len(batches) % num:
            raise ValueError(f"{len(batches)} validation micro-batches do not split into pipeline steps of {num}")
        for part in model_parts:
            part.eval()
        self._normalizer = normalizer
        try:
            total = torch.zeros((), device=self.device)
            for start in range(0, len(batches), num):
                total += self._run_schedule(model_parts, batches[start:start + num], train=False)
        finally:
            self._normalizer = None
            for part in model_parts:
                part.train()
        return self._from_last_stage(total if normalizer is not None else total / (len(batches) // num))

    # ---- across stages --------------------------------------------------------------------------------
    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        """Global L2 norm over every stage's gradients; clip all of them by the same factor.

        Each rank sums the squares of its stages' gradient norms, the sums are all-reduced over the pp
        group, and every rank scales its gradients by max_norm / (norm + 1e-6) capped at 1 (the formula
        of `torch.nn.utils.clip_grad_norm_`). Sharded gradients (DTensor, from FSDP or TP) contribute
        their full norm, reduced over their own mesh.
        """
        params: dict[int, nn.Parameter] = {}
        for part in model_parts:
            for p in part.parameters():
                if p.grad is not None:
                    params.setdefault(id(p), p)
        grads = [p.grad for p in params.values()]
        # a tied head's copy holds the same gradient as the embedding on the first stage: count it once
        counted = [p.grad for p in params.values() if not self.tied.is_mirror(p)]
        squared = local_grad_norm(counted) ** 2  # type: ignore[arg-type]
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pp_group)
        total = squared.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            with torch.no_grad():
                for grad in grads:
                    local = local_tensor(grad)  # type: ignore[arg-type]
                    local.mul_(coef.to(local.device, local.dtype))
        return total

    def full_state_dict(self, model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        """Every stage's full weights, gathered to pp rank 0 (other ranks get only their own stages).

        Keys are those of the unsplit model, so the result loads into a single-process model.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Not the base strategy's options: with cpu_offload torch returns the full weights on global rank 0
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

    def release(self) -> None:
        """Drop the stages and the schedule, which hold the model parts (and any reducer inside them):
        they must be released before the process group is destroyed."""
        self.stages, self._schedule = [], None
        self.tied.release()
