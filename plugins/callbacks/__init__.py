"""Callback plugins (Lightning's hook names; see trainer.callback.Callback)."""

from trainer.plugins.callbacks.progress import ProgressBar

__all__ = ["ProgressBar"]
