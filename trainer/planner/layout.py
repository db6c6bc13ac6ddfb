"""What the planner needs to know about a run, read once from the composed config.

`Layout` is a plain dataclass (no OmegaConf, no plugin instances), so the search can derive thousands of
variants of it cheaply; `layout_from_config` reads it from a validated config through the same strategy,
precision and checkpointing plugins a run instantiates (through their interfaces' hooks), so the two never disagree on what a name means.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainer.optim import hidden_matrix_state_tensors, optimizer_state_tensors
if TYPE_CHECKING:
    from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
    from trainer.interfaces.precision import Precision

# Data-parallel flavours and what each shards at rest (params, grads, optimizer states).
DP_FLAVOURS = ("none", "ddp", "zero1", "zero2", "shard_grad_op", "zero3", "hybrid_shard")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# Schedules that place 2 stages per rank in a V (rank r holds stages r and 2P - 1 - r).
V_SCHEDULES = ("zbv", "dualpipev")
CHECKPOINTING = ("none", "attention", "selective", "every_n", "full", "offload")
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}


@dataclass(frozen=True)
class Layout:
    """One configuration as the planner sees it: parallel sizes, memory policies, batch, number formats."""

    # ---- topology ----
    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    # ---- strategy ----
    strategy: str  # the strategy option: single, ddp, zero1, zero2, zero3, fsdp, tp, pp, 3d
    dp_flavour: str  # one of DP_FLAVOURS
    # Context parallel: each sequence split over cp ranks (activations / cp; weights, gradients and
    # optimizer states are reduced and sharded over dp x cp).
    cp: int = 1
    # ring (K/V blocks round the cp ring) or all_to_all (Ulysses); see trainer/models/context_parallel.py.
    cp_method: str = "ring"
    # Expert parallel: MoE experts split over ep of the dp x cp ranks (trainer/parallel_dims.py); expert
    # weights are then replicated or sharded over the dp x cp / ep ranks left (edp).
    ep: int = 1
    # FSDP: free the gathered parameters after each block's forward (zero3) or keep them (shard_grad_op).
    reshard_after_forward: bool = True
    # ... the last block's too (FSDP's reshard_last_block; by default it keeps them for the backward).
    reshard_last_block: bool = False
    prefetch_blocks: int = 1
    # FSDP under accumulation: reduce-scatter per micro-batch ("microbatch") or once per step ("step", the
    # gradient accumulated unsharded), and whether gathered parameters are freed between micro-batches. A
    # pipeline schedule does both its own way: one reduction per step, parameters kept gathered.
    grad_sync: str = "microbatch"
    reshard_after_backward: bool = True
    # Sharded states (params, grads, optimizer) kept in host memory (FSDP CPUOffloadPolicy).
    offload: bool = False
    # Only the optimizer states (and fp32 masters) in host memory, stepped there (ZeRO-Offload).
    offload_optimizer: bool = False
    sequence_parallel: bool = True
    loss_parallel: bool = True
    # Attention masked per document (data.document_masking): an explicit mask, so no causal block skipping.
    document_masking: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    layers_per_stage: Optional[tuple[int, ...]] = None
    embedding_weight: float = 1.0
    head_weight: float = 1.0
    # DDP gradient compression: none, fp16, bf16 (half the bytes) or powersgd.
    comm_hook: str = "none"
    bucket_cap_mb: float = 25.0
    # ---- memory policies ----
    checkpointing: str = "none"  # one of CHECKPOINTING
    checkpoint_every_n: int = 1
    # ---- batch ----
    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_len: int = 2048
    # ---- number formats (bytes per element) ----
    precision: str = "fp32"
    param_bytes: int = 4  # stored parameters (and their gradients)
    compute_bytes: int = 4  # activations and matmuls (autocast dtype)
    compute_dtype: torch.dtype = torch.float32
    # FSDP: dtype of the gathered (unsharded) parameters and of the gradient reduce-scatter.
    unsharded_param_bytes: int = 4
    reduce_bytes: int = 4
    # An extra fp32 copy of the weights kept by the precision plugin or optimizer (bf16_true with master).
    master_bytes: int = 0
    # Optimizer state tensors per parameter (AdamW: exp_avg and exp_avg_sq; SGD with momentum: 1).
    optimizer_states: int = 2
    # States per element of the hidden matrices when the optimizer steps them apart (Muon: its momentum, 1;
    # the other parameters keep `optimizer_states`, AdamW's 2); None: the same as every parameter.
    hidden_matrix_states: int | None = None
    optimizer_state_bytes: int = 4
    # The optimizer config asks for torch's fused kernel, or leaves it to the default that takes it where
    # it runs (`fused: null` and no `foreach`: trainer.optim.optimizer_factory_from_config).
    optimizer_fused_requested: bool = False
    # `trainer.compile`: each block is an Inductor graph, whose weight casts are its own intermediates (no
    # autocast cache of them through the forward), and the loss runs through Inductor too
    # (trainer.loss.cross_entropy_loss), keeping no fp32 log-probabilities and writing the logits' gradient
    # once, in the logits' dtype (not when the logits are sharded on the vocabulary: loss parallelism runs
    # eager).
    compiled: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """The pipeline stages `pp_rank` holds: r, r + P, ... (looped), r and 2P - 1 - r (zbv, dualpipev), or
        the one stage without pipelining."""
        if self.pp == 1:
            return [0]
        if self.schedule in V_SCHEDULES:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + v * self.pp for v in range(self.virtual_stages)]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on one data-parallel rank (gradient accumulation, or the
        pipeline's micro-batches)."""
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dp))

    @property
    def fsdp(self) -> bool:
        return self.dp_flavour in ("shard_grad_op", "zero3", "hybrid_shard") and self.shard_group > 1

    @property
    def replica_group(self) -> int:
        """Ranks over which replicated weights' gradients are averaged (ddp, zero1, zero2 partition over
        them too): the replicas x cp."""
        return self.dp_replicate * self.cp

    @property
    def shard_group(self) -> int:
        """Ranks FSDP shards over: dp_shard x cp (hybrid sharding replicates across dp_replicate)."""
        return self.dp_shard * self.cp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts: dp x cp / ep."""
        return self.dp * self.cp // self.ep

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence one rank holds (the whole sequence without context parallelism)."""
        return self.seq_len // self.cp

    @property
    def autocast(self) -> bool:
        """Mixed precision by autocast: weights stored wider than the matmuls run."""
        return self.compute_bytes < self.param_bytes

    @property
    def gathers_compute_copy(self) -> bool:
        """The forward reads a gathered copy of the weights in `unsharded_param_bytes` (FSDP2's flavours, and
        the 3d strategy's `replicate`, which is FSDP2's machinery), not the stored parameters."""
        return (self.dp_flavour in ("shard_grad_op", "zero3", "hybrid_shard")
                or (self.strategy == "3d" and self.replica_group > 1))

    @property
    def forward_weight_bytes(self) -> int:
        """Bytes per element of the weights the forward computes with, before autocast."""
        return self.unsharded_param_bytes if self.gathers_compute_copy else self.param_bytes

    @property
    def casts_weights(self) -> bool:
        """Autocast casts every matmul weight (and each matmul's input) to the compute dtype: the weights
        the forward reads are wider than the matmuls (bf16/fp16 autocast over fp32 parameters; not under
        bf16_true or fp32, nor where FSDP2's policy gathers them in the compute dtype already)."""
        return self.compute_bytes < self.forward_weight_bytes

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream (embedding output, block inputs and outputs, the norms'
        inputs): the dtype of the weights the forward reads, since autocast leaves embeddings, residual
        adds and norms in it (fp32 under bf16/fp16 autocast over fp32 parameters)."""
        return max(self.forward_weight_bytes, self.compute_bytes)

    @property
    def optimizer_fused(self) -> bool:
        """Whether the optimizer steps with torch's fused kernel (in place: no intermediates the size of its
        states), which takes every tensor only when they are all plain or all DTensors of one mesh
        (trainer.optim._fused_kernel_runs_on): not with tensor parallelism's plain norms beside its shards
        (no sequence parallelism), nor expert parallelism's second mesh, nor float8's FSDP weight subclass."""
        mixed = (self.tp > 1 and not self.sequence_parallel) or self.ep > 1
        float8_shards = self.precision.startswith("fp8") and self.gathers_compute_copy
        return self.optimizer_fused_requested and not mixed and not float8_shards

    def replace(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)


def layout_from_config(cfg: DictConfig, *, precision: Optional[Precision] = None,
                       activation_checkpointing: Optional[ActivationCheckpointing] = None) -> Layout:
    """The layout of a composed (and validated) config: the strategy states its own part of it
    (`Strategy.planner_layout`, asked of a strategy built from `cfg.strategy` with no environment), so a new
    strategy is planned as what it is, not by its class. `precision` and `activation_checkpointing`: the
    plugins a run has built from `cfg` already (trainer.run settles grad_sync with them), else built here."""
    from trainer.config import data_parallel_size, world_size

    strategy = instantiate(cfg.strategy)
    tp = int(cfg.tp) if strategy.uses_tp else 1
    pp = int(cfg.pp) if strategy.uses_pp else 1
    cp = int(cfg.cp) if strategy.uses_cp else 1
    topology = strategy.planner_layout(data_parallel_size(cfg), tp, pp, cp)

    if precision is None:
        precision = instantiate(cfg.precision)
    param_dtype = precision.param_dtype
    compute_dtype = precision.compute_dtype
    mp = precision.fsdp_mixed_precision()
    unsharded = mp.param_dtype or param_dtype
    reduce = mp.reduce_dtype or unsharded
    # bf16_true's fp32 master copies: the optimizer steps them, so its moments are fp32 too
    master = precision.master_weights and DTYPE_BYTES[param_dtype] < 4

    checkpointing = activation_checkpointing if activation_checkpointing is not None else \
        instantiate(cfg.activation_checkpointing)
    states = optimizer_state_tensors(cfg.optimizer)
    t = cfg.trainer
    return Layout(
        world_size=world_size(cfg), strategy=str(cfg.strategy.get("name", None) or strategy.name), **topology,
        cp_method=str(cfg.cp_method), ep=int(cfg.get("ep", 1)),
        document_masking=bool(cfg.data.get("document_masking", False)),
        checkpointing=str(checkpointing.name), checkpoint_every_n=checkpointing.checkpoint_every_n,
        micro_batch_size=int(t.micro_batch_size), global_batch_size=int(t.global_batch_size), seq_len=int(t.seq_len),
        precision=str(precision.name),
        param_bytes=DTYPE_BYTES[param_dtype], compute_bytes=DTYPE_BYTES[compute_dtype], compute_dtype=compute_dtype,
        unsharded_param_bytes=DTYPE_BYTES[unsharded], reduce_bytes=DTYPE_BYTES[reduce],
        master_bytes=4 if master else 0,
        optimizer_states=states, hidden_matrix_states=hidden_matrix_state_tensors(cfg.optimizer),
        optimizer_state_bytes=4 if master else DTYPE_BYTES[param_dtype],
        optimizer_fused_requested=_fused_requested(cfg.optimizer), compiled=bool(t.compile),
    )


def _fused_requested(optimizer: DictConfig) -> bool:
    """`fused: true`, or `fused: null` without `foreach` (the default that takes the fused kernel)."""
    if "fused" not in optimizer:
        return False
    fused = optimizer.get("fused")
    return bool(fused) or (fused is None and optimizer.get("foreach", None) is None)


def model_config(cfg: DictConfig) -> Any:
    """The model config dataclass of a composed config (its family's `config_class`)."""
    return OmegaConf.to_object(cfg.model)
