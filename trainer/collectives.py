"""The record of collectives each rank keeps, read by the hang watchdog and the straggler report.

Two sources, because no single hook sees every path on both backends (checked on torch 2.13):

- torch's flight recorder (`TORCH_FR_BUFFER_SIZE` entries per process, on by default here). Its C++ hook
  sits in the process group itself, so it records what DDP's reducer, FSDP2, DTensor's functional
  collectives and our own `dist.*` calls issue, on NCCL and (since torch 2.7) on gloo: operation, process
  group, the group's collective sequence number (the same number on every member), sizes, dtypes and the
  wall-clock time the call was issued. On NCCL it also has the started/completed state and p2p entries; on
  gloo every entry stays `scheduled` and send/recv are not recorded.
- a Python-level record of the pipeline's point-to-point operations, which gloo's flight recorder misses:
  `torch.distributed.pipelining.schedules._batch_p2p` (every schedule's sends and receives pass through it)
  is wrapped once per process; each op gets direction, peer (global rank), group, bytes, the step, its index
  among this step's ops towards that peer (the micro-batch for one stage per rank), issue time, and the
  time its `wait()` returned (None while pending).

Which collective a rank is in right now: its flight recorder's oldest entry that is not completed
(`fr_entry_pending`). That holds for collectives issued from C++ while the Python stack shows something
else (DDP's bucket all-reduces from autograd's hooks and its reducer, waited for at the end of the
backward; FSDP's reduce-scatter; DTensor's functional collectives).

Not covered: blocking `dist.send`/`dist.recv` outside the pipeline on gloo (the project has none), and on
gloo the completion time of collectives (a hang is diagnosed from sequence numbers instead: members whose
last number in a group is behind the others never entered the collective the others wait in).
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import threading
import time
from typing import Any

import torch.distributed as dist

FR_ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_FR_ENTRIES = 2000
P2P_ENTRIES = 512


def enable_flight_recorder(entries: int = DEFAULT_FR_ENTRIES) -> None:
    """Turn torch's flight recorder on for the process groups made after this call (an explicit
    TORCH_FR_BUFFER_SIZE, 0 included, is kept). Without the stack of every call
    (TORCH_INCLUDE_STACK_TRACE=0 unless set): nothing here reads them (a hung rank's stack comes from
    the watchdog's own dump of every thread). Measured on gloo (1 process, 4 KB all-reduces, 2 x 20,000
    calls): about 3-6 us per collective with the recorder on, with or without those stacks."""
    os.environ.setdefault(FR_ENV, str(entries))
    os.environ.setdefault("TORCH_INCLUDE_STACK_TRACE", "0")


def flight_recorder_capacity() -> int:
    """How many records the flight recorder's ring holds (0: off)."""
    return int(os.environ.get(FR_ENV, "0") or 0)


def flight_recorder_enabled() -> bool:
    return flight_recorder_capacity() > 0


def flight_recorder_entries(stack_traces: bool = False) -> list[dict[str, Any]]:
    """The flight recorder's entries of this process (oldest first), [] when it is off or unavailable."""
    if not flight_recorder_enabled():
        return []
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=stack_traces,
                                           onlyActive=False))
    except Exception:  # noqa: BLE001 - an older torch or a backend without a recorder: nothing to read
        return []
    return list(dump.get("entries", []))


def group_names(dims: Any) -> dict[str, str]:
    """Process-group name (as the flight recorder reports it) -> the parallel dimension it serves
    ("pp", "dp_replicate", "dp" for a flattened group, "world" for the default group)."""
    names: dict[str, str] = {}
    if dist.is_initialized():
        names[dist.distributed_c10d._get_default_group().group_name] = "world"
    if dims is None or getattr(dims, "_mesh", None) is None:
        return names
    for name, mesh in dims.named_groups():
        names[mesh.get_group().group_name] = name
    return names


def normalize_fr_entry(entry: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    pg_name = str(entry.get("process_group", ("?", ""))[0])
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    return {
        "source": "flight_recorder",
        "op": op,
        "group": names.get(pg_name, f"group {pg_name}"),
        "pg": pg_name,
        "seq": int(entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id", 0)),
        "p2p": bool(entry.get("is_p2p")),
        "sizes": entry.get("input_sizes"),
        "created_ns": entry.get("time_created_ns"),
        "started_ns": entry.get("time_discovered_started_ns"),
        "completed_ns": entry.get("time_discovered_completed_ns"),
        "state": entry.get("state"),
        "pending": fr_entry_pending(entry),
    }


def fr_entry_pending(entry: dict[str, Any]) -> bool:
    """Whether a flight-recorder entry's collective has not completed on this rank: NCCL's state, or on gloo
    (whose entries stay `scheduled`) `retired` false: the recorder retires an entry when its work is done
    and released, so a DDP bucket's all-reduce, an FSDP reduce-scatter or our own call that waits for a
    peer stays unretired (checked on torch 2.13 with gloo: a stopped peer leaves DDP's two bucket
    all-reduces of the step unretired, every earlier one retired)."""
    if entry.get("state") == "completed":
        return False
    return entry.get("retired") is False


class _TimedWork:
    """A p2p work whose wait() stamps the record it belongs to (everything else goes to the real work)."""

    __slots__ = ("_work", "_record")

    def __init__(self, work: Any, record: dict[str, Any]) -> None:
        self._work = work
        self._record = record

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._record["finished_ns"] = time.time_ns()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class P2PRecorder:
    """This process's pipeline sends and receives (see the module docstring); one per process."""

    _installed: "P2PRecorder | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=P2P_ENTRIES)
        self.step = 0
        self._counts: dict[tuple[str, int], int] = {}
        self._seq = itertools.count(1)
        self.names: dict[str, str] = {}

    @classmethod
    def install(cls) -> "P2PRecorder":
        """Wrap the pipeline's `_batch_p2p` once; later calls return the same recorder."""
        with cls._lock:
            if cls._installed is None:
                from torch.distributed.pipelining import schedules

                recorder = cls()
                original = schedules._batch_p2p

                def _batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
                    records = [recorder._record(op) for op in p2p_ops]
                    works = original(p2p_ops, desc)
                    if len(works) == len(records):
                        return [_TimedWork(work, record) for work, record in zip(works, records)]
                    # a coalesced batch returns one work for all of its ops
                    return [_TimedWork(work, records[-1]) for work in works]

                _batch_p2p.__wrapped__ = original  # type: ignore[attr-defined]
                schedules._batch_p2p = _batch_p2p
                cls._installed = recorder
            return cls._installed

    def new_step(self, step: int) -> None:
        self.step = step
        self._counts = {}

    def _record(self, op: Any) -> dict[str, Any]:
        kind = "send" if op.op is dist.isend else "recv"
        peer = int(op.peer)
        index = self._counts.get((kind, peer), 0)
        self._counts[(kind, peer)] = index + 1
        group = op.group if op.group is not None else dist.distributed_c10d._get_default_group()
        record = {
            "source": "pipeline",
            "op": kind,
            "peer": peer,
            "group": self.names.get(group.group_name, f"group {group.group_name}"),
            "seq": next(self._seq),
            "bytes": op.tensor.numel() * op.tensor.element_size(),
            "step": self.step,
            "index": index,
            "created_ns": time.time_ns(),
            "finished_ns": None,
        }
        self.records.append(record)
        return record

    def snapshot(self) -> list[dict[str, Any]]:
        return [dict(record) for record in list(self.records)]
