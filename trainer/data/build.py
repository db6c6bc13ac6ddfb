"""From a configured data source to the training loader and validation set a run uses."""

from __future__ import annotations

from typing import Any

from trainer.data.loader import SourceValidation, StatefulLoader, TokenWindows, TrainLoader, val_batches
from trainer.data.mixture import DataSourceError, MixtureData, MixtureLoader
from trainer.data.token_ids import ids_beyond

__all__ = ["build_loaders", "check_data"]


def build_loaders(source: Any, seq_len: int, global_batch_size: int, micro_batch_size: int, val_batches_per_step: int,
                  seed: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[TrainLoader, Any]:
    """The training loader and validation set of a data source (one corpus or a ``MixtureData``).

    The validation set is ``val_batches_per_step`` global batches whatever the parallelism (each rank its
    slice), per source for a mixture (a ``SourceValidation``).
    """
    accumulation = global_batch_size // (micro_batch_size * dp_size)
    if isinstance(source, MixtureData):
        windows, sets, weights = [], {}, {}
        for name, src, w in zip(source.names, source.sources, source.base_weights):
            try:
                windows.append(TokenWindows(src.train_tokens(), seq_len))
                val = TokenWindows(src.val_tokens(), seq_len)
            except ValueError as e:
                raise ValueError(f"source '{name}': {e}") from None
            sets[name] = val_batches(val, val_batches_per_step * accumulation, micro_batch_size,
                                     dp_rank=dp_rank, dp_size=dp_size)
            weights[name] = w
        loader: TrainLoader = MixtureLoader(windows, source.names, source.phases, global_batch_size,
                                            micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        return loader, SourceValidation(sets, weights)
    loader = StatefulLoader(TokenWindows(source.train_tokens(), seq_len), global_batch_size, micro_batch_size,
                            dp_rank=dp_rank, dp_size=dp_size, seed=seed)
    val = val_batches(TokenWindows(source.val_tokens(), seq_len), val_batches_per_step * accumulation,
                      micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    return loader, val


def check_data(data_cfg: Any, model_vocab_size: int, seq_len: int | None = None) -> None:
    """Open the configured token source (headers and indexes only, nothing is read in bulk) and check it
    against the model, before any process starts.

    Sources that only a run reads (the stdlib corpus scans the interpreter's files) are left to the run.
    Every token file's largest id is checked against the model's vocabulary (`trainer.data.token_ids`: a
    scan cached beside the files).

    Raises:
        DataSourceError: a missing or unreadable source, a malformed index, bad weights, sources of
            different vocabularies or EOS ids, a vocabulary larger than the model's, a token id beyond it.
    """
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    from trainer.data.config import source_config
    from trainer.data.formats import MegatronIndexedDataset, NanoGPTDataset
    from trainer.data.token_file import TokenFileDataset

    cls = get_object(data_cfg._target_)
    if cls not in (TokenFileDataset, MegatronIndexedDataset, NanoGPTDataset, MixtureData):
        return
    kwargs = OmegaConf.to_container(source_config(data_cfg), resolve=True)
    assert isinstance(kwargs, dict)
    kwargs.pop("_target_", None)
    try:
        source = cls(**kwargs)
    except DataSourceError:
        raise
    except (OSError, ValueError) as e:
        raise DataSourceError("data", str(e).splitlines()[0]) from None
    if source.vocab_size > model_vocab_size:
        raise DataSourceError("data", f"the data has {source.vocab_size} token ids but model.vocab_size is "
                                      f"{model_vocab_size}: pick a model whose vocabulary covers the data")
    if data_cfg.get("document_masking", False) and source.eos_id is None:
        raise DataSourceError("data.document_masking", "the data has no end-of-document token (eos_id), so its "
                                                       "documents cannot be told apart: prepare it with --append-eos")
    named = (list(zip(source.names, source.sources, [f"data.sources[{i}]" for i in range(len(source.names))]))
             if isinstance(source, MixtureData) else [("data", source, "data")])
    for name, one, key in named:
        for tokens in (one.train_tokens(), one.val_tokens()):
            beyond = ids_beyond(tokens, model_vocab_size)
            if beyond is not None:
                raise DataSourceError(key, f"{beyond[0]} holds token id {beyond[1]}, beyond model.vocab_size="
                                           f"{model_vocab_size} (the source says its vocabulary has {one.vocab_size} "
                                           "ids): prepare the data again with its tokenizer, or pick a model whose "
                                           "vocabulary covers it")
    if seq_len is None:
        return
    for name, one, key in named:
        for split, tokens in (("train", one.train_tokens()), ("validation", one.val_tokens())):
            if len(tokens) < seq_len + 1:
                raise DataSourceError(key, f"the {split} split of '{name}' has {len(tokens)} tokens, fewer than "
                                           f"one window of trainer.seq_len + 1 = {seq_len + 1}")
