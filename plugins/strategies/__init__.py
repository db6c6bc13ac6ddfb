"""Strategy plugins: how the model is placed, split and kept in sync across processes."""

from trainer.plugins.strategies.base import SingleDevice, SingleDeviceConfig, Strategy
from trainer.plugins.strategies.ddp import DDP, DDPConfig, ZeRO1, ZeRO1Config
from trainer.plugins.strategies.distributed import DistributedStrategy
from trainer.plugins.strategies.fsdp import FSDP, FSDPConfig
from trainer.plugins.strategies.tensor_parallel import TensorParallelConfig
from trainer.plugins.strategies.pipeline import PipelineParallelConfig
from trainer.plugins.strategies.three_d import ThreeDConfig

# Schema of each strategy, registered in Hydra's ConfigStore as `<name>_schema` (conf/strategy/*.yaml
# names it in its defaults list).
STRATEGY_SCHEMAS: dict[str, type] = {
    "single": SingleDeviceConfig,
    "ddp": DDPConfig,
    "zero1": ZeRO1Config,
    "fsdp": FSDPConfig,
    "tp": TensorParallelConfig,
    "pp": PipelineParallelConfig,
    "3d": ThreeDConfig,
}

__all__ = [
    "Strategy", "SingleDevice", "SingleDeviceConfig", "DistributedStrategy",
    "DDP", "DDPConfig", "ZeRO1", "ZeRO1Config", "FSDP", "FSDPConfig", "STRATEGY_SCHEMAS",
]
