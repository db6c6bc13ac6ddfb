"""Tokenize text / JSONL files into the ``train.bin``/``val.bin``/``meta.json`` format.

Usage::

    python -m trainer.data.prepare INPUT [INPUT ...] --output DIR
        [--tokenizer PATH_TO_tokenizer.json | bytes] [--val-fraction 0.01]
        [--jsonl-key text] [--append-eos] [--eos-token TOKEN]

* ``*.jsonl`` inputs hold one document per line (the string under ``--jsonl-key``);
  any other file is one UTF-8 document. Empty documents are skipped.
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
and a one-line message; ``meta.json`` is written last, so an interrupted run
never leaves a directory that ``TokenFileDataset`` would accept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

import numpy as np

from trainer.data.token_file import FORMAT_VERSION, META_FILE, SPLIT_FILES, dtype_for_vocab

__all__ = ["PrepareError", "prepare", "main"]

T = TypeVar("T")

# Bounded work units keep memory flat regardless of input size.
_TEXT_CHUNK_CHARS = 1 << 20
_BATCH_MAX_PIECES = 1024
_BATCH_MAX_CHARS = 1 << 23
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[EOS]")
_TOKENIZER_COPY = "tokenizer.json"


class PrepareError(Exception):
    """A user-facing input problem; ``main`` prints it on one line and exits 2."""


@dataclass(frozen=True)
class _Piece:
    """A chunk of one document; ``last`` marks where an EOS may follow."""

    doc: int
    text: str
    last: bool


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


def _jsonl_documents(path: Path, key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
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


def _file_pieces(path: Path, jsonl_key: str) -> Iterator[Iterable[str]]:
    """Yield each document of ``path`` as an iterable of its chunks (lazy for text files)."""
    if path.suffix == ".jsonl":
        for text in _jsonl_documents(path, jsonl_key):
            yield [text]
    else:
        yield _text_chunks(path, _TEXT_CHUNK_CHARS)


def _iter_pieces(inputs: Sequence[Path], jsonl_key: str) -> Iterator[_Piece]:
    """All non-empty documents of all inputs, numbered in command-line order."""
    doc = 0
    for path in inputs:
        try:
            for chunks in _file_pieces(path, jsonl_key):
                emitted = False
                for text, last in _mark_last(c for c in chunks if c):
                    emitted = True
                    yield _Piece(doc, text, last)
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
        return [np.asarray(e.ids, dtype=np.int64) for e in encode(texts, add_special_tokens=False)]


def _make_encoder(tokenizer: str, append_eos: bool, eos_token: str | None) -> _Encoder:
    if tokenizer == "bytes":
        if eos_token is not None:
            raise PrepareError("--eos-token only applies to tokenizer files (bytes use id 256)")
        return _ByteEncoder(append_eos)
    path = Path(tokenizer)
    if not path.is_file():
        raise PrepareError(f"tokenizer file not found: {path}")
    return _HFEncoder(path, append_eos, eos_token)


# --------------------------------------------------------------------------- writing


def _is_val_doc(doc: int, val_fraction: float) -> bool:
    """Stable across runs, platforms and Python versions (unlike ``hash()``)."""
    digest = hashlib.blake2b(doc.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


@dataclass
class _SplitWriter:
    """Appends token arrays to ``train.bin``/``val.bin`` and counts what it wrote."""

    out: Path
    dtype: np.dtype
    files: dict[str, BinaryIO] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLIT_FILES, 0))
    docs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLIT_FILES, 0))

    def __enter__(self) -> _SplitWriter:
        self.files = {s: open(self.out / name, "wb") for s, name in SPLIT_FILES.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.files.values():
            f.close()

    def write(self, split: str, parts: list[np.ndarray]) -> None:
        if not parts:
            return
        arr = np.concatenate(parts).astype(self.dtype, copy=False)
        self.files[split].write(arr.tobytes())
        self.tokens[split] += int(arr.size)


def _encode_all(pieces: Iterable[_Piece], encoder: _Encoder, writer: _SplitWriter, val_fraction: float) -> None:
    eos = None if encoder.eos_id is None else np.array([encoder.eos_id], dtype=np.int64)
    for batch in _batched(pieces):
        parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLIT_FILES}
        for piece, ids in zip(batch, encoder.encode_batch([p.text for p in batch])):
            split = "val" if _is_val_doc(piece.doc, val_fraction) else "train"
            parts[split].append(ids)
            if piece.last:
                writer.docs[split] += 1
                if eos is not None:
                    parts[split].append(eos)
        for split, arrays in parts.items():
            writer.write(split, arrays)


def _split_by_token_tail(out: Path, dtype: np.dtype, counts: dict[str, int], val_fraction: float) -> None:
    """Fallback when hashing put every document on one side: cut val off the end."""
    train_file, val_file = (out / SPLIT_FILES[s] for s in ("train", "val"))
    if counts["train"] == 0:
        os.replace(val_file, train_file)
        val_file.touch()
    total = counts["train"] + counts["val"]
    n_val = min(total - 1, max(1, round(total * val_fraction)))
    keep_bytes = (total - n_val) * dtype.itemsize
    with open(train_file, "r+b") as f:
        f.seek(keep_bytes)
        tail = f.read()
        f.truncate(keep_bytes)
    val_file.write_bytes(tail)
    counts["train"], counts["val"] = total - n_val, n_val


def _write_meta(out: Path, meta: dict[str, Any]) -> None:
    tmp = out / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / META_FILE)  # atomic: readers never see a half-written meta


def _check_inputs(inputs: Sequence[str], output: Path, val_fraction: float) -> list[Path]:
    """Fail fast, before any work, on problems that are visible up front."""
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise PrepareError(f"input file not found: {p}")
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
) -> dict[str, Any]:
    """Tokenize ``inputs`` into the dataset directory ``output``; return its meta.

    Raises:
        PrepareError: on bad input (the message is a single line).
    """
    out = Path(output)
    paths = _check_inputs(inputs, out, val_fraction)
    encoder = _make_encoder(tokenizer, append_eos, eos_token)
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # a stale meta must not bless new, partial bins
    dtype_name = dtype_for_vocab(encoder.vocab_size)
    dtype = np.dtype("<u2" if dtype_name == "uint16" else "<u4")
    with _SplitWriter(out, dtype) as writer:
        _encode_all(_iter_pieces(paths, jsonl_key), encoder, writer, val_fraction)
    counts, docs = dict(writer.tokens), dict(writer.docs)
    total = counts["train"] + counts["val"]
    if total == 0:
        raise PrepareError("no tokens produced: all inputs are empty")
    split_mode = "document_hash"
    if val_fraction > 0 and min(counts.values()) == 0 and total >= 2:
        _split_by_token_tail(out, dtype, counts, val_fraction)
        split_mode = "token_tail"
        docs = {"train": docs["train"] + docs["val"], "val": 0}
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
    }
    _write_meta(out, meta)
    return meta


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
        description="Tokenize text/JSONL files into train.bin, val.bin and meta.json.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files (one document each) or .jsonl files")
    p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to write")
    p.add_argument("--tokenizer", default="bytes", help="path to a tokenizer.json, or 'bytes' (default)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for validation")
    p.add_argument("--jsonl-key", default="text", help="field holding the text in .jsonl records")
    p.add_argument("--append-eos", action="store_true", help="append an end-of-document token to each document")
    p.add_argument("--eos-token", default=None, help="EOS token string (default: common names are tried)")
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
        )
    except PrepareError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # output-side trouble (disk full, permissions): not the input's fault
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1
    print(_summary(args.output, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
