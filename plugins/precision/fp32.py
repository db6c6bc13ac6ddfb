"""`precision=fp32`: the interface's identity behaviour, as a plugin of its own."""

from __future__ import annotations

from trainer.interfaces.precision import Precision


class FP32Precision(Precision):
    """Plain fp32 training (the reference all other precisions are compared with)."""
