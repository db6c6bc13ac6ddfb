"""Tokenize text corpora into the ``train.bin``/``val.bin``/offsets/``meta.json`` format.

Usage::

    python -m trainer.data.prepare INPUT [INPUT ...] --output DIR
        [--tokenizer PATH_TO_tokenizer.json | bytes] [--val-fraction 0.01]
        [--text-key text] [--append-eos] [--eos-token TOKEN] [--workers N] [--shard-tokens N]
        [--progress | --no-progress]

* Inputs: ``*.jsonl``, ``*.jsonl.gz`` and ``*.jsonl.zst`` hold one document per line (the string under
  ``--text-key``, alias ``--jsonl-key``); ``*.parquet`` one per row of the ``--text-key`` column
  (pyarrow); a directory written by Hugging Face ``datasets``' ``save_to_disk`` one per row of that
  column (every split of a DatasetDict, in name order); any other file is one UTF-8 document. Empty
  documents are skipped. The optional readers (pyarrow, datasets, zstandard) are the ``data`` extra.
* ``--workers N`` tokenizes in N worker processes (batches are handed out and written back in input
  order, so the output is byte-identical to one worker's); a progress bar on stderr (a terminal only,
  or ``--progress``) shows the input read, tokens/s and the ETA. At the end one report line per input
  (documents, tokens, bytes per token) and a summary line are printed.
* ``--shard-tokens N`` writes each split as shard files of at most N tokens (``train-00000.bin``, ...,
  listed in ``meta.json``), which the reader maps as one array; documents may cross shard files.
* Every split also gets a document index (``train.offsets.bin``: each document's first token, then the
  token count), so document boundaries survive without an EOS token.
* Documents go to validation iff a stable hash of their index (counted over
  all inputs in command-line order) falls below ``--val-fraction``. If that
  leaves one split empty (e.g. a single text file), the last
  ``val_fraction`` of the tokens becomes the validation split instead.
* Input is streamed in bounded batches; large text files are read in
  line-aligned chunks of ~1M characters, so memory stays flat. (Tokens at chunk
  boundaries can therefore differ slightly from whole-file encoding; decoding
  is unaffected for byte-level tokenizers.)
* ``bytes`` tokenization is raw UTF-8 (vocab 256); with ``--append-eos`` an
  extra id 256 is the end-of-document token (vocab 257).
* The tokenizer file is copied into DIR so the dataset can be decoded on its own.
* Special tokens of the tokenizer's post-processor (BOS/CLS...) are not added;
  use ``--append-eos`` to mark document boundaries.

Bad input (missing file, invalid JSON line, missing key, ...) exits with code 2
and a one-line message naming the file and line (row for parquet and datasets). The files are written
into ``DIR/.partial`` and moved into place only when everything succeeded, ``meta.json`` last: a
failed or interrupted run leaves a dataset already in DIR as it was, and never a directory that
``TokenFileDataset`` would accept with partial data.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

import numpy as np

from trainer.data.token_file import (FORMAT_VERSION, META_FILE, OFFSET_DTYPE, OFFSET_FILES, SPLIT_FILES,
                                     dtype_for_vocab)

__all__ = ["PrepareError", "prepare", "main"]

T = TypeVar("T")

# Bounded work units keep memory flat regardless of input size.
_TEXT_CHUNK_CHARS = 1 << 20
_BATCH_MAX_PIECES = 1024
_BATCH_MAX_CHARS = 1 << 23
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[EOS]")
_TOKENIZER_COPY = "tokenizer.json"
_PARTIAL = ".partial"
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_ROWS_PER_READ = 1024


class PrepareError(Exception):
    """A user-facing input problem; ``main`` prints it on one line and exits 2."""


@dataclass(frozen=True)
class _Piece:
    """A chunk of one document of input ``source``; ``last`` marks where an EOS may follow."""

    doc: int
    text: str
    last: bool
    source: int = 0


# --------------------------------------------------------------------------- reading


def _mark_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Yield ``(item, is_last)`` using one item of look-ahead."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _text_chunks(path: Path, chunk_chars: int) -> Iterator[str]:
    """Line-aligned chunks of a UTF-8 file (``newline=""`` keeps CRLF bytes exact)."""
    with open(path, encoding="utf-8", newline="") as f:
        pending = ""
        while block := f.read(chunk_chars):
            pending += block
            cut = pending.rfind("\n") + 1
            if cut == 0:
                # No newline yet: keep reading, but never buffer unboundedly.
                if len(pending) < 4 * chunk_chars:
                    continue
                cut = len(pending)
            yield pending[:cut]
            pending = pending[cut:]
        if pending:
            yield pending


def _open_text(path: Path) -> io.TextIOBase:
    """A text stream of a plain, gzip or zstandard file."""
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")  # type: ignore[return-value]
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise PrepareError(f"{path}: reading .zst needs the zstandard package (pip install -e \".[data]\")") from None
        raw = open(path, "rb")
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), encoding="utf-8")
    return open(path, encoding="utf-8")


def _jsonl_documents(path: Path, key: str) -> Iterator[str]:
    try:
        f = _open_text(path)
        with f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue  # tolerate blank lines, typically a trailing one
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise PrepareError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
                if key not in record:
                    raise PrepareError(f"{path}:{lineno}: missing key {key!r}")
                text = record[key]
                if not isinstance(text, str):
                    raise PrepareError(f"{path}:{lineno}: value of {key!r} is {type(text).__name__}, not a string")
                yield text
    except (OSError, EOFError) as e:  # a truncated gzip, a corrupt zstd frame
        if isinstance(e, FileNotFoundError):
            raise
        raise PrepareError(f"{path}: cannot decompress ({e})") from None
    except Exception as e:  # zstandard raises its own ZstdError
        if type(e).__name__ == "ZstdError":
            raise PrepareError(f"{path}: cannot decompress ({e})") from None
        raise


def _column_texts(path: Path, key: str, rows: Iterator[tuple[int, list[Any]]]) -> Iterator[str]:
    """Strings of one column, checked row by row (``rows`` yields (first row number, values))."""
    for first, values in rows:
        for offset, text in enumerate(values):
            if text is None:
                continue  # a null is an empty document
            if not isinstance(text, str):
                raise PrepareError(f"{path}: row {first + offset}: value of {key!r} is {type(text).__name__}, "
                                   "not a string")
            yield text


def _parquet_documents(path: Path, key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{path}: reading parquet needs pyarrow (pip install -e \".[data]\")") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid and friends
        raise PrepareError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    if key not in names:
        raise PrepareError(f"{path}: no column {key!r} (columns: {', '.join(names)}); pass --text-key")

    def rows() -> Iterator[tuple[int, list[Any]]]:
        first = 1
        for batch in pf.iter_batches(columns=[key], batch_size=_ROWS_PER_READ):
            values = batch.column(0).to_pylist()
            yield first, values
            first += len(values)

    yield from _column_texts(path, key, rows())


def _is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json",
                                                                 "state.json"))


def _hf_documents(path: Path, key: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"{path}: reading a datasets directory needs the datasets package "
                           "(pip install -e \".[data]\")") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for one cause
        raise PrepareError(f"{path}: not a readable datasets directory ({str(e).splitlines()[0]})") from None
    parts = ([(name, loaded[name]) for name in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict)
             else [("", loaded)])
    for split, ds in parts:
        where = path / split if split else path
        if key not in ds.column_names:
            raise PrepareError(f"{where}: no column {key!r} (columns: {', '.join(ds.column_names)}); pass --text-key")

        def rows(ds: Any = ds) -> Iterator[tuple[int, list[Any]]]:
            for first in range(0, len(ds), _ROWS_PER_READ):
                yield first + 1, ds[first:first + _ROWS_PER_READ][key]

        yield from _column_texts(where, key, rows())


def _input_kind(path: Path) -> str:
    if _is_hf_dataset_dir(path):
        return "datasets"
    if path.name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    return "text"


def _file_pieces(path: Path, jsonl_key: str) -> Iterator[Iterable[str]]:
    """Yield each document of ``path`` as an iterable of its chunks (lazy for text files)."""
    kind = _input_kind(path)
    if kind == "text":
        yield _text_chunks(path, _TEXT_CHUNK_CHARS)
        return
    reader = {"jsonl": _jsonl_documents, "parquet": _parquet_documents, "datasets": _hf_documents}[kind]
    for text in reader(path, jsonl_key):
        yield [text]


def _iter_pieces(inputs: Sequence[Path], jsonl_key: str) -> Iterator[_Piece]:
    """All non-empty documents of all inputs, numbered in command-line order."""
    doc = 0
    for source, path in enumerate(inputs):
        try:
            for chunks in _file_pieces(path, jsonl_key):
                emitted = False
                for text, last in _mark_last(c for c in chunks if c):
                    emitted = True
                    yield _Piece(doc, text, last, source)
                doc += emitted
        except UnicodeDecodeError as e:
            raise PrepareError(f"{path}: not valid UTF-8 ({e.reason})") from None


def _batched(pieces: Iterable[_Piece]) -> Iterator[list[_Piece]]:
    batch: list[_Piece] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if len(batch) >= _BATCH_MAX_PIECES or chars >= _BATCH_MAX_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# --------------------------------------------------------------------------- encoding


class _Encoder(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...


class _ByteEncoder:
    """Raw UTF-8 bytes; the EOS, if any, gets the first id past the bytes."""

    name = "bytes"

    def __init__(self, append_eos: bool) -> None:
        self.eos_id: int | None = 256 if append_eos else None
        self.vocab_size = 257 if append_eos else 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class _HFEncoder:
    """A ``tokenizers`` tokenizer loaded from its ``tokenizer.json``."""

    name = _TOKENIZER_COPY

    def __init__(self, path: Path, append_eos: bool, eos_token: str | None) -> None:
        from tokenizers import Tokenizer  # imported lazily: byte mode does not need it

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise PrepareError(f"{path}: cannot load tokenizer ({reason})") from None
        # Added tokens may sit above get_vocab_size(); size the vocab by the max id.
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        self.eos_id = self._find_eos(path, eos_token) if append_eos else None

    def _find_eos(self, path: Path, eos_token: str | None) -> int:
        candidates = (eos_token,) if eos_token is not None else _EOS_CANDIDATES
        for token in candidates:
            token_id = self.tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        raise PrepareError(
            f"{path}: no end-of-document token among {', '.join(candidates)}; pass --eos-token"
        )

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # Offsets are not needed; the "fast" variant skips computing them.
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        # uint32: half the bytes of int64 to send back from a worker process, and any vocabulary fits.
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]


def _make_encoder(tokenizer: str, append_eos: bool, eos_token: str | None) -> _Encoder:
    if tokenizer == "bytes":
        if eos_token is not None:
            raise PrepareError("--eos-token only applies to tokenizer files (bytes use id 256)")
        return _ByteEncoder(append_eos)
    path = Path(tokenizer)
    if not path.is_file():
        raise PrepareError(f"tokenizer file not found: {path}")
    return _HFEncoder(path, append_eos, eos_token)


# --------------------------------------------------------------------------- workers

_WORKER_ENCODER: _Encoder | None = None


def _init_worker(tokenizer: str, append_eos: bool, eos_token: str | None) -> None:
    """Each worker process builds its own encoder once (a tokenizer does not cross processes cheaply)."""
    global _WORKER_ENCODER
    # One process per worker is the parallelism: the Rust tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = _make_encoder(tokenizer, append_eos, eos_token)


def _encode_in_worker(texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
    assert _WORKER_ENCODER is not None
    return _encode_texts(_WORKER_ENCODER, texts)


def _encode_texts(encoder: _Encoder, texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
    """Token ids and UTF-8 size of each text (the size feeds the bytes-per-token report)."""
    return encoder.encode_batch(texts), [len(t.encode("utf-8")) for t in texts]


# --------------------------------------------------------------------------- writing


def _is_val_doc(doc: int, val_fraction: float) -> bool:
    """Stable across runs, platforms and Python versions (unlike ``hash()``)."""
    digest = hashlib.blake2b(doc.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


@dataclass
class _SourceStats:
    """What one input contributed: the per-source report."""

    path: str
    documents: int = 0
    tokens: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "documents": self.documents, "tokens": self.tokens, "bytes": self.bytes,
                "bytes_per_token": round(self.bytes / self.tokens, 4) if self.tokens else None}


def _shard_name(split: str, index: int, sharded: bool) -> str:
    return f"{split}-{index:05d}.bin" if sharded else SPLIT_FILES[split]


@dataclass
class _SplitWriter:
    """Appends token arrays to each split's file (or, with ``shard_tokens``, to shard files of at most that
    many tokens), document starts to the offsets files, and counts what it wrote."""

    out: Path
    dtype: np.dtype
    shard_tokens: int = 0
    files: dict[str, BinaryIO] = field(default_factory=dict)
    offset_files: dict[str, BinaryIO] = field(default_factory=dict)
    shards: dict[str, list[list[Any]]] = field(default_factory=dict)  # split -> [[file name, tokens], ...]
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLIT_FILES, 0))
    docs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLIT_FILES, 0))

    def __enter__(self) -> _SplitWriter:
        for split in SPLIT_FILES:
            self.shards[split] = []
            self._next_shard(split)
        self.offset_files = {s: open(self.out / name, "wb") for s, name in OFFSET_FILES.items()}
        return self

    def _next_shard(self, split: str) -> None:
        if split in self.files:
            self.files[split].close()
        name = _shard_name(split, len(self.shards[split]), self.shard_tokens > 0)
        self.files[split] = open(self.out / name, "wb")
        self.shards[split].append([name, 0])

    def __exit__(self, *exc: object) -> None:
        for f in [*self.files.values(), *self.offset_files.values()]:
            f.close()

    def write(self, split: str, parts: list[np.ndarray], starts: list[int]) -> None:
        if starts:
            self.offset_files[split].write(np.asarray(starts, dtype=OFFSET_DTYPE).tobytes())
        if not parts:
            return
        arr = np.concatenate(parts).astype(self.dtype, copy=False)
        pos = 0
        while pos < arr.size:
            current = self.shards[split][-1]
            if self.shard_tokens and current[1] == self.shard_tokens:
                self._next_shard(split)
                current = self.shards[split][-1]
            take = arr.size - pos if not self.shard_tokens else min(self.shard_tokens - current[1], arr.size - pos)
            self.files[split].write(arr[pos:pos + take].tobytes())
            current[1] += take
            pos += take
        self.tokens[split] += int(arr.size)

    def finish(self) -> None:
        """Close each document index with its split's token count."""
        for split, f in self.offset_files.items():
            f.write(np.asarray([self.tokens[split]], dtype=OFFSET_DTYPE).tobytes())


class _Progress:
    """tqdm over input bytes (for the ETA) with tokens/s beside it; nothing when disabled."""

    def __init__(self, paths: Sequence[Path], enabled: bool) -> None:
        self.ends = list(np.cumsum([_input_size(p) for p in paths]))
        self.bar = None
        self.tokens = 0
        self.start = time.perf_counter()
        self.done = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=int(self.ends[-1]) if self.ends else 0, unit="B", unit_scale=True,
                            file=sys.stderr, desc="tokenizing", dynamic_ncols=True, mininterval=0.5)

    def update(self, source: int, nbytes: int, tokens: int) -> None:
        """Text of input ``source`` read (its share of the file's size) and tokens written."""
        self.tokens += tokens
        start = int(self.ends[source - 1]) if source else 0
        # Within a file: text bytes read, capped at its size on disk (compressed or JSON sizes differ).
        self.done = min(max(self.done, start) + nbytes, int(self.ends[source]))

    def flush(self) -> None:
        """Show what was counted (once per batch: formatting the rate per document would cost)."""
        if self.bar is not None:
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
            self.bar.update(self.done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(int(self.ends[-1]) - self.bar.n if self.ends else 0)
            self.bar.close()


def _input_size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _encode_all(pieces: Iterable[_Piece], encode: Any, writer: _SplitWriter, val_fraction: float, eos_id: int | None,
                stats: list[_SourceStats], progress: _Progress, workers: int) -> None:
    """Encode every piece (in worker processes when ``workers`` > 1, in input order either way) and write."""
    eos = None if eos_id is None else np.array([eos_id], dtype=np.uint32)
    last_doc = -1

    def handle(batch: list[_Piece], result: tuple[list[np.ndarray], list[int]]) -> None:
        nonlocal last_doc
        parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLIT_FILES}
        starts: dict[str, list[int]] = {s: [] for s in SPLIT_FILES}
        pos = dict(writer.tokens)  # where the next token of each split lands
        for piece, ids, nbytes in zip(batch, *result):
            split = "val" if _is_val_doc(piece.doc, val_fraction) else "train"
            if piece.doc != last_doc:  # a document's first piece: its start goes into the index
                starts[split].append(pos[split])
                last_doc = piece.doc
            parts[split].append(ids)
            n = len(ids)
            if piece.last:
                writer.docs[split] += 1
                stats[piece.source].documents += 1
                if eos is not None:
                    parts[split].append(eos)
                    n += 1
            pos[split] += n
            stats[piece.source].tokens += n
            stats[piece.source].bytes += nbytes
            progress.update(piece.source, nbytes, n)
        for split in SPLIT_FILES:
            writer.write(split, parts[split], starts[split])
        progress.flush()

    if workers <= 1:
        for batch in _batched(pieces):
            handle(batch, encode([p.text for p in batch]))
        return
    in_flight: deque[tuple[list[_Piece], Any]] = deque()
    for batch in _batched(pieces):
        in_flight.append((batch, encode([p.text for p in batch])))
        if len(in_flight) >= 2 * workers:  # bounded read-ahead keeps memory flat
            done, pending = in_flight.popleft()
            handle(done, pending.get())
    while in_flight:
        done, pending = in_flight.popleft()
        handle(done, pending.get())


def _split_by_token_tail(out: Path, dtype: np.dtype, writer: _SplitWriter, val_fraction: float) -> None:
    """Fallback when hashing put every document on one side: cut val off the end of the tokens (the
    index too: the cut document continues as val's first). Whole trailing shard files move to val."""
    sharded = writer.shard_tokens > 0
    counts, shards = writer.tokens, writer.shards
    train_idx, val_idx = (out / OFFSET_FILES[s] for s in ("train", "val"))
    if counts["train"] == 0:  # everything went to val: it becomes train
        for name, _ in shards["train"]:
            (out / name).unlink()
        shards["train"] = []
        for i, (name, n) in enumerate(shards["val"]):
            new = _shard_name("train", i, sharded)
            os.replace(out / name, out / new)
            shards["train"].append([new, n])
        shards["val"] = []
        os.replace(val_idx, train_idx)
        counts["train"], counts["val"] = counts["val"], 0
    else:
        for name, _ in shards["val"]:
            (out / name).unlink()
        shards["val"] = []
    total = counts["train"]
    n_val = min(total - 1, max(1, round(total * val_fraction)))
    keep = total - n_val
    kept: list[list[Any]] = []
    moved: list[tuple[Path, int]] = []  # (file, tokens) in order, becoming val's files
    start = 0
    for name, n in shards["train"]:
        if start + n <= keep:
            kept.append([name, n])
        elif start >= keep:
            moved.append((out / name, n))
        else:  # the shard holding the cut: its tail goes into a file of its own
            cut = keep - start
            with open(out / name, "r+b") as f:
                f.seek(cut * dtype.itemsize)
                tail = f.read()
                f.truncate(cut * dtype.itemsize)
            (out / "tail.tmp").write_bytes(tail)
            kept.append([name, cut])
            moved.append((out / "tail.tmp", n - cut))
        start += n
    shards["train"] = kept
    for i, (file, n) in enumerate(moved):
        new = _shard_name("val", i, sharded)
        os.replace(file, out / new)
        shards["val"].append([new, n])
    starts = np.fromfile(train_idx, dtype=OFFSET_DTYPE)[:-1].astype(np.int64)
    train_starts = starts[starts < keep]
    val_starts = np.concatenate([[0], starts[starts > keep] - keep])
    train_idx.write_bytes(np.concatenate([train_starts, [keep]]).astype(OFFSET_DTYPE).tobytes())
    val_idx.write_bytes(np.concatenate([val_starts, [n_val]]).astype(OFFSET_DTYPE).tobytes())
    counts["train"], counts["val"] = keep, n_val


def _write_meta(out: Path, meta: dict[str, Any]) -> None:
    tmp = out / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / META_FILE)  # atomic: readers never see a half-written meta


def _check_inputs(inputs: Sequence[str], output: Path, val_fraction: float, workers: int) -> list[Path]:
    """Fail fast, before any work, on problems that are visible up front."""
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if workers < 1:
        raise PrepareError(f"--workers must be >= 1, got {workers}")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if p.is_dir() and not _is_hf_dataset_dir(p):
            raise PrepareError(f"input directory is not a datasets save_to_disk directory: {p}")
        if not p.exists():
            raise PrepareError(f"input file not found: {p}")
        if p.is_file() and not os.access(p, os.R_OK):
            raise PrepareError(f"input file not readable: {p}")
    if output.exists() and not output.is_dir():
        raise PrepareError(f"--output exists and is not a directory: {output}")
    return paths


def prepare(
    inputs: Sequence[str],
    output: str,
    tokenizer: str = "bytes",
    val_fraction: float = 0.01,
    jsonl_key: str = "text",
    append_eos: bool = False,
    eos_token: str | None = None,
    workers: int = 1,
    progress: bool = False,
    shard_tokens: int = 0,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into the dataset directory ``output``; return its meta.

    Args:
        inputs: text, JSONL (optionally .gz/.zst), parquet files or ``datasets`` directories.
        output: the dataset directory (created; a dataset there is replaced only on success).
        tokenizer: ``bytes`` or the path of a ``tokenizer.json``.
        val_fraction: share of documents for validation.
        jsonl_key: the text field of JSONL records, parquet and datasets columns.
        append_eos: end every document with the end-of-document token.
        eos_token: that token's string (default: common names are tried).
        workers: tokenizing processes (1: this process).
        progress: show a progress bar on stderr.
        shard_tokens: write each split as files of at most this many tokens (0: one file per split).

    Raises:
        PrepareError: on bad input (the message is a single line).
    """
    out = Path(output)
    paths = _check_inputs(inputs, out, val_fraction, workers)
    if shard_tokens < 0:
        raise PrepareError(f"--shard-tokens must be >= 0, got {shard_tokens}")
    encoder = _make_encoder(tokenizer, append_eos, eos_token)
    out.mkdir(parents=True, exist_ok=True)
    work = out / _PARTIAL  # everything is written here and moved into place at the end
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    dtype_name = dtype_for_vocab(encoder.vocab_size)
    dtype = np.dtype("<u2" if dtype_name == "uint16" else "<u4")
    stats = [_SourceStats(str(p)) for p in paths]
    bar = _Progress(paths, progress)
    pool = None
    try:
        if workers > 1:
            # spawn: a fresh interpreter per worker, safe whatever threads this process (or a Rust
            # tokenizer) started.
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer, append_eos, eos_token))
            encode: Any = lambda texts: pool.apply_async(_encode_in_worker, (texts,))  # noqa: E731
        else:
            encode = lambda texts: _encode_texts(encoder, texts)  # noqa: E731
        with _SplitWriter(work, dtype, shard_tokens) as writer:
            _encode_all(_iter_pieces(paths, jsonl_key), encode, writer, val_fraction, encoder.eos_id, stats, bar,
                        workers)
            writer.finish()
        docs = dict(writer.docs)
        total = writer.tokens["train"] + writer.tokens["val"]
        if total == 0:
            raise PrepareError("no tokens produced: all inputs are empty")
        split_mode = "document_hash"
        if val_fraction > 0 and min(writer.tokens.values()) == 0 and total >= 2:
            _split_by_token_tail(work, dtype, writer, val_fraction)
            split_mode = "token_tail"
            docs = {"train": docs["train"] + docs["val"], "val": 0}
        counts = dict(writer.tokens)
        for split in SPLIT_FILES:  # no empty files, but every split keeps one (val may be empty)
            for name, n in writer.shards[split]:
                if n == 0:
                    (work / name).unlink(missing_ok=True)
            writer.shards[split] = [sh for sh in writer.shards[split] if sh[1] > 0]
            if not writer.shards[split]:
                name = _shard_name(split, 0, shard_tokens > 0)
                (work / name).touch()
                writer.shards[split] = [[name, 0]]
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # a dataset already in `out` is left as it was
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    (out / META_FILE).unlink(missing_ok=True)  # a stale meta must not bless the files being replaced
    for stale in [*out.glob("train-*.bin"), *out.glob("val-*.bin")]:  # shards of an earlier dataset
        stale.unlink()
    for name in [*(n for split in SPLIT_FILES for n, _ in writer.shards[split]), *OFFSET_FILES.values()]:
        os.replace(work / name, out / name)
    shutil.rmtree(work, ignore_errors=True)
    if isinstance(encoder, _HFEncoder):
        src, dst = Path(tokenizer), out / _TOKENIZER_COPY
        if not (dst.exists() and dst.samefile(src)):
            shutil.copyfile(src, dst)
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype_name,
        "vocab_size": encoder.vocab_size,
        "tokenizer": encoder.name,
        "num_tokens": counts,
        "eos_id": encoder.eos_id,
        # Informational extras; readers must not depend on them.
        "tokenizer_source": "bytes" if encoder.name == "bytes" else str(Path(tokenizer).resolve()),
        "documents": docs,
        "split": split_mode,
        "val_fraction": val_fraction,
        "sources": [s.as_dict() for s in stats],
    }
    if shard_tokens:
        meta["shards"] = {split: [{"file": name, "tokens": n} for name, n in writer.shards[split]]
                          for split in SPLIT_FILES}
    _write_meta(out, meta)
    return meta


def _report(meta: dict[str, Any]) -> list[str]:
    """One line per input: documents, tokens, bytes per token."""
    lines = []
    for s in meta["sources"]:
        bpt = f"{s['bytes_per_token']:.3f}" if s["bytes_per_token"] is not None else "-"
        lines.append(f"  {s['path']}: {s['documents']:,} documents, {s['tokens']:,} tokens, "
                     f"{s['bytes']:,} bytes, {bpt} bytes/token")
    return lines


def _summary(output: str, meta: dict[str, Any]) -> str:
    n, d = meta["num_tokens"], meta["documents"]
    line = (
        f"prepared {output}: train {n['train']:,} tokens ({d['train']} docs), "
        f"val {n['val']:,} tokens ({d['val']} docs), vocab {meta['vocab_size']} {meta['dtype']}, "
        f"tokenizer {meta['tokenizer']}"
    )
    if meta["split"] == "token_tail":
        line += " (val = last tokens: too few documents to split by document)"
    return line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.data.prepare",
        description="Tokenize text, JSONL(.gz/.zst), parquet or datasets directories into train.bin, val.bin, "
                    "document indexes and meta.json.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files (one document each), .jsonl[.gz|.zst], .parquet, or datasets directories")
    p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to write")
    p.add_argument("--tokenizer", default="bytes", help="path to a tokenizer.json, or 'bytes' (default)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for validation")
    p.add_argument("--text-key", "--jsonl-key", dest="jsonl_key", default="text",
                   help="field (JSONL) or column (parquet, datasets) holding the text")
    p.add_argument("--append-eos", action="store_true", help="append an end-of-document token to each document")
    p.add_argument("--eos-token", default=None, help="EOS token string (default: common names are tried)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument("--shard-tokens", type=int, default=0, metavar="N",
                   help="write each split as shard files of at most N tokens (default 0: one file per split)")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="show the progress bar even when stderr is not a terminal")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code (2 on bad input)."""
    args = _parser().parse_args(argv)
    try:
        meta = prepare(
            args.inputs,
            args.output,
            tokenizer=args.tokenizer,
            val_fraction=args.val_fraction,
            jsonl_key=args.jsonl_key,
            append_eos=args.append_eos,
            eos_token=args.eos_token,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            progress=sys.stderr.isatty() if args.progress is None else args.progress,
        )
    except PrepareError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # output-side trouble (disk full, permissions): not the input's fault
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1
    for line in _report(meta):
        print(line)
    print(_summary(args.output, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
