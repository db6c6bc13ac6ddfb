"""Disk space for a checkpoint: what a save is expected to write, what the disk has free, and whether a failed
write was the disk filling up (ENOSPC, or torch's serializer's short write on a full disk).

The expected size is the larger of the previous complete checkpoint in the same directory (its manifest
lists every file's bytes) and the state this save holds (each rank's tensor shards; a replicated tensor
once, as DCP writes it once).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from trainer.checkpoint.manifest import CheckpointError, latest_complete_checkpoint, read_manifest

# What torch's serializer says when the disk filled under it (it writes through its own zip writer).
NO_SPACE_TEXT = ("no space left on device", "unexpected pos")


def state_bytes(state: dict[str, Any], counts_replicated: bool) -> int:
    """Bytes this rank writes of a DCP state dict: its shards of DTensors, plain tensors and packed bytes
    only when `counts_replicated` (rank 0: DCP deduplicates replicated values onto one rank)."""
    total = 0
    for value in state.values():
        if isinstance(value, DTensor):
            local = value.to_local()
            total += local.numel() * local.element_size()
        elif counts_replicated and isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif counts_replicated and isinstance(value, (bytes, bytearray)):
            total += len(value)
    return total


def previous_checkpoint_bytes(directory: Path) -> int:
    """The size of the latest complete checkpoint in `directory` (0 when there is none)."""
    latest = latest_complete_checkpoint(directory)
    if latest is None:
        return 0
    try:
        files = read_manifest(latest)["files"]
    except (CheckpointError, OSError, KeyError, ValueError):
        return 0
    return sum(int(entry.get("bytes", 0)) for entry in files.values())


def disk_of(path: Path) -> tuple[Path, int]:
    """(the mount point holding `path`, its free bytes for this user); `path` may not exist yet."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    mount = existing
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return mount, int(free)


def human(size: float) -> str:
    """2.1 GB, 350.0 MB, 12.3 kB (decimal units, as `df -H` prints)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{int(size)} B"


def _causes(error: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]  # type: ignore[list-item]
        failures = getattr(current, "failures", None)  # DCP's CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            for failure in failures.values():  # each an (exception, traceback) pair
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
        nested = getattr(current, "exceptions", None)  # an ExceptionGroup
        if isinstance(nested, (list, tuple)):
            todo += [f for f in nested if isinstance(f, BaseException)]


def is_no_space(error: BaseException) -> bool:
    """Whether a failed write was the disk filling up."""
    for cause in _causes(error):
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(cause).lower() for text in NO_SPACE_TEXT):
            return True
    return False
