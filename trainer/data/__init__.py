"""Data sources, token windows and the data-parallel-exact stateful loader.

Exports are resolved lazily (PEP 562) so that ``python -m trainer.data.prepare``
and config-only imports do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.data.build import build_loaders
    from trainer.data.config import (SCHEMAS, MegatronDataConfig, MixtureDataConfig, NanoGPTDataConfig,
                                     StdlibDataConfig, TokenFileDataConfig)
    from trainer.data.formats import MegatronIndexedDataset, NanoGPTDataset, open_source
    from trainer.data.loader import SourceValidation, StatefulLoader, TokenWindows, TrainLoader, val_batches
    from trainer.data.mixture import DataSourceError, MixtureData, MixtureLoader
    from trainer.data.stdlib_corpus import StdlibCorpus
    from trainer.data.token_file import TokenFileDataset

__all__ = [
    "StdlibCorpus",
    "TokenFileDataset",
    "TokenWindows",
    "TrainLoader",
    "StatefulLoader",
    "val_batches",
    "StdlibDataConfig",
    "TokenFileDataConfig",
    "SCHEMAS",
    "MegatronDataConfig",
    "NanoGPTDataConfig",
    "MixtureDataConfig",
    "MegatronIndexedDataset",
    "NanoGPTDataset",
    "open_source",
    "SourceValidation",
    "MixtureData",
    "MixtureLoader",
    "DataSourceError",
    "build_loaders",
    "check_data",
]

_EXPORTS = {
    "StdlibCorpus": "trainer.data.stdlib_corpus",
    "TokenFileDataset": "trainer.data.token_file",
    "TokenWindows": "trainer.data.loader",
    "TrainLoader": "trainer.data.loader",
    "StatefulLoader": "trainer.data.loader",
    "val_batches": "trainer.data.loader",
    "StdlibDataConfig": "trainer.data.config",
    "TokenFileDataConfig": "trainer.data.config",
    "SCHEMAS": "trainer.data.config",
    "MegatronDataConfig": "trainer.data.config",
    "NanoGPTDataConfig": "trainer.data.config",
    "MixtureDataConfig": "trainer.data.config",
    "MegatronIndexedDataset": "trainer.data.formats",
    "NanoGPTDataset": "trainer.data.formats",
    "open_source": "trainer.data.formats",
    "SourceValidation": "trainer.data.loader",
    "MixtureData": "trainer.data.mixture",
    "MixtureLoader": "trainer.data.mixture",
    "DataSourceError": "trainer.data.mixture",
    "build_loaders": "trainer.data.build",
    "check_data": "trainer.data.build",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
