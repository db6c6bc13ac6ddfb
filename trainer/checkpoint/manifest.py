"""The on-disk layout of checkpoints: naming, the atomic commit, discovery, verification, retention.

A checkpoint directory holds, for each committed save, `step_<NNNNNNNN>/` with DCP's shard files
(`__<rank>_<i>.distcp`, written by every rank), DCP's `.metadata`, the run's resolved `config.yaml` and
`checkpoint.json` (the manifest: step, counters, metrics, and the size and CRC-32 of every file).

A save is written into `.step_<NNNNNNNN>.partial/` and becomes `step_<NNNNNNNN>/` by one `os.replace`
once every rank has finished: a directory with the final name is complete by construction, and a
crash at any moment leaves either the previous state or a `.partial` directory that discovery ignores
(and the next run removes).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from trainer.durable_io import fsync_directory, write_atomically

log = logging.getLogger("trainer")

MANIFEST = "checkpoint.json"
CONFIG = "config.yaml"
FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded (the message names the checkpoint and the cause)."""


class CheckpointNoSpaceError(CheckpointError):
    """A checkpoint does not fit on its disk: refused before the save (free space below its expected size)
    or stopped by ENOSPC while writing (the partial save removed, earlier checkpoints kept). Exit status 5,
    status.json `no_space`; the message names the disk and the sizes."""


class CheckpointCorruptError(CheckpointError):
    """A file of a committed checkpoint is missing, truncated or altered."""

    def __init__(self, message: str, path: Path, file: Optional[Path] = None) -> None:
        super().__init__(message)
        self.path = path
        self.file = file


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def partial_path(path: Path) -> Path:
    """Where a save to `path` is written before its commit (a hidden sibling, same filesystem)."""
    return path.parent / f".{path.name}.partial"


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


# A module attribute (tests replace it to kill the process between the steps of a commit).
_fsync_dir = fsync_directory


def commit(partial: Path, final: Path, manifest: dict[str, Any], config_yaml: Optional[str]) -> Path:
    """Record every file's size and CRC in the manifest, then rename `partial` to `final`.

    Runs on one process (rank 0) after every rank's shards and DCP's metadata are on disk. An older
    checkpoint at `final` (the same step saved again, e.g. after a rollback) is replaced.
    """
    if config_yaml is not None:
        (partial / CONFIG).write_text(config_yaml)
    files = {}
    for file in sorted(p for p in partial.iterdir() if p.is_file() and p.name != MANIFEST):
        files[file.name] = {"bytes": file.stat().st_size, "crc32": file_crc32(file)}
    manifest = {**manifest, "format": FORMAT_VERSION, "complete": True, "files": files,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    write_atomically(partial / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    _fsync_dir(partial)
    replaced = None
    if final.exists():
        replaced = final.parent / f".{final.name}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`; CheckpointError when it is not a complete checkpoint."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, ValueError) as error:
        raise CheckpointCorruptError(f"checkpoint {path}: cannot read {file}: {error}", path, file) from None
    if not isinstance(manifest, dict) or not manifest.get("complete") or "files" not in manifest:
        raise CheckpointCorruptError(f"checkpoint {path}: {file} does not mark a complete checkpoint", path, file)
    return manifest


def update_metrics(path: Path, metrics: dict[str, float]) -> None:
    """Add metrics measured on the checkpoint's weights after it was written (the validation loss)."""
    manifest = read_manifest(path)
    manifest["metrics"] = {**manifest.get("metrics", {}), **metrics}
    write_atomically(path / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def verify_files(path: Path, names: Iterable[str], manifest: dict[str, Any], checksums: bool = True) -> None:
    """Check that the named files of the checkpoint have the size (and CRC-32) the manifest recorded."""
    recorded = manifest["files"]
    for name in names:
        file = path / name
        expected = recorded[name]
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointCorruptError(f"checkpoint {path} is damaged: {file} is missing", path, file) from None
        if size != expected["bytes"]:
            what = "truncated" if size < expected["bytes"] else "longer than written"
            raise CheckpointCorruptError(f"checkpoint {path} is damaged: {file} is {what} ({size} bytes, "
                                         f"{expected['bytes']} when saved)", path, file)
        if checksums and file_crc32(file) != expected["crc32"]:
            raise CheckpointCorruptError(f"checkpoint {path} is damaged: {file} does not match the CRC-32 "
                                         "recorded when it was saved (the file was altered)", path, file)


def checkpoint_step(path: Path) -> Optional[int]:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(directory: Path | str) -> list[Path]:
    """The committed checkpoints under `directory`, oldest first (partial saves are not listed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        step = checkpoint_step(path)
        if step is not None and path.is_dir() and (path / MANIFEST).is_file():
            found.append((step, path))
    return [path for _, path in sorted(found)]


def latest_complete_checkpoint(directory: Path | str) -> Optional[Path]:
    """The most recent committed checkpoint under `directory`, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def remove_partial_saves(directory: Path) -> list[Path]:
    """Delete what saves that never committed left behind (a process killed mid-save)."""
    removed = []
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.startswith(".step_") and path.name.endswith((".partial", ".replaced")):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# ---- retention ---------------------------------------------------------------------------------------
@dataclass
class RetentionPolicy:
    """Which committed checkpoints survive: the union of the three rules (and always the newest)."""

    # The most recent K.
    keep_last: int = 3
    # The K best by `monitor` (among checkpoints that recorded it); 0 disables.
    keep_best: int = 0
    monitor: str = "val_loss"
    # min or max.
    mode: str = "min"
    # Checkpoints at steps that are multiples of this are never deleted (None: no milestones).
    milestone_every: Optional[int] = None

    def keep(self, checkpoints: list[tuple[int, Path, dict[str, float]]]) -> set[Path]:
        """The paths to keep among (step, path, metrics) entries."""
        ordered = sorted(checkpoints, key=lambda entry: entry[0])
        kept = {path for _, path, _ in ordered[-max(self.keep_last, 1):]}
        if self.keep_best > 0:
            scored = [(metrics[self.monitor], step, path) for step, path, metrics in ordered
                      if isinstance(metrics.get(self.monitor), (int, float))]
            scored.sort(key=lambda entry: (entry[0] if self.mode == "min" else -entry[0], -entry[1]))
            kept |= {path for _, _, path in scored[:self.keep_best]}
        if self.milestone_every:
            kept |= {path for step, path, _ in ordered if step % self.milestone_every == 0}
        return kept

    def apply(self, directory: Path) -> list[Path]:
        """Delete the checkpoints the policy does not keep; return them."""
        entries = []
        for path in complete_checkpoints(directory):
            try:
                metrics = read_manifest(path).get("metrics", {})
            except CheckpointError:
                metrics = {}
            entries.append((checkpoint_step(path) or 0, path, metrics))
        kept = self.keep(entries)
        deleted = [path for _, path, _ in entries if path not in kept]
        for path in deleted:
            # Renamed out of the step_ namespace first, so a crash mid-delete never leaves a half-deleted
            # checkpoint that discovery would list.
            doomed = path.parent / f".{path.name}.replaced"
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        return deleted
