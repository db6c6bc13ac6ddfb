"""The plugin interfaces the core calls: strategy, precision, activation checkpointing, LR schedule, a model
family's Hugging Face adapter (the callback interface is `trainer.callback.Callback`).

trainer/plugins implements them and depends on trainer/; the loop, the checkpoint code and the models
know only these classes (tests/test_layering.py keeps it that way).
"""

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
from trainer.interfaces.hf_adapter import HFAdapter
from trainer.interfaces.inventory import ModelInventory, ParamSpec
from trainer.interfaces.lr_schedule import LRSchedule
from trainer.interfaces.precision import DTYPE_NAMES, DTYPES, Precision
from trainer.interfaces.strategy import MicroBatch, Strategy

__all__ = ["ActivationCheckpointing", "HFAdapter", "LRSchedule", "ModelInventory", "ParamSpec", "Precision", "DTYPES",
           "DTYPE_NAMES", "Strategy", "MicroBatch"]
