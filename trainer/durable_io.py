"""Crash-safe file writes, shared by the checkpoint manifest and the metrics file: a file is replaced in one
step (a temporary beside it, fsynced, renamed over it) and the rename is made durable by an fsync of its
directory, so a kill at any moment leaves either the old or the new content."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make renames and new entries in `directory` durable (best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` by `text` in one step: a temporary beside it, fsynced, renamed over it."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", newline="") as f:  # newline="": text (a CSV's \r\n) is written as given
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)
