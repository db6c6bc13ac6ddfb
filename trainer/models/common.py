"""Pieces shared by the decoder-only model families: parameter/FLOP accounting, init helpers."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from trainer.models.context_parallel import ContextParallel
from trainer.models.documents import document_positions
from trainer.models.moe import MoE


def require_divisible(numerator: int, denominator: int, what: str) -> None:
    """Raise ``ValueError`` unless ``numerator`` is a positive multiple of ``denominator``."""
    if numerator <= 0 or denominator <= 0 or numerator % denominator != 0:
        raise ValueError(
            f"{what}: {numerator} must be a positive multiple of {denominator}"
        )


def require_positive(value: int | float, what: str) -> None:
    """Raise ``ValueError`` unless ``value`` is strictly positive."""
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")


def module_device(module: nn.Module) -> torch.device:
    """Device of the first parameter (or buffer) of ``module``; CPU for an empty module."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def unique_numel(tensors: Iterable[torch.Tensor]) -> int:
    """Total element count, counting a tensor that appears several times (tied weights) once."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        seen[id(tensor)] = tensor.numel()
    return sum(seen.values())


def init_linear_(linear: nn.Linear, std: float) -> None:
    """Normal(0, std) weight, zero bias; draws from torch's global RNG."""
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


@contextmanager
def rng_stream(stream: int, device: torch.device) -> Iterator[None]:
    """Run the enclosed random ops (dropout) on stream `stream` of the shared random generator.

    Stream 0 is the shared generator itself. Stream k > 0 draws one seed from it, so that every rank (and
    an activation-checkpointing recompute, which restores the generator first) advances it alike, and runs
    on that seed + k, leaving the shared generator as the draw left it. Tensor parallelism gives each
    rank its own stream for the dropout of what is split across ranks (attention heads; the sequence
    shards of sequence parallelism), as Megatron-LM's model-parallel RNG tracker does: on the shared
    stream every rank would drop the same positions of its shard. What is replicated across ranks keeps
    stream 0, where every rank draws the same mask.
    """
    if stream == 0:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,)))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed + stream)
        if devices:
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed + stream)
        yield


class StreamDropout(nn.Dropout):
    """Dropout drawing its mask from `rng_stream(self.rng_stream)` (0, the shared stream, by default)."""

    rng_stream: int = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        with rng_stream(self.rng_stream, input.device):
            return super().forward(input)


def matmul_params(root: nn.Module) -> int:
    """Weights one token multiplies with under `root`: every ``nn.Linear`` weight, and the top_k of
    n_experts routed-expert weights of each MoE layer."""
    total = 0
    for module in root.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel()
        elif isinstance(module, MoE):
            experts = sum(p.numel() for p in module.experts.parameters())
            total += experts * module.top_k // module.n_experts
    return total


class CausalLM(nn.Module):
    """Base class of the decoder-only language models: parameter and FLOP accounting.

    Subclasses own ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict``), ``norm`` and
    ``output``. A pipeline stage sets the modules it does not own to ``None``; the
    modules named in ``first_stage_modules`` belong to the first stage only and those
    in ``last_stage_modules`` to the last stage only, so a stage splitter can stay
    family-agnostic.
    """

    first_stage_modules: tuple[str, ...] = ("tok_embeddings",)
    last_stage_modules: tuple[str, ...] = ("norm", "output")
    # The context-parallel group when each sequence is split over ranks (`enable_context_parallel`):
    # the model then holds only its tokens of each sequence, at `positions`.
    context_parallel: Optional[ContextParallel] = None

    # Under pipeline parallelism and document masking: the document ids of the micro-batch a stage runs
    # (set by the pipeline for each micro-batch, as a stage receives only hidden states).
    pipeline_doc_ids: Optional[torch.Tensor] = None
    # Under pipeline parallelism: the token ids of the micro-batch a stage runs (set by the pipeline for each
    # micro-batch on every stage), for the models whose later stages read them (DeepSeek-V3's last stage: its
    # multi-token prediction embeds and predicts them).
    pipeline_tokens: Optional[torch.Tensor] = None

    def document_positions(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """`[B, S_local]` position of this rank's tokens in their documents, from the whole sequence's ids."""
        positions = document_positions(doc_ids)
        return positions if self.context_parallel is None else self.context_parallel.shard(positions)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of the `local_len` tokens this rank holds of each sequence."""
        if self.context_parallel is None:
            return torch.arange(local_len, device=device)
        return self.context_parallel.positions(local_len, device)

    def sequence_length(self, local_len: int) -> int:
        """Length of the whole sequence whose `local_len` tokens this rank holds."""
        return local_len * (1 if self.context_parallel is None else self.context_parallel.size)

    def _embedding_tables(self) -> list[nn.Module]:
        """Lookup-table modules that ``num_params(exclude_embeddings=True)`` leaves out."""
        return [m for name in self.first_stage_modules if (m := getattr(self, name)) is not None]

    def _attention_dim(self) -> int:
        """``n_heads * head_dim`` of one layer (the width of the attention matmuls)."""
        raise NotImplementedError

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters held by this module (a pipeline stage counts its own).

        Tied weights count once. ``exclude_embeddings`` leaves out the input lookup
        tables (token and, for GPT, position embeddings); an untied output head is a
        matmul and stays counted, a tied one is the embedding table and goes with it.
        """
        excluded: set[int] = set()
        if exclude_embeddings:
            excluded = {id(p) for m in self._embedding_tables() for p in m.parameters()}
        return unique_numel(p for p in self.parameters() if id(p) not in excluded)

    def _inactive_expert_params(self) -> int:
        """Routed-expert weights a token does not use: (n_experts - top_k) / n_experts of each MoE layer's
        experts (global shapes, also when the experts are split over ranks)."""
        total = 0
        for module in self.modules():
            if isinstance(module, MoE):
                experts = sum(p.numel() for p in module.experts.parameters())
                total += experts - experts * module.top_k // module.n_experts
        return total

    def num_active_params(self) -> int:
        """Parameters one token uses: all of them for a dense model; for a Mixture of Experts everything
        but the routed experts it is not sent to (embedding, head, router and norms counted; top_k of
        n_experts experts)."""
        return self.num_params() - self._inactive_expert_params()

    def num_matmul_params(self) -> int:
        """Number of weights one token multiplies with: every ``nn.Linear`` weight, plus the top_k of
        n_experts routed-expert weights of each MoE layer (the active ones: FLOPs and MFU count those).

        The output head counts even when tied to the embedding (it is still a matmul);
        biases, norms and embedding lookups do not.
        """
        return matmul_params(self)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at sequence length ``seq_len``.

        Convention of Narayanan et al. 2021 ("Efficient Large-Scale Language Model
        Training on GPU Clusters Using Megatron-LM"): a multiply-add is 2 FLOPs and the
        backward pass costs twice the forward, so training = 3x forward:

            6 * num_matmul_params()                           # every Linear weight, head included
          + 12 * n_layers * seq_len * (n_heads * head_dim)    # QK^T and attention @ V

        The embedding lookup is not a matmul and is not counted; the attention matmuls
        are counted in full (not halved for causality), as in the paper. Elementwise work
        (norms, activations, softmax, RoPE) is ignored. For a GPT-3-style model this is
        Narayanan's 72*l*h^2*(1 + s/(6h) + V/(12*l*h)) up to bias terms. Activation
        recomputation is not included (it would make it 4x forward). A pipeline stage
        counts only its own layers and head.
        """
        require_positive(seq_len, "seq_len")
        n_layers = len(self.layers)
        return 6 * self.num_matmul_params() + 12 * n_layers * seq_len * self._attention_dim()
