"""Strategy plugins: how the model is placed, split and kept in sync across processes.

Every strategy class is exported here: its `_target_` is `trainer.plugins.strategies.<Class>`, never the
module it happens to live in (tests/test_targets.py).
"""

from trainer.interfaces.strategy import Strategy
from trainer.plugins.strategies.single import SingleDevice, SingleDeviceConfig
from trainer.plugins.strategies.ddp import DDP, DDPConfig, ZeRO1, ZeRO1Config
from trainer.plugins.strategies.distributed import DistributedStrategy
from trainer.plugins.strategies.fsdp import FSDP, FSDPConfig, FSDPOptions, FSDPSharding
from trainer.plugins.strategies.tensor_parallel import TensorParallel, TensorParallelConfig
from trainer.plugins.strategies.pipeline import PipelineParallel, PipelineParallelConfig
from trainer.plugins.strategies.three_d import ThreeD, ThreeDConfig
from trainer.plugins.strategies.zero2 import ZeRO2, ZeRO2Config

# Schema of each strategy, registered in Hydra's ConfigStore as `<name>_schema` (conf/strategy/*.yaml
# names it in its defaults list).
STRATEGY_SCHEMAS: dict[str, type] = {
    "single": SingleDeviceConfig,
    "ddp": DDPConfig,
    "zero1": ZeRO1Config,
    "zero2": ZeRO2Config,
    "fsdp": FSDPConfig,
    "tp": TensorParallelConfig,
    "pp": PipelineParallelConfig,
    "3d": ThreeDConfig,
}
SCHEMAS = STRATEGY_SCHEMAS  # the name every config family exports (trainer.config.registry)

__all__ = [
    "Strategy", "SingleDevice", "SingleDeviceConfig", "DistributedStrategy",
    "DDP", "DDPConfig", "ZeRO1", "ZeRO1Config", "ZeRO2", "ZeRO2Config", "FSDP", "FSDPConfig", "FSDPOptions",
    "FSDPSharding", "TensorParallel", "TensorParallelConfig", "PipelineParallel", "PipelineParallelConfig", "ThreeD",
    "ThreeDConfig", "STRATEGY_SCHEMAS", "SCHEMAS",
]
