"""The one exception configuration problems are reported with.

Every check of a composed config (schema, validation, the CLI's preflight) raises `ConfigError`, whose
text is one line `key: what is wrong and what is allowed`; the CLI prints it without a traceback and
exits with status 2. `DoesNotFitError` is the memory preflight's verdict (exit status 3, as `mode=plan` for a
configuration that does not fit). This module imports nothing, so any module may raise them.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration, reported as `key: what is wrong and what is allowed`."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


class DoesNotFitError(RuntimeError):
    """The planner's memory estimate exceeds what this machine has free: one line, exit status 3."""
