"""Document masking (`data.document_masking=true`, trainer/models/documents.py): a packed window of several
documents trains exactly as its documents would one by one, for both model families; the multi-process
cases (tensor, context and pipeline parallelism) are in tests/test_context_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import compose
from trainer.loss import cross_entropy_loss
from trainer.models import GPTConfig, LlamaConfig, build_model
from trainer.models.documents import document_ids, document_mask, document_positions

EOS = 0


def test_document_ids_and_positions_restart_after_each_end_of_document() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 9], [EOS, 1, 2, 3, 4, 5, EOS, 6]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2]]
    assert document_positions(document_ids(tokens, EOS)).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2],
                                                                      [0, 0, 1, 2, 3, 4, 5, 0]]
    mask = document_mask(document_ids(tokens[:1], EOS), document_ids(tokens[:1], EOS))[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]  # doc 1, causal


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
    for span, doc, logits in zip(inside, (first, second), (model(first), model(second))):
        loss_alone = cross_entropy_loss(logits[:, :-1], doc[:, 1:])
        loss_packed = cross_entropy_loss(masked[:, span.start:span.stop], targets[:, span.start:span.stop])
        torch.testing.assert_close(loss_packed, loss_alone, rtol=1e-5, atol=0)


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
