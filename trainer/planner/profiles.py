"""Calibrated hardware profiles of this machine, cached per machine, torch version and process count.

`mode=plan plan.calibrate=true` measures this machine (trainer/planner/calibrate.py: matmul FLOP/s and
memory bandwidth per process with every process busy, each process group's latency and bandwidth, the
fractions of the peak the model's own matmuls and attention reach). `strategy=auto` ranks layouts on such
a profile, so it keeps one per machine: a JSON file under `plan.profile_dir` (default
`$TRAINER_CACHE_DIR/profiles`, else `~/.cache/trainer/profiles`) named after the key below. A calibration
writes it; `strategy=auto` reads it and calibrates only when it is missing.

The key holds what changes the figures: the host, the CPU model and core count (or the GPU model), the
device type, the torch version and the processes per node (per-process figures are measured with all of
them busy, so 2 and 4 processes on one CPU are two profiles).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from trainer.planner.hardware import HardwareConfig

PROFILE_VERSION = 1
CACHE_ENV = "TRAINER_CACHE_DIR"


@dataclass(frozen=True)
class CachedProfile:
    """A calibrated profile as `strategy=auto` uses it."""

    hardware: HardwareConfig
    # Fractions of the calibrated peak the model's matmuls and attention core reached (plan.matmul_efficiency,
    # plan.attention_efficiency; None: the matmuls' rate).
    matmul_efficiency: float
    attention_efficiency: Optional[float]
    path: Path  # the cache file
    source: str  # what was calibrated (the command), for the record


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown cpu"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else (platform.processor() or "unknown cpu")


def machine_key(device_type: str, local_ranks: int) -> dict[str, Any]:
    """What a profile of this machine depends on (see the module docstring)."""
    if device_type == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = _cpu_model()
    return {"host": platform.node(), "device_type": device_type, "device": device, "cores": os.cpu_count(),
            "torch": torch.__version__, "processes_per_node": int(local_ranks), "version": PROFILE_VERSION}


def cache_directory(configured: Optional[str]) -> Path:
    """`plan.profile_dir`, else $TRAINER_CACHE_DIR/profiles, else ~/.cache/trainer/profiles."""
    if configured:
        return Path(configured).expanduser()
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "trainer") / "profiles"


def profile_path(directory: Path, key: dict[str, Any]) -> Path:
    """The cache file of `key`: readable names, and a hash of the whole key so that no two keys share one."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{key['device_type']}-{key['processes_per_node']}p-torch{key['torch']}")
    return directory / f"{slug.strip('-')}-{digest}.json"


def load_profile(directory: Path, key: dict[str, Any]) -> Optional[CachedProfile]:
    """The cached profile of `key`, None when there is none (or it is unreadable: calibrated again)."""
    path = profile_path(directory, key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        hardware = HardwareConfig(**data["hardware"])
        return CachedProfile(hardware, float(data["matmul_efficiency"]), data.get("attention_efficiency"), path,
                             str(data.get("source", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_profile(directory: Path, key: dict[str, Any], hardware: HardwareConfig, matmul_efficiency: float,
                  attention_efficiency: Optional[float], source: str) -> Path:
    """Write the profile of `key` (atomically: a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = profile_path(directory, key)
    data = {"key": key, "hardware": dataclasses.asdict(hardware), "matmul_efficiency": matmul_efficiency,
            "attention_efficiency": attention_efficiency, "source": source,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(temporary, path)
    return path
