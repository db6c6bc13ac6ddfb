"""The training objective."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.parallel.loss import _disable_custom_loss_ops, _enable_custom_loss_ops


IGNORE_INDEX = -100
"""A target that is not trained on (`F.cross_entropy`'s default `ignore_index`): under document masking,
each target whose input is an end-of-document token, i.e. the next document's first token predicted from
the previous document (`trainer.models.documents.mask_document_crossings`)."""


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", *,
                       compiled: bool = False) -> torch.Tensor:
    """Next-token cross entropy in nats over the targets that are not `IGNORE_INDEX`, computed in fp32
    whatever the logits' dtype: their mean (`reduction="mean"`, NaN if every target is ignored) or their
    sum (`"sum"`, 0 then).

    `compiled` (what `trainer.compile=true` gives): the same loss through Inductor, which fuses the fp32
    cast, the log-softmax and the target pick into reductions over the logits as they are. Eager keeps an
    fp32 copy's log-softmax (4 bytes x tokens x vocabulary) for the backward, whose gradients are two more
    fp32 tensors of that size; compiled, the backward reads the logits again with each row's max and
    log-sum-exp (8 bytes a token) and writes the gradient once, in the logits' dtype. With a 128k
    vocabulary that is most of the loss's memory traffic and of the last stage's memory peak.

    `logits` may be a DTensor sharded on the vocabulary (tensor parallelism with loss parallelism): the
    loss is then computed on the shards (a max and a sum-exp all-reduced over the vocabulary ranks, the
    target logit picked on the rank that owns it) and returned as a plain scalar, the same on every rank.
    Its backward needs no context from the caller. That path is never compiled.
    """
    if isinstance(logits, DTensor):
        if _vocab_sharded(logits):
            return _vocab_parallel_cross_entropy(logits, targets, reduction)
        logits = logits.full_tensor()  # replicated (or otherwise laid out) logits: the plain path
    if compiled:
        return _compiled_token_cross_entropy()(logits, targets, reduction)
    return _token_cross_entropy(logits, targets, reduction)


def _token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


@functools.cache
def _compiled_token_cross_entropy() -> Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]:
    # made on first use: importing this module must not touch Dynamo
    return torch.compile(_token_cross_entropy)


def counted_targets(targets: torch.Tensor) -> torch.Tensor:
    """How many of `targets` the loss counts (those that are not `IGNORE_INDEX`), as a 0-d int64 tensor."""
    return (targets != IGNORE_INDEX).sum()


def _vocab_sharded(logits: DTensor) -> bool:
    last = logits.ndim - 1
    return any(p.is_shard() and p.dim in (-1, last) for p in logits.placements)


def _loss_parallel_enabled() -> bool:
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    handlers = DTensor._op_dispatcher._custom_op_handlers
    return all(op in handlers for op in customized_loss_ops)


@contextlib.contextmanager
def reentrant_loss_parallel() -> Iterator[None]:
    """torch's `loss_parallel()`, a no-op when already inside it (torch's own would unregister its
    handlers on the inner exit and fail on the outer one)."""
    if _loss_parallel_enabled():
        yield
    else:
        with loss_parallel():
            yield


def _vocab_parallel_cross_entropy(logits: DTensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    flat = logits.flatten(0, 1).float()
    if isinstance(targets, DTensor):
        targets = targets.full_tensor()
    with reentrant_loss_parallel():
        loss = F.cross_entropy(flat, targets.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction=reduction)
    if torch.is_grad_enabled() and flat.requires_grad:
        _loss_parallel_in_backward(loss, flat)
    # Replicated over the vocabulary ranks: each holds the whole (already reduced) value.
    return loss.full_tensor()


def _loss_parallel_in_backward(loss: torch.Tensor, logits: torch.Tensor) -> None:
    """Make the backward of `loss` w.r.t. `logits` run under loss parallelism, wherever `.backward()` is
    called (the strategy's loop, a pipeline schedule...).

    torch computes the vocab-parallel gradient only while `loss_parallel()` is active. The loss node's
    pre-hook enables it just before autograd enters the cross-entropy backward and the hook on the
    logits' gradient disables it right after (unless the caller had enabled it itself, then both do
    nothing).
    """
    state = {"owned": False}

    def enter(grad_outputs: tuple[torch.Tensor, ...]) -> None:
        del grad_outputs
        if not _loss_parallel_enabled():
            _enable_custom_loss_ops()
            state["owned"] = True

    def leave(grad: torch.Tensor) -> None:
        del grad
        if state["owned"]:
            _disable_custom_loss_ops()
            state["owned"] = False

    assert loss.grad_fn is not None
    loss.grad_fn.register_prehook(enter)
    logits.register_hook(leave)
