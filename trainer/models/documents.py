"""Document masking: packed sequences whose documents do not see each other.

A training window packs several documents, each ending with the end-of-document token. With
`data.document_masking=true` a token attends only to earlier tokens of its own document (a block-diagonal
causal mask) and positions (RoPE, GPT's learned table) restart at 0 at each document, so a packed window
trains exactly as its documents would one by one (tested to 1e-5).

The document of every token is derived from the window's tokens (`document_ids`), as the token files keep
an EOS between documents; a model receives those ids for the whole sequence (also under context
parallelism, where a rank holds only some of its tokens: the ring needs the ids of the K/V blocks it
receives). The mask is dense (`[B, 1, S, S]` booleans for SDPA): flex_attention's block masks would avoid
it on GPUs.

The loss: a document alone, `d_0 ... d_{n-1} EOS`, is trained on the targets `d_1 ... d_{n-1} EOS` (its
inputs `d_0 ... d_{n-1}`). Packed, one more target follows it: the next document's first token, predicted
at the EOS from this document's context. `mask_document_crossings` sets that target to the loss's ignore
index (Megatron-LM's `eod_mask_loss`: no loss where the input is the EOS), in the labels, before context
parallelism shards them or a pipeline cuts them, so a packed document's summed loss is exactly its loss
alone. The loss is then the mean over the counted targets of the whole global batch
(`Strategy.loss_normalizer`).
"""

from __future__ import annotations

import torch

from trainer.loss import IGNORE_INDEX


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """`[B, S]` index of the document each token belongs to (0, 0, 0, 1, 1, ...): a document ends with its
    EOS token, so the token after an EOS starts the next one."""
    ends = (tokens == eos_id).long()
    return ends.cumsum(1) - ends


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """`[B, S]` position of each token in its document: 0 at every document's first token."""
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return index - first


def document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """`[B, 1, Sq, Sk]` True where query i may attend key j: same document (and j <= i when `causal`, for
    queries and keys at the same positions)."""
    mask = q_ids[:, None, :, None] == k_ids[:, None, None, :]
    if causal:
        sq, sk = q_ids.shape[1], k_ids.shape[1]
        mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=q_ids.device).tril()
    return mask


def mask_document_crossings(inputs: torch.Tensor, targets: torch.Tensor, eos_id: int) -> torch.Tensor:
    """`targets` with the loss's ignore index wherever the input is the end-of-document token: the target
    there is the next document's first token (also when it lies just past the window), not one of the
    targets of the document that the EOS ends."""
    return targets.masked_fill(inputs == eos_id, IGNORE_INDEX)
