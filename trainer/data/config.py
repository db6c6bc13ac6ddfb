"""Typed Hydra schemas for the ``data`` config group.

The dataclasses are registered in Hydra's ConfigStore (group ``data``, names
``stdlib_schema`` / ``token_file_schema``) elsewhere; ``conf/data/*.yaml`` list
them first in their defaults so that typos and wrong types fail at compose time.
This module deliberately imports nothing heavy (no torch, no numpy).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["SCHEMAS", "DataOptions", "source_config", "DATA_OPTIONS", "StdlibDataConfig", "TokenFileDataConfig", "MegatronDataConfig", "NanoGPTDataConfig",
           "SourceConfig", "ScheduleEntry", "MixtureDataConfig"]


@dataclass
class DataOptions:
    """Options of every data source that the loop, not the source, acts on (`source_config` drops them
    before the source is built)."""

    # Packed sequences without crosstalk: attention stays inside each document (documents end with the
    # source's end-of-document token) and positions restart at every document (trainer/models/documents.py).
    document_masking: bool = False


def source_config(data_cfg: Any) -> Any:
    """The data node without the `DataOptions` fields: what the source class is built from."""
    from omegaconf import OmegaConf

    keys = [key for key in data_cfg.keys() if key not in DATA_OPTIONS]
    return OmegaConf.masked_copy(data_cfg, keys)


DATA_OPTIONS = ("document_masking",)


@dataclass
class StdlibDataConfig(DataOptions):
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
class TokenFileDataConfig(DataOptions):
    """Pre-tokenized dataset written by ``python -m trainer.data.prepare``.

    Fields:
        _target_: class instantiated by ``hydra.utils.instantiate``.
        path: directory holding ``train.bin``, ``val.bin`` and ``meta.json``
            (mandatory, ``???`` in the YAML).
    """

    _target_: str = "trainer.data.TokenFileDataset"
    # Mandatory: there is no sensible default location for a prepared dataset.
    path: str = "???"


@dataclass
class MegatronDataConfig(DataOptions):
    """A Megatron-LM indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) read as it is.

    Fields:
        _target_: class instantiated by ``hydra.utils.instantiate``.
        path: the prefix (or either file's path).
        vocab_size: the tokenizer's vocabulary (the index does not store it; mandatory).
        eos_id: the end-of-document id Megatron's ``--append-eod`` added, or null.
        val_path: prefix of a separate validation pair; null holds out the last documents.
        val_fraction: share of documents held out when ``val_path`` is null.
    """

    _target_: str = "trainer.data.MegatronIndexedDataset"
    path: str = "???"
    vocab_size: int = "???"  # type: ignore[assignment]  # mandatory: OmegaConf's MISSING
    eos_id: Optional[int] = None
    val_path: Optional[str] = None
    val_fraction: float = 0.01


@dataclass
class NanoGPTDataConfig(DataOptions):
    """nanoGPT's ``train.bin``/``val.bin`` (uint16 ids) read as they are.

    Fields:
        _target_: class instantiated by ``hydra.utils.instantiate``.
        path: the directory holding train.bin (or train.bin's own path).
        vocab_size: null takes meta.pkl's ``vocab_size``, else GPT-2's 50257.
        eos_id: null means 50256 for the GPT-2 vocabulary, none otherwise.
    """

    _target_: str = "trainer.data.NanoGPTDataset"
    path: str = "???"
    vocab_size: Optional[int] = None
    eos_id: Optional[int] = None


@dataclass
class SourceConfig:
    """One source of a mixture.

    Fields:
        path: a prepared token directory, a Megatron prefix, a nanoGPT directory or train.bin.
        weight: its share of every global batch (relative; the weights are normalized), >= 0.
        name: the name in logs (``val_loss/<name>``), the schedule and checkpoints; null: the path's
            last component.
        format: ``auto`` (detected from the files), ``token_file``, ``megatron`` or ``nanogpt``.
        vocab_size: for Megatron (mandatory there) and nanoGPT; checked against a token file's meta.
        eos_id: the end-of-document id (Megatron, nanoGPT; checked against a token file's meta).
        val_path: Megatron: prefix of a separate validation pair.
        val_fraction: Megatron without ``val_path``: share of documents held out.
    """

    path: str = "???"
    weight: float = 1.0
    name: Optional[str] = None
    format: str = "auto"
    vocab_size: Optional[int] = None
    eos_id: Optional[int] = None
    val_path: Optional[str] = None
    val_fraction: float = 0.01


@dataclass
class ScheduleEntry:
    """New weights from a global batch on (e.g. the high-quality mix of a WSD cool-down).

    Fields:
        step: 0-based global batch from which the weights hold (the batch of optimizer step step + 1).
        weights: source name -> weight; sources not named get 0.
    """

    step: int = "???"  # type: ignore[assignment]
    weights: Dict[str, float] = field(default_factory=dict)


@dataclass
class MixtureDataConfig(DataOptions):
    """``data=mixture``: global batches drawn from several sources in proportion to their weights.

    Fields:
        _target_: class instantiated by ``hydra.utils.instantiate``.
        sources: the sources (at least one), e.g.
            ``data.sources=[{path: web, weight: 0.7}, {path: code, weight: 0.3}]``.
        schedule: weight changes from given steps, in increasing step order.
    """

    _target_: str = "trainer.data.MixtureData"
    sources: List[SourceConfig] = field(default_factory=list)
    schedule: List[ScheduleEntry] = field(default_factory=list)


# Schema of each data source, registered in Hydra's ConfigStore as `<name>_schema` by
# trainer.config.register_configs (conf/data/*.yaml names it in its defaults list).
SCHEMAS: dict[str, type] = {"stdlib": StdlibDataConfig, "token_file": TokenFileDataConfig,
                            "megatron": MegatronDataConfig, "nanogpt": NanoGPTDataConfig,
                            "mixture": MixtureDataConfig}
