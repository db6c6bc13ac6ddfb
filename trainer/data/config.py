"""Typed Hydra schemas for the ``data`` config group.

The dataclasses are registered in Hydra's ConfigStore (group ``data``, names
``stdlib_schema`` / ``token_file_schema``) elsewhere; ``conf/data/*.yaml`` list
them first in their defaults so that typos and wrong types fail at compose time.
This module deliberately imports nothing heavy (no torch, no numpy).
"""

from dataclasses import dataclass
from typing import Optional

__all__ = ["SCHEMAS", "StdlibDataConfig", "TokenFileDataConfig"]


@dataclass
class StdlibDataConfig:
    """Byte-level corpus built from the running interpreter's standard library.

    Fields:
        _target_: class instantiated by ``hydra.utils.instantiate``.
        val_fraction: share of *files* held out for validation, chosen by a
            stable hash of each file's relative path.
        max_bytes: hard cap on training bytes (validation is capped at
            ``max_bytes * val_fraction``); ``null`` keeps everything.
        include_tests: also use the ``test``/``tests``/``idle_test`` packages.
        root: directory to scan instead of the stdlib (mainly for tests).
    """

    _target_: str = "trainer.data.StdlibCorpus"
    # Whole files go to validation so that no file leaks into both splits.
    val_fraction: float = 0.05
    # Optional[...] rather than ``int | None``: OmegaConf validates the typing form.
    max_bytes: Optional[int] = 16_000_000
    # The test suites are large and repetitive; off by default.
    include_tests: bool = False
    # None means sysconfig.get_paths()["stdlib"] of the running interpreter.
    root: Optional[str] = None


@dataclass
class TokenFileDataConfig:
    """Pre-tokenized dataset written by ``python -m trainer.data.prepare``.

    Fields:
        _target_: class instantiated by ``hydra.utils.instantiate``.
        path: directory holding ``train.bin``, ``val.bin`` and ``meta.json``
            (mandatory, ``???`` in the YAML).
    """

    _target_: str = "trainer.data.TokenFileDataset"
    # Mandatory: there is no sensible default location for a prepared dataset.
    path: str = "???"


# Schema of each data source, registered in Hydra's ConfigStore as `<name>_schema` by
# trainer.config.register_configs (conf/data/*.yaml names it in its defaults list).
SCHEMAS: dict[str, type] = {"stdlib": StdlibDataConfig, "token_file": TokenFileDataConfig}
