"""The Hugging Face side of a model family: what `trainer.checkpoint.hf` needs to export a model to the
files transformers reads (config.json + safetensors) and to import them back.

An adapter maps configs and names only (no file I/O); `trainer.checkpoint.hf` does the files, the
gathering and the per-rank slicing for every family alike. The hooks below that have a body are the
defaults a family without that feature keeps. (The model-family contract of issue 28 makes the adapter one
of the family's declared parts.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class HFAdapter:
    """Config.json both ways, our weight names to transformers', stacked expert weights to one tensor per
    expert. Subclasses set `config_class` and `model_types` and implement the three mappings."""

    config_class: type  # our config dataclass
    model_types: tuple[str, ...]  # the config.json `model_type`s it reads

    def hf_config(self, config: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """`config.json` for our config."""
        raise NotImplementedError

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf") -> Any:
        """Our config for a `config.json` (ValueError for what the model does not implement)."""
        raise NotImplementedError

    def hf_name(self, name: str) -> str:
        """transformers' name of one of our (non-stacked) weights (KeyError: none)."""
        raise NotImplementedError

    def check(self, config: Any) -> None:
        """Raise ValueError when transformers has no counterpart of this config."""
        del config

    def ignored_mismatch_fields(self, config: Any) -> tuple[str, ...]:
        """Config fields an init_from run need not agree on (they change no tensor of this config)."""
        del config
        return ()

    def skipped(self, name: str) -> bool:
        """Our state-dict entries that transformers has no tensor for (neither exported nor imported)."""
        del name
        return False

    def optional(self, name: str) -> bool:
        """Our weights a Hugging Face directory may lack: import keeps their initialization (and warns)."""
        del name
        return False

    def stacked_hf_names(self, name: str, count: int) -> Optional[list[str]]:
        """For a weight stacked on dim 0 (`count` experts), transformers' name of each slice; else None."""
        del name, count
        return None

    def extra_tensors(self, config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors the published layout holds besides one per weight (copies of shared weights), from
        the full state dict `state` (our names)."""
        del config, state
        return {}
