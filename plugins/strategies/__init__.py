"""Strategy plugins: how the model is placed, split and kept in sync across processes."""

from plugins.strategies.base import SingleDevice, SingleDeviceConfig, Strategy

__all__ = ["Strategy", "SingleDevice", "SingleDeviceConfig"]
