"""Reading DCP checkpoints without unpickling arbitrary objects.

torch.distributed.checkpoint stores tensors with `torch.save` (read back with `weights_only=True`), but
reads its `.metadata` file with plain `pickle.load` and non-tensor values with `torch.load(...,
weights_only=False)`: a crafted checkpoint could run code on load. The reader here unpickles the
metadata with an allow-list of the classes DCP itself writes, and the planner reads every value with
`weights_only=True`, so loading a checkpoint never executes anything but tensor and container rebuilds.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import pickle
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"
# DCP's notice that it saves or loads in one process, which is what is meant without a process group. Filtered
# for the whole process (not only inside `dcp_call`): an asynchronous save emits it from its writing thread,
# after the call has returned.
SINGLE_PROCESS_NOTICE = "torch.distributed is (disabled|unavailable)"
warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTICE)

# (module, name) pairs DCP's metadata pickle refers to; a dtype is allowed by value, below.
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint's metadata refers to a class outside DCP's own metadata types."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED_GLOBALS or module in _ALLOWED_MODULES
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            allowed = True
        if not allowed:
            raise UnsafeCheckpointError(f"refusing to load {module}.{name}: not a checkpoint metadata type")
        if module == "pathlib":  # a path saved on another OS: keep it as a pure path (it is informative only)
            return pathlib.PurePath
        return super().find_class(module, name)


def read_metadata(path: pathlib.Path) -> Metadata:
    """DCP's metadata of the checkpoint at `path`, unpickled through the allow-list."""
    with open(path / METADATA_FILE, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path / METADATA_FILE} does not hold DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the allow-listing unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(pathlib.Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner over a flat state dict, reading non-tensor values with weights_only=True."""

    def __init__(self) -> None:
        # The state dicts here are flat (key -> tensor or object), so nothing needs flattening.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True, map_location="cpu")


def pack(obj: Any) -> bytes:
    """An object of plain containers, numbers, strings and tensors, as opaque bytes for a checkpoint.

    DCP would otherwise flatten a nested dict into one entry per leaf, which a loader can only read back
    if it already knows every key; packed, the object is one entry of any shape.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    """The object `pack` stored, deserialized with weights_only=True."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


@contextlib.contextmanager
def dcp_call() -> Iterator[bool]:
    """Around a DCP save/load: yields its `no_dist` (True without a process group, where DCP warns that
    it assumes one process, which is what is meant: the warning is silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTICE)
        yield not (dist.is_available() and dist.is_initialized())
