"""`strategy=single`: one process, one device, the interface's default behaviour."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.interfaces.strategy import Strategy


class SingleDevice(Strategy):
    """One process, one device: the reference every other strategy is checked against."""


@dataclass
class SingleDeviceConfig:
    """Schema of `strategy=single`."""

    _target_: str = "trainer.plugins.strategies.SingleDevice"
