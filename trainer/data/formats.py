"""Readers for corpora tokenized by other tools, used as they are (no re-tokenizing).

* Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, the ``MMapIndexedDataset`` layout of
  ``megatron/core/datasets/indexed_dataset.py``). The index is, little-endian::

      b"MMIDIDX\\x00\\x00"       9-byte magic
      version                 uint64, 1
      dtype code              uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
      sequence count S        uint64
      document count D        uint64 (entries of the document index: documents + 1)
      sequence lengths        int32[S]   (tokens)
      sequence pointers       int64[S]   (byte offsets into PREFIX.bin)
      document index          int64[D]   (sequence index where each document starts, then S)

  The ``.bin`` holds the sequences back to back. Validation is a separate prefix (``val_path``) or the
  last ``val_fraction`` of the documents.
* nanoGPT's ``train.bin`` / ``val.bin``: raw uint16 token ids (``data/*/prepare.py`` of nanoGPT), with an
  optional ``meta.pkl`` whose ``vocab_size`` names the vocabulary (the character-level sets); without
  it the ids are GPT-2 BPE (vocabulary 50257, ``<|endoftext|>`` = 50256), as nanoGPT's own train.py
  assumes.

Every source offers ``vocab_size``, ``eos_id``, ``train_tokens()``, ``val_tokens()`` and
``doc_offsets(split)``; ``open_source`` picks the reader for a path. Errors are ``ValueError`` /
``FileNotFoundError`` whose message names the file, one line.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trainer.data.token_file import META_FILE, TokenFileDataset, offsets_from_eos

__all__ = [
    "TokenSource",
    "MegatronIndexedDataset",
    "NanoGPTDataset",
    "open_source",
    "FORMATS",
    "MEGATRON_MAGIC",
    "MEGATRON_DTYPES",
    "write_megatron",
]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# Megatron-core's DType enum; float codes exist in the format but are not token ids.
MEGATRON_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<u1"), 2: np.dtype("<i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
GPT2_VOCAB_SIZE = 50257
GPT2_EOS_ID = 50256
FORMATS = ("auto", "token_file", "megatron", "nanogpt")


class TokenSource(Protocol):
    """What the loaders read from any source."""

    vocab_size: int
    eos_id: int | None

    def train_tokens(self) -> np.ndarray: ...

    def val_tokens(self) -> np.ndarray: ...

    def doc_offsets(self, split: str = "train") -> np.ndarray: ...

    def describe(self) -> str: ...


def _check_vocab(where: str, vocab_size: int | None, eos_id: int | None) -> None:
    if vocab_size is None or vocab_size < 1:
        raise ValueError(f"{where}: vocab_size must be a positive integer, got {vocab_size}")
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(f"{where}: eos_id {eos_id} is outside the vocabulary (size {vocab_size})")


# --------------------------------------------------------------------------- Megatron-LM


def _megatron_prefix(path: str) -> Path:
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


class _MegatronFile:
    """One ``.bin``/``.idx`` pair, validated: flat tokens (memmap) and document start offsets."""

    def __init__(self, prefix: Path) -> None:
        idx, binf = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
        for f in (idx, binf):
            if not f.is_file():
                raise FileNotFoundError(f"Megatron indexed dataset file not found: {f}")
        raw = np.memmap(idx, dtype=np.uint8, mode="r")
        if len(raw) < _HEADER.size:
            raise ValueError(f"{idx}: malformed index ({len(raw)} bytes, shorter than the header)")
        magic, version, code, seqs, docs = _HEADER.unpack(bytes(raw[: _HEADER.size]))
        if magic != MEGATRON_MAGIC:
            raise ValueError(f"{idx}: malformed index (magic {magic!r}, expected {MEGATRON_MAGIC!r})")
        if version != 1:
            raise ValueError(f"{idx}: malformed index (version {version}, this reader knows 1)")
        if code not in MEGATRON_DTYPES or MEGATRON_DTYPES[code].kind == "f":
            raise ValueError(f"{idx}: malformed index (dtype code {code} is not an integer token type)")
        self.dtype = MEGATRON_DTYPES[code]
        expected = _HEADER.size + 4 * seqs + 8 * seqs + 8 * docs
        # Multimodal Megatron datasets append one int8 mode per sequence: not token data, refused.
        if len(raw) != expected:
            raise ValueError(f"{idx}: malformed index ({len(raw)} bytes, the header's {seqs} sequences and "
                             f"{docs} document entries need {expected})")
        offset = _HEADER.size
        sizes = np.frombuffer(raw, dtype="<i4", count=seqs, offset=offset).astype(np.int64)
        pointers = np.frombuffer(raw, dtype="<i8", count=seqs, offset=offset + 4 * seqs)
        doc_index = np.frombuffer(raw, dtype="<i8", count=docs, offset=offset + 12 * seqs)
        item = self.dtype.itemsize
        # Sequences are stored back to back: each pointer is the previous plus its length in bytes.
        starts = np.concatenate([[0], np.cumsum(sizes)]) * item
        if seqs and (bool(np.any(sizes < 0)) or not np.array_equal(pointers, starts[:-1])):
            raise ValueError(f"{idx}: malformed index (sequence pointers do not follow the lengths)")
        if binf.stat().st_size != int(starts[-1]):
            raise ValueError(f"{binf}: size is {binf.stat().st_size} bytes but {idx.name} describes "
                             f"{int(starts[-1])} bytes of {self.dtype.name} tokens")
        if docs < 1 or doc_index[0] != 0 or doc_index[-1] != seqs or bool(np.any(np.diff(doc_index) < 0)):
            raise ValueError(f"{idx}: malformed index (the document index must rise from 0 to {seqs})")
        self.num_tokens = int(starts[-1]) // item
        self.tokens: np.ndarray = (np.memmap(binf, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
                                   if self.num_tokens else np.zeros(0, dtype=self.dtype))
        # Token offset where each document starts, then the token count.
        self.doc_offsets = (starts[np.asarray(doc_index)] // item).astype(np.int64)
        self.where = str(prefix)


class MegatronIndexedDataset:
    """A Megatron-LM ``.bin``/``.idx`` pair read in place (memory-mapped).

    Args:
        path: the prefix (``PREFIX`` of ``PREFIX.bin``/``PREFIX.idx``; a path ending in .bin or .idx works).
        vocab_size: vocabulary of the tokenizer that wrote it (the index does not store it).
        eos_id: the end-of-document id Megatron's ``--append-eod`` added, or ``None``.
        val_path: prefix of a separate validation pair; ``None`` holds out the last documents.
        val_fraction: share of the documents held out when there is no ``val_path`` (at least one
            document when positive).
    """

    def __init__(self, path: str, vocab_size: int, eos_id: int | None = None, val_path: str | None = None,
                 val_fraction: float = 0.01) -> None:
        self.path = _megatron_prefix(path)
        _check_vocab(str(self.path), vocab_size, eos_id)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"{self.path}: val_fraction must be in [0, 1), got {val_fraction}")
        self.vocab_size = int(vocab_size)
        self.eos_id = eos_id
        train = _MegatronFile(self.path)
        self._tokens: dict[str, np.ndarray] = {}
        self._doc_offsets: dict[str, np.ndarray] = {}
        if val_path is not None:
            val = _MegatronFile(_megatron_prefix(val_path))
            if val.dtype != train.dtype:
                raise ValueError(f"{val.where}: token dtype {val.dtype.name} differs from {train.where}'s "
                                 f"{train.dtype.name}")
            self._tokens = {"train": train.tokens, "val": val.tokens}
            self._doc_offsets = {"train": train.doc_offsets, "val": val.doc_offsets}
        else:
            n_docs = len(train.doc_offsets) - 1
            n_val = 0 if val_fraction == 0 or n_docs < 2 else max(1, round(n_docs * val_fraction))
            cut_doc = n_docs - n_val
            cut = int(train.doc_offsets[cut_doc])
            self._tokens = {"train": train.tokens[:cut], "val": train.tokens[cut:]}
            self._doc_offsets = {"train": train.doc_offsets[: cut_doc + 1],
                                 "val": train.doc_offsets[cut_doc:] - cut}
        self.dtype = train.dtype

    def train_tokens(self) -> np.ndarray:
        """Training tokens (a read-only memmap view)."""
        return self._tokens["train"]

    def val_tokens(self) -> np.ndarray:
        """Validation tokens (a read-only memmap view, may be empty)."""
        return self._tokens["val"]

    def doc_offsets(self, split: str = "train") -> np.ndarray:
        """Start offset of every document of ``split``, then its token count, from the index."""
        return self._doc_offsets[split]

    def describe(self) -> str:
        """One line for logs."""
        return (f"Megatron indexed dataset ({self.path}): train {len(self._tokens['train']):,} tokens, "
                f"val {len(self._tokens['val']):,} tokens, vocab {self.vocab_size} ({self.dtype.name})")


def write_megatron(prefix: str | Path, documents: list[np.ndarray], dtype: np.dtype | str = "<u2") -> None:
    """Write ``documents`` (one sequence each) as a Megatron ``.bin``/``.idx`` pair, following the layout
    above (Megatron's ``IndexedDatasetBuilder`` with one sequence per document). Used by tests and docs."""
    dt = np.dtype(dtype).newbyteorder("<")
    code = next(c for c, d in MEGATRON_DTYPES.items() if d == dt)
    prefix = Path(prefix)
    sizes = np.array([len(d) for d in documents], dtype="<i4")
    pointers = (np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)[:-1]]) * dt.itemsize).astype("<i8")
    doc_index = np.arange(len(documents) + 1, dtype="<i8")
    with open(prefix.with_name(prefix.name + ".bin"), "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dt).tobytes())
    with open(prefix.with_name(prefix.name + ".idx"), "wb") as f:
        f.write(_HEADER.pack(MEGATRON_MAGIC, 1, code, len(sizes), len(doc_index)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_index.tobytes())


# --------------------------------------------------------------------------- nanoGPT


class _MetaUnpickler(pickle.Unpickler):
    """nanoGPT's meta.pkl is a dict of ints, strings and dicts: refuse anything that would run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from meta.pkl")


def _nanogpt_meta_vocab(meta: Path) -> int | None:
    if not meta.is_file():
        return None
    try:
        with open(meta, "rb") as f:
            data = _MetaUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any unreadable pickle is the same problem to the user
        raise ValueError(f"{meta}: not a readable nanoGPT meta.pkl ({e})") from None
    vocab = data.get("vocab_size") if isinstance(data, dict) else None
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{meta}: has no positive integer vocab_size")
    return vocab


class NanoGPTDataset:
    """nanoGPT's ``train.bin``/``val.bin`` (raw uint16 ids) read in place.

    Args:
        path: the directory holding ``train.bin`` (and ``val.bin``, ``meta.pkl`` if any), or the path of
            the ``train.bin`` file itself (``val.bin`` beside it).
        vocab_size: the vocabulary; ``None`` takes ``meta.pkl``'s, else GPT-2's 50257.
        eos_id: the end-of-document id; ``None`` means 50256 (``<|endoftext|>``) for the GPT-2
            vocabulary and no EOS otherwise.
    """

    DTYPE = np.dtype("<u2")

    def __init__(self, path: str, vocab_size: int | None = None, eos_id: int | None = None) -> None:
        p = Path(path)
        self.train_file = p if p.suffix == ".bin" else p / "train.bin"
        self.path = self.train_file.parent
        if not self.train_file.is_file():
            raise FileNotFoundError(f"nanoGPT token file not found: {self.train_file}")
        gpt2 = vocab_size is None and not (self.path / "meta.pkl").is_file()
        vocab = vocab_size if vocab_size is not None else _nanogpt_meta_vocab(self.path / "meta.pkl")
        self.vocab_size = int(vocab if vocab is not None else GPT2_VOCAB_SIZE)
        self.eos_id = eos_id if eos_id is not None else (GPT2_EOS_ID if gpt2 or self.vocab_size == GPT2_VOCAB_SIZE
                                                         else None)
        _check_vocab(str(self.train_file), self.vocab_size, self.eos_id)
        if self.vocab_size > 65536:
            raise ValueError(f"{self.train_file}: vocab_size {self.vocab_size} does not fit nanoGPT's uint16")
        self.val_file = self.train_file.with_name("val.bin")
        self._tokens = {"train": self._map(self.train_file),
                        "val": self._map(self.val_file) if self.val_file.is_file() else np.zeros(0, self.DTYPE)}
        self._offsets: dict[str, np.ndarray] = {}

    def _map(self, file: Path) -> np.ndarray:
        size = file.stat().st_size
        if size % 2:
            raise ValueError(f"{file}: {size} bytes is not a whole number of uint16 tokens")
        return np.memmap(file, dtype=self.DTYPE, mode="r") if size else np.zeros(0, self.DTYPE)

    def train_tokens(self) -> np.ndarray:
        """Training tokens (a read-only memmap)."""
        return self._tokens["train"]

    def val_tokens(self) -> np.ndarray:
        """Validation tokens (a read-only memmap, empty without val.bin)."""
        return self._tokens["val"]

    def doc_offsets(self, split: str = "train") -> np.ndarray:
        """Document starts found by EOS (nanoGPT keeps no index), then the token count."""
        if split not in self._offsets:
            self._offsets[split] = offsets_from_eos(self._tokens[split], self.eos_id)
        return self._offsets[split]

    def describe(self) -> str:
        """One line for logs."""
        return (f"nanoGPT tokens ({self.train_file}): train {len(self._tokens['train']):,} tokens, "
                f"val {len(self._tokens['val']):,} tokens, vocab {self.vocab_size}")


# --------------------------------------------------------------------------- choosing a reader


def detect_format(path: str) -> str:
    """``token_file``, ``megatron`` or ``nanogpt`` for what lies at ``path``; FileNotFoundError if nothing."""
    p = Path(path)
    if p.is_dir():
        if (p / META_FILE).is_file():
            return "token_file"
        if (p / "train.bin").is_file():
            return "nanogpt"
        raise FileNotFoundError(f"{p}: neither a prepared token directory ({META_FILE}) nor a nanoGPT "
                                "directory (train.bin)")
    prefix = _megatron_prefix(path)
    if prefix.with_name(prefix.name + ".idx").is_file():
        return "megatron"
    if p.is_file() and p.suffix == ".bin":
        return "nanogpt"
    raise FileNotFoundError(f"data source not found: {p}")


def open_source(path: str, format: str = "auto", vocab_size: int | None = None, eos_id: int | None = None,
                val_path: str | None = None, val_fraction: float = 0.01) -> TokenSource:
    """Open a tokenized corpus of any supported format (see the module docstring)."""
    if format not in FORMATS:
        raise ValueError(f"{path}: format must be one of {', '.join(FORMATS)}, got {format!r}")
    kind = detect_format(path) if format == "auto" else format
    if kind == "token_file":
        ds = TokenFileDataset(path)
        for key, given, found in (("vocab_size", vocab_size, ds.vocab_size), ("eos_id", eos_id, ds.eos_id)):
            if given is not None and given != found:
                raise ValueError(f"{path}: {key} {given} given but {META_FILE} says {found}")
        return ds
    if kind == "megatron":
        if vocab_size is None:
            raise ValueError(f"{path}: a Megatron indexed dataset does not store its vocabulary; set vocab_size")
        return MegatronIndexedDataset(path, vocab_size, eos_id, val_path, val_fraction)
    return NanoGPTDataset(path, vocab_size, eos_id)

