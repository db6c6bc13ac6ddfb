"""The largest token id of each token file, checked against the model's vocabulary before a run starts.

A source's own vocabulary size (meta.json, the Megatron or nanoGPT metadata) is what its writer said; a
file holding a larger id (a meta.json that under-reports the tokenizer, files of another tokenizer copied
in) would fail hours later inside the embedding lookup with no file named. The scan is a chunked max over
the memory-mapped file (about a second per GB); its result is cached beside the files in
`token_ids.json`, keyed by file name, size and modification time, so a directory is scanned once (when it
is writable; otherwise every run scans it).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

CACHE_FILE = "token_ids.json"
CHUNK = 1 << 26  # tokens per max() call: bounded memory whatever the file size


def token_files(tokens: Any) -> Iterator[tuple[Path, np.ndarray]]:
    """(file, its memory-mapped tokens) of a split's array: one memmap, or the shards of a `ShardedTokens`;
    nothing for arrays held in memory."""
    for part in getattr(tokens, "parts", [tokens]):
        filename = getattr(part, "filename", None)
        if filename is not None and len(part):
            yield Path(filename), part


def _scan(tokens: np.ndarray) -> int:
    return max(int(np.max(tokens[start:start + CHUNK])) for start in range(0, len(tokens), CHUNK))


def largest_token_id(file: Path, tokens: np.ndarray) -> int:
    """The largest id in `tokens` (the memory map of `file`), from the directory's cache when it is current."""
    stat = file.stat()
    key = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "tokens": len(tokens), "dtype": str(tokens.dtype)}
    cache_path = file.parent / CACHE_FILE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(file.name) if isinstance(cache, dict) else None
    if isinstance(entry, dict) and {k: entry.get(k) for k in key} == key and isinstance(entry.get("max"), int):
        return entry["max"]
    largest = _scan(tokens)
    cache = cache if isinstance(cache, dict) else {}
    cache[file.name] = {**key, "max": largest}
    temporary = None
    try:  # atomically, so ranks scanning at once never read half a file
        with tempfile.NamedTemporaryFile("w", dir=file.parent, prefix=".token_ids.", delete=False) as out:
            temporary = out.name
            json.dump(cache, out, indent=1)
        os.replace(temporary, cache_path)
    except OSError:  # a read-only dataset directory: scanned again next time
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
    return largest


def ids_beyond(tokens: Any, vocab_size: int) -> tuple[Path, int] | None:
    """(file, its largest id) of the first file of a split's tokens holding an id >= `vocab_size`, else None."""
    for file, part in token_files(tokens):
        largest = largest_token_id(file, part)
        if largest >= vocab_size:
            return file, largest
    return None
