"""Callback plugins (Lightning's hook names; see trainer.callback.Callback)."""

from trainer.plugins.callbacks.checkpoint import CheckpointManager, CheckpointManagerConfig
from trainer.plugins.callbacks.monitors import (
    MemoryMonitor,
    MemoryMonitorConfig,
    ThroughputMonitor,
    ThroughputMonitorConfig,
)
from trainer.plugins.callbacks.progress import ProgressBar, ProgressBarConfig
from trainer.plugins.callbacks.stabilizer import LossSpikeStabilizer, LossSpikeStabilizerConfig

# Schema of each callback option, registered in Hydra's ConfigStore as `<name>_schema` under the package
# `callbacks.<name>` (conf/callbacks/*.yaml lists the ones it combines, e.g. default.yaml: progress_bar,
# throughput, memory).
SCHEMAS: dict[str, type] = {
    "progress_bar": ProgressBarConfig,
    "throughput": ThroughputMonitorConfig,
    "memory": MemoryMonitorConfig,
    "stabilizer": LossSpikeStabilizerConfig,
    "checkpoint": CheckpointManagerConfig,
}

__all__ = [
    "ProgressBar", "ProgressBarConfig", "ThroughputMonitor", "ThroughputMonitorConfig", "MemoryMonitor",
    "MemoryMonitorConfig", "LossSpikeStabilizer", "LossSpikeStabilizerConfig", "CheckpointManager",
    "CheckpointManagerConfig", "SCHEMAS",
]
