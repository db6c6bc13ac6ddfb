"""A real-text, zero-download corpus: the interpreter's own standard library.

Every Python installation ships ~12 MB of ``.py`` sources, which is plenty for
smoke tests and small byte-level language models without network access.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["StdlibCorpus"]

# Directories that are never part of "the standard library" proper.
_ALWAYS_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Test suites: large, repetitive and full of deliberately odd files.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SEPARATOR = b"\n"


@dataclass(frozen=True)
class _SourceFile:
    relpath: str  # POSIX separators so the split hash is platform independent
    data: bytes


@dataclass(frozen=True)
class _Split:
    train: np.ndarray
    val: np.ndarray
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def _is_val_file(relpath: str, val_fraction: float) -> bool:
    """Stable per-file split: depends only on the path, never on order or caps."""
    return zlib.crc32(relpath.encode("utf-8")) / 2**32 < val_fraction


def _iter_py_files(root: Path, include_tests: bool) -> list[str]:
    skipped = _ALWAYS_SKIPPED_DIRS if include_tests else _ALWAYS_SKIPPED_DIRS | _TEST_DIRS
    relpaths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending (site-packages is huge).
        dirnames[:] = [d for d in dirnames if d not in skipped]
        rel_dir = Path(dirpath).relative_to(root)
        relpaths.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(relpaths)


@functools.lru_cache(maxsize=4)
def _scan(root: str, include_tests: bool) -> tuple[_SourceFile, ...]:
    """Read all usable source files once per process (about 0.1 s for 12 MB)."""
    files: list[_SourceFile] = []
    for relpath in _iter_py_files(Path(root), include_tests):
        data = (Path(root) / relpath).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test fixtures are latin-1 on purpose
        files.append(_SourceFile(relpath, data))
    return tuple(files)


def _take(files: list[_SourceFile], cap: int | None) -> tuple[np.ndarray, tuple[str, ...]]:
    """Join files with newlines, stopping (and truncating) at ``cap`` bytes."""
    chosen: list[_SourceFile] = []
    total = 0
    for f in files:
        if cap is not None and total >= cap:
            break
        chosen.append(f)
        total += len(f.data) + len(_SEPARATOR)
    blob = _SEPARATOR.join(f.data for f in chosen)
    if cap is not None:
        blob = blob[:cap]
    # frombuffer over immutable bytes yields a read-only array, which protects
    # the per-process cache from accidental in-place edits by callers.
    return np.frombuffer(blob, dtype=np.uint8), tuple(f.relpath for f in chosen)


@functools.lru_cache(maxsize=8)
def _build(root: str, val_fraction: float, max_bytes: int | None, include_tests: bool) -> _Split:
    files = _scan(root, include_tests)
    val = [f for f in files if _is_val_file(f.relpath, val_fraction)]
    if val_fraction > 0 and not val and files:
        # Tiny roots may hash no file into validation; hold out the file whose
        # hash is smallest so the choice is still stable.
        val = [min(files, key=lambda f: zlib.crc32(f.relpath.encode("utf-8")))]
    val_names = {f.relpath for f in val}
    train = [f for f in files if f.relpath not in val_names]
    val_cap = None if max_bytes is None else max(1, math.ceil(max_bytes * val_fraction))
    train_tokens, train_files = _take(train, max_bytes)
    val_tokens, val_files = _take(val, val_cap)
    return _Split(train_tokens, val_tokens, train_files, val_files)


class StdlibCorpus:
    """Byte-level corpus (vocab 256) of the running interpreter's stdlib sources.

    Files are taken in sorted relative-path order and joined with a newline.
    ``site-packages``, ``__pycache__`` and (unless ``include_tests``) the
    ``test``/``tests``/``idle_test`` directories are skipped, as are files that
    are not valid UTF-8. A file belongs to validation iff
    ``crc32(relpath) / 2**32 < val_fraction``, so the split never depends on
    file order or on ``max_bytes``. ``max_bytes`` is a hard cap on training
    bytes (the last file may be cut); validation is capped at
    ``ceil(max_bytes * val_fraction)`` bytes.

    Args:
        val_fraction: share of files held out for validation, in ``[0, 1)``.
        max_bytes: cap on training bytes, or ``None`` for everything.
        include_tests: also read the stdlib test suites.
        root: directory to scan instead of ``sysconfig.get_paths()["stdlib"]``.
    """

    vocab_size: int = 256

    def __init__(
        self,
        val_fraction: float = 0.05,
        max_bytes: int | None = 16_000_000,
        include_tests: bool = False,
        root: str | None = None,
    ) -> None:
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
        self.root = os.path.abspath(root if root is not None else sysconfig.get_paths()["stdlib"])
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"stdlib corpus root is not a directory: {self.root}")
        self.val_fraction = float(val_fraction)
        self.max_bytes = max_bytes
        self.include_tests = include_tests
        self._split = _build(self.root, self.val_fraction, max_bytes, include_tests)
        if self._split.train.size == 0:
            raise ValueError(f"no usable .py files for training under {self.root}")

    def train_tokens(self) -> np.ndarray:
        """Training bytes as a read-only ``uint8`` array."""
        return self._split.train

    def val_tokens(self) -> np.ndarray:
        """Validation bytes as a read-only ``uint8`` array (empty if ``val_fraction`` is 0)."""
        return self._split.val

    @property
    def train_files(self) -> tuple[str, ...]:
        """Relative paths (POSIX) of the files in the training split, in order."""
        return self._split.train_files

    @property
    def val_files(self) -> tuple[str, ...]:
        """Relative paths (POSIX) of the files in the validation split, in order."""
        return self._split.val_files

    def describe(self) -> str:
        """One line for logs: file and byte counts of both splits."""
        s = self._split
        return (
            f"stdlib corpus ({self.root}): train {len(s.train_files)} files / {s.train.size:,} bytes, "
            f"val {len(s.val_files)} files / {s.val.size:,} bytes, byte-level vocab {self.vocab_size}"
        )

    @staticmethod
    def clear_cache() -> None:
        """Forget the per-process cache (the next construction re-reads the files)."""
        _build.cache_clear()
        _scan.cache_clear()

    def __repr__(self) -> str:
        return (
            f"StdlibCorpus(val_fraction={self.val_fraction}, max_bytes={self.max_bytes}, "
            f"include_tests={self.include_tests}, root={self.root!r})"
        )
