"""Reader for the on-disk token format written by ``python -m trainer.data.prepare``.

A dataset directory holds::

    train.bin          raw little-endian token ids
    val.bin            raw little-endian token ids
    train.offsets.bin  (format 2) little-endian uint64 start offset of every document, then num_tokens
    val.offsets.bin    (format 2) the same for val.bin
    meta.json          {"format_version": 2, "dtype": "uint16" | "uint32", "vocab_size": N,
                        "tokenizer": str, "num_tokens": {"train": n, "val": m}, "eos_id": int | null,
                        optional "shards": {"train": [{"file": "train-00000.bin", "tokens": k}, ...], "val": [...]}}

With ``shards`` (``prepare --shard-tokens``) a split is several files read as one concatenated array
(``ShardedTokens``); documents may cross shard files, the split's offsets index is over the whole split.

The offsets index keeps document boundaries without scanning for EOS (a corpus prepared without
``--append-eos`` has none): document ``i`` of a split is ``tokens[offsets[i]:offsets[i + 1]]``. Format 1
directories (no offsets files) are still read; their documents are found by EOS. The format constants
live here so that the writer and the reader cannot drift.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TokenFileDataset", "ShardedTokens", "FORMAT_VERSION", "META_FILE", "SPLIT_FILES", "OFFSET_FILES", "OFFSET_DTYPE",
           "dtype_for_vocab", "offsets_from_eos", "check_offsets"]

FORMAT_VERSION = 2
# Versions this reader understands: 1 had no offsets index.
_READABLE_VERSIONS = (1, 2)
META_FILE = "meta.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
OFFSET_FILES = {"train": "train.offsets.bin", "val": "val.offsets.bin"}
OFFSET_DTYPE = np.dtype("<u8")
# Explicit little-endian so files are portable across hosts.
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> str:
    """Name of the smallest supported dtype for ``vocab_size`` (``uint16`` up to 65535)."""
    return "uint16" if vocab_size <= 65535 else "uint32"


class ShardedTokens:
    """A read-only 1-D view of token arrays (shard files) one after another, without copying them.

    Supports what the loaders use: ``len``, ``ndim``, ``dtype``, integer, slice and integer-array indexing
    (any shape; a window that crosses a shard boundary is gathered from both) and ``np.asarray``.

    Args:
        parts: the shards' arrays (memmaps), in order.
    """

    ndim = 1

    def __init__(self, parts: list[np.ndarray]) -> None:
        if not parts:
            raise ValueError("ShardedTokens needs at least one shard")
        self.parts = parts
        self.dtype = parts[0].dtype
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.shape = (int(self.starts[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> Any:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            return self[np.arange(start, stop, step, dtype=np.int64)]
        idx = np.asarray(index)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"ShardedTokens takes integer, slice or integer-array indices, got {idx.dtype}")
        flat = np.where(idx.ravel() < 0, idx.ravel() + n, idx.ravel()).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"index out of range for {n} tokens")
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(shard):
            mask = shard == s
            out[mask] = self.parts[s][flat[mask] - self.starts[s]]
        return out.reshape(idx.shape) if idx.ndim else out[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = np.concatenate([np.asarray(p) for p in self.parts])
        return whole if dtype is None else whole.astype(dtype)

    def __repr__(self) -> str:
        return f"ShardedTokens({len(self.parts)} shards, {len(self):,} tokens)"


def offsets_from_eos(tokens: np.ndarray, eos_id: int | None) -> np.ndarray:
    """Document start offsets (then ``len(tokens)``) of a token array whose documents end with ``eos_id``.

    Without an EOS id the whole array is one document. A trailing piece without EOS is a document too.
    """
    n = len(tokens)
    if eos_id is None or n == 0:
        return np.array([0, n] if n else [0], dtype=np.int64)
    ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    starts = np.concatenate([[0], ends[ends < n]])
    return np.concatenate([starts, [n]]).astype(np.int64)


def check_offsets(where: str, offsets: np.ndarray, num_tokens: int) -> None:
    """A valid document index starts at 0, never decreases and ends at ``num_tokens``; ValueError if not."""
    if len(offsets) < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != num_tokens:
        first = int(offsets[0]) if len(offsets) else None
        last = int(offsets[-1]) if len(offsets) else None
        raise ValueError(f"{where}: malformed document index (starts at {first}, ends at {last}; "
                         f"expected 0 and {num_tokens})")
    if len(offsets) > 1 and bool(np.any(np.diff(offsets.astype(np.int64)) < 0)):
        raise ValueError(f"{where}: malformed document index (offsets decrease)")


def _require_int(meta_path: Path, value: Any, what: str, minimum: int) -> int:
    # bool is an int subclass; ``true`` in meta.json is a bug, not a count.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{meta_path}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _read_meta(meta_path: Path) -> dict[str, Any]:
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{meta_path} not found; create the dataset with `python -m trainer.data.prepare`"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _validate_meta(meta_path: Path, meta: dict[str, Any]) -> None:
    """Check the fields this reader relies on; raise ValueError naming the file."""
    missing = [k for k in ("format_version", "dtype", "vocab_size", "num_tokens") if k not in meta]
    if missing:
        raise ValueError(f"{meta_path}: missing key(s) {', '.join(missing)}")
    if meta["format_version"] not in _READABLE_VERSIONS:
        raise ValueError(
            f"{meta_path}: unsupported format_version {meta['format_version']!r} "
            f"(this reader knows {', '.join(map(str, _READABLE_VERSIONS))})"
        )
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"{meta_path}: dtype must be one of {sorted(_DTYPES)}, got {meta['dtype']!r}")
    vocab = _require_int(meta_path, meta["vocab_size"], "vocab_size", 1)
    max_vocab = np.iinfo(_DTYPES[meta["dtype"]]).max + 1
    if vocab > max_vocab:
        raise ValueError(f"{meta_path}: vocab_size {vocab} does not fit dtype {meta['dtype']}")
    counts = meta["num_tokens"]
    if not isinstance(counts, dict):
        raise ValueError(f"{meta_path}: num_tokens must be an object with 'train' and 'val'")
    for split in SPLIT_FILES:
        _require_int(meta_path, counts.get(split), f"num_tokens.{split}", 0)
    eos = meta.get("eos_id")
    if eos is not None and _require_int(meta_path, eos, "eos_id", 0) >= vocab:
        raise ValueError(f"{meta_path}: eos_id {eos} is outside the vocabulary (size {vocab})")


class TokenFileDataset:
    """Pre-tokenized dataset directory (``train.bin``, ``val.bin``, ``meta.json``).

    Everything is validated up front (missing files, file sizes vs.
    ``meta.json``) so that a bad path fails at startup, not hours into a run.
    Token arrays are read-only ``np.memmap`` views, so even very large datasets
    cost no RAM until windows are actually read.

    Args:
        path: the dataset directory.

    Attributes:
        vocab_size: size of the tokenizer's vocabulary.
        eos_id: end-of-document token id, or ``None`` if none was appended.
        tokenizer: ``"bytes"`` or the tokenizer file name inside the directory.
        meta: the full parsed ``meta.json``.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"token dataset directory not found: {self.path}")
        meta_path = self.path / META_FILE
        self.meta = _read_meta(meta_path)
        _validate_meta(meta_path, self.meta)
        self.dtype: np.dtype = _DTYPES[self.meta["dtype"]]
        self.vocab_size: int = self.meta["vocab_size"]
        self.eos_id: int | None = self.meta.get("eos_id")
        self.tokenizer: str = str(self.meta.get("tokenizer", ""))
        self.num_tokens: dict[str, int] = {s: self.meta["num_tokens"][s] for s in SPLIT_FILES}
        self.shards: dict[str, list[tuple[str, int]]] = {s: self._shard_list(meta_path, s) for s in SPLIT_FILES}
        for split in SPLIT_FILES:
            for name, count in self.shards[split]:
                self._check_file(name, count)
        self.has_offsets = self.meta["format_version"] >= 2
        if self.has_offsets:
            for split in SPLIT_FILES:
                self._check_offsets_file(split)
        self._arrays: dict[str, np.ndarray] = {}
        self._offsets: dict[str, np.ndarray] = {}

    def _shard_list(self, meta_path: Path, split: str) -> list[tuple[str, int]]:
        """(file name, tokens) of each file of ``split``: the ``shards`` entry, else the one split file."""
        shards = self.meta.get("shards")
        if shards is None:
            return [(SPLIT_FILES[split], self.num_tokens[split])]
        entries = shards.get(split) if isinstance(shards, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{meta_path}: shards.{split} must be a non-empty list of {{file, tokens}}")
        listed = []
        for entry in entries:
            name = entry.get("file") if isinstance(entry, dict) else None
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise ValueError(f"{meta_path}: shards.{split}: bad entry {entry!r}")
            listed.append((name, _require_int(meta_path, entry.get("tokens"), f"shards.{split} tokens", 0)))
        if sum(n for _, n in listed) != self.num_tokens[split]:
            raise ValueError(f"{meta_path}: shards.{split} hold {sum(n for _, n in listed)} tokens but "
                             f"num_tokens.{split} is {self.num_tokens[split]}")
        return listed

    def _check_file(self, name: str, count: int) -> None:
        file = self.path / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found (listed by {self.path / META_FILE})")
        expected = count * self.dtype.itemsize
        actual = file.stat().st_size
        if actual != expected:
            raise ValueError(
                f"{file}: size is {actual} bytes but {META_FILE} says {count} "
                f"{self.meta['dtype']} tokens ({expected} bytes); the dataset is incomplete or stale"
            )

    def _check_offsets_file(self, split: str) -> None:
        """Size, first and last entry of the document index (cheap: reads two numbers)."""
        file = self.path / OFFSET_FILES[split]
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found (format_version 2 in {self.path / META_FILE})")
        size = file.stat().st_size
        if size == 0 or size % OFFSET_DTYPE.itemsize:
            raise ValueError(f"{file}: malformed document index ({size} bytes, not a positive multiple of 8)")
        offsets = np.memmap(file, dtype=OFFSET_DTYPE, mode="r")
        check_offsets(str(file), np.array([offsets[0], offsets[-1]]), self.num_tokens[split])

    def doc_offsets(self, split: str = "train") -> np.ndarray:
        """Start offset of every document of ``split``, then the split's token count (int64).

        Read from the offsets index (format 2) or found by EOS (format 1), and checked once.
        """
        if split not in self._offsets:
            if self.has_offsets:
                file = self.path / OFFSET_FILES[split]
                offsets = np.fromfile(file, dtype=OFFSET_DTYPE).astype(np.int64)
                check_offsets(str(file), offsets, self.num_tokens[split])
            else:
                offsets = offsets_from_eos(self._tokens(split), self.eos_id)
            self._offsets[split] = offsets
        return self._offsets[split]

    def _map(self, name: str, n: int) -> np.ndarray:
        if n == 0:
            # mmap cannot map an empty file; an empty read-only array behaves the same.
            empty = np.zeros(0, dtype=self.dtype)
            empty.flags.writeable = False
            return empty
        return np.memmap(self.path / name, dtype=self.dtype, mode="r", shape=(n,))

    def _tokens(self, split: str) -> np.ndarray:
        if split not in self._arrays:
            parts = [self._map(name, n) for name, n in self.shards[split] if n]
            if len(parts) > 1:
                self._arrays[split] = ShardedTokens(parts)  # type: ignore[assignment]
            else:
                self._arrays[split] = parts[0] if parts else self._map("", 0)
        return self._arrays[split]

    def train_tokens(self) -> np.ndarray:
        """Training tokens as a read-only memmap."""
        return self._tokens("train")

    def val_tokens(self) -> np.ndarray:
        """Validation tokens as a read-only memmap (may be empty)."""
        return self._tokens("val")

    @property
    def tokenizer_path(self) -> Path | None:
        """Absolute path of the tokenizer file for decoding, or ``None`` for byte-level data."""
        if self.tokenizer in ("", "bytes"):
            return None
        return (self.path / self.tokenizer).resolve()

    def describe(self) -> str:
        """One line for logs: token counts, vocabulary and tokenizer."""
        return (
            f"token files ({self.path}): train {self.num_tokens['train']:,} tokens, "
            f"val {self.num_tokens['val']:,} tokens, vocab {self.vocab_size} ({self.meta['dtype']}), "
            f"tokenizer {self.tokenizer or '?'}"
        )

    def __repr__(self) -> str:
        return f"TokenFileDataset(path={str(self.path)!r})"
