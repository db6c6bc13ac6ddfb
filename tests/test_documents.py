"""Document masking (`data.document_masking=true`, trainer/models/documents.py): a packed window of several
documents trains exactly as its documents would one by one, for both model families; the multi-process
cases (tensor, context and pipeline parallelism) are in tests/test_context_parallel.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.config import compose
from trainer.interfaces.strategy import Strategy
from trainer.loss import IGNORE_INDEX, cross_entropy_loss
from trainer.models import GPTConfig, LlamaConfig, build_model
from trainer.models.documents import document_ids, document_mask, document_positions, mask_document_crossings

EOS = 0


def test_document_ids_and_positions_restart_after_each_end_of_document() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 9], [EOS, 1, 2, 3, 4, 5, EOS, 6]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2]]
    assert document_positions(document_ids(tokens, EOS)).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2],
                                                                      [0, 0, 1, 2, 3, 4, 5, 0]]
    mask = document_mask(document_ids(tokens[:1], EOS), document_ids(tokens[:1], EOS))[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]  # doc 1, causal
    # the targets read at an EOS (the next document's first token) are not trained on; the EOS as a
    # target (a document's last prediction) is
    targets = torch.tensor([[6, EOS, 7, EOS, 8, 9, 9, 4], [1, 2, 3, 4, 5, EOS, 6, 7]])
    I = IGNORE_INDEX  # noqa: E741
    assert mask_document_crossings(tokens, targets, EOS).tolist() == [[6, EOS, I, EOS, I, 9, 9, 4],
                                                                      [I, 2, 3, 4, 5, EOS, I, 7]]


MODELS = {
    "llama": LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
    "gpt_sdpa": GPTConfig(vocab_size=64, max_seq_len=64, dim=32, n_layers=2, n_heads=4, dropout=0.0),
    "gpt_materialized": GPTConfig(vocab_size=64, max_seq_len=64, dim=32, n_layers=2, n_heads=4, dropout=0.0,
                                  attn_impl="materialized"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_sequence_of_two_documents_gives_each_document_s_own_logits_and_loss(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(MODELS[name])
    first = torch.cat([torch.randint(1, 64, (1, 11)), torch.tensor([[EOS]])], 1)  # 12 tokens ending with EOS
    second = torch.cat([torch.randint(1, 64, (1, 19)), torch.tensor([[EOS]])], 1)  # 20 tokens
    packed = torch.cat([first, second], 1)
    with torch.no_grad():
        masked = model(packed, document_ids(packed, EOS))
        alone = torch.cat([model(first), model(second)], 1)
        unmasked = model(packed)
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[:, 12:], alone[:, 12:], atol=1e-3)  # without masking B sees A
    # the loss over each document's own next-token targets
    targets = packed.roll(-1, 1)
    inside = [range(0, 11), range(12, 31)]
    for span, doc, logits in zip(inside, (first, second), (model(first), model(second)), strict=True):
        loss_alone = cross_entropy_loss(logits[:, :-1], doc[:, 1:])
        loss_packed = cross_entropy_loss(masked[:, span.start:span.stop], targets[:, span.start:span.stop])
        torch.testing.assert_close(loss_packed, loss_alone, rtol=1e-5, atol=0)


def single_strategy() -> Strategy:
    strategy = Strategy()  # one process, fp32
    strategy.document_eos_id = EOS
    return strategy


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_document_s_summed_loss_is_its_loss_alone(name: str) -> None:
    """A window as the loader cuts it (inputs = tokens[:-1], targets = tokens[1:]) packing two whole
    documents and the start of a third, through the strategy's `local_batches`: the summed token loss of
    each document's positions, and of the whole window, is what the documents get alone; the target read
    at each EOS (the next document's first token) counts for neither."""
    torch.manual_seed(0)
    model = build_model(MODELS[name])
    docs = [torch.cat([torch.randint(1, 64, (1, n - 1)), torch.tensor([[EOS]])], 1) for n in (12, 20)]
    docs.append(torch.randint(1, 64, (1, 9)))  # the window ends inside a third document
    window = torch.cat(docs, 1)  # 41 tokens: 40 inputs and 40 targets
    ((inputs, targets, ids),) = single_strategy().local_batches([(window[:, :-1], window[:, 1:])])
    assert torch.equal(targets.eq(IGNORE_INDEX).nonzero()[:, 1], torch.tensor([11, 31]))  # the EOS inputs
    with torch.no_grad():
        logits = model(inputs, ids)
        per_target = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                     reduction="none")
        alone = [cross_entropy_loss(model(doc)[:, :-1], doc[:, 1:], "sum") for doc in docs]
    # Measured (20 seeds x the 3 models): within 2.5e-7 relative (float summation order); 20x margin.
    starts = [0, 12, 32, 40]
    for (start, stop), loss_alone in zip(zip(starts[:-1], starts[1:], strict=True), alone, strict=True):
        torch.testing.assert_close(per_target[start:stop].sum(), loss_alone, rtol=5e-6, atol=0)
    torch.testing.assert_close(cross_entropy_loss(logits, targets, "sum"), sum(alone), rtol=5e-6, atol=0)


class _RanksOf(Strategy):
    """Rank `rank` of len(counts) data-parallel ranks, run in this process: `reduce_mean` (the count
    all-reduce of `loss_normalizer`) answers the mean of every rank's count of counted targets."""

    def __init__(self, counts: list[int], rank: int) -> None:
        super().__init__()
        self.counts, self.index = counts, rank
        self.document_eos_id = EOS

    def reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        assert tensor.item() == self.counts[self.index]
        return torch.tensor(sum(self.counts) / len(self.counts), dtype=tensor.dtype)


@pytest.mark.parametrize("splits", [[[[0, 1, 2, 3]]], [[[0], [1], [2], [3]]], [[[0], [3]], [[1], [2]]],
                                    [[[0, 1]], [[2, 3]]]], ids=["one", "accumulated", "dp2_accumulated", "dp2"])
def test_the_loss_is_the_mean_over_the_global_batch_s_counted_targets_however_it_is_split(
        splits: list[list[list[int]]]) -> None:
    """Under document masking the micro-batches hold different numbers of counted targets (here 32, 31, 29
    and 26 of 32): one micro-batch, four accumulated ones, and two data-parallel ranks (their gradients and
    losses averaged, as DDP and the loop do) all train and log the mean over every counted target of the
    global batch."""
    torch.manual_seed(0)
    model = build_model(MODELS["llama"])
    windows = torch.randint(1, 64, (4, 33))
    for row, ends in enumerate([(), (5,), (3, 9, 20), (2, 4, 8, 16, 24, 31)]):
        windows[row, list(ends)] = EOS
    x, y = windows[:, :-1], windows[:, 1:]
    reference = copy.deepcopy(model)
    counted = x != EOS
    expected = F.cross_entropy(reference(x, document_ids(x, EOS))[counted], y[counted])  # written out
    expected.backward()
    ranks = [[(x[rows], y[rows]) for rows in rank] for rank in splits]
    counts = [sum(int((inputs != EOS).sum()) for inputs, _ in rank) for rank in ranks]
    losses, grads = [], []
    for rank, microbatches in enumerate(ranks):
        strategy, replica = _RanksOf(counts, rank), copy.deepcopy(model)
        losses.append(strategy.forward_backward([replica], strategy.local_batches(microbatches)))
        grads.append(dict(replica.named_parameters()))
    # Measured (10 seeds x these splits): the loss within 1.2e-7 relative, each gradient within 6.6e-7 of
    # its largest entry (summation order); 15x margins.
    torch.testing.assert_close(sum(losses) / len(ranks), expected.detach(), rtol=2e-6, atol=0)
    for name, param in reference.named_parameters():
        mean = sum(g[name].grad for g in grads) / len(ranks)
        torch.testing.assert_close(mean, param.grad, rtol=0, atol=1e-5 * float(param.grad.abs().max()), msg=name)


def write_documents(path: Path, train_tokens: int = 200_000, val_tokens: int = 20_000, seed: int = 0) -> Path:
    """A token-file dataset (format 1: documents found by their EOS) of random documents of 3 to 40 tokens."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train_tokens), ("val", val_tokens)):
        pieces, total = [], 0
        while total < count:
            body = rng.integers(1, 256, rng.integers(2, 40))
            pieces.append(np.append(body, EOS))
            total += len(pieces[-1])
        np.concatenate(pieces)[:count].astype(np.uint16).tofile(path / f"{split}.bin")
    meta = {"format_version": 1, "dtype": "uint16", "vocab_size": 256, "tokenizer": "bytes", "eos_id": EOS,
            "num_tokens": {"train": train_tokens, "val": val_tokens}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_document_masking_trains_on_a_token_file_and_changes_the_losses(tmp_path: Path) -> None:
    from trainer.run import build_trainer

    data = write_documents(tmp_path / "docs")
    base = ["data=token_file", f"data.path={data}", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_hidden_dim=128", "trainer.seq_len=64", "trainer.global_batch_size=8",
            "trainer.micro_batch_size=4", "trainer.max_steps=3", "trainer.log_every=1", "trainer.val_every=0",
            "trainer.val_batches=1", "lr_schedule.warmup_steps=1", "callbacks=none", "trainer.save_final=false"]
    masked = build_trainer(compose(base + ["data.document_masking=true"]), tmp_path / "masked").fit()
    plain = build_trainer(compose(base), tmp_path / "plain").fit()
    assert masked["steps"] == plain["steps"] == 3
    assert masked["final_val_loss"] != plain["final_val_loss"]
