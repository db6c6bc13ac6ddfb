"""The Hugging Face side of a model family: what `trainer.checkpoint.hf` needs to export a model to the
files transformers reads (config.json + safetensors) and to import them back.

An adapter maps configs and names only (no file I/O); `trainer.checkpoint.hf` does the files, the
gathering and the per-rank slicing for every family alike, and names no weight itself: every name (ours
and transformers') is the adapter's. The hooks below that have a body are the defaults a family without
that feature keeps. Each family declares its adapter as `hf_adapter` (`trainer.interfaces.ModelFamily`;
`trainer/models/<family>/hf_adapter.py`), None when transformers has no counterpart.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

# transformers' per-expert SwiGLU names (`<...>.experts.<j>.{gate,up,down}_proj.weight`, the Hub layout).
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def transformers_fused_experts(hf_name: str) -> Optional[tuple[str, int, int]]:
    """The fused tensor transformers (>= 5) saves in place of the per-expert tensor `hf_name` (`<...>.experts.
    <j>.{gate,up,down}_proj.weight`), as `HFAdapter.fused_hf_tensor` returns it: `<...>.experts.gate_up_proj`
    ([E, 2 x hidden, dim], the gate rows first: 2 parts, gate 0, up 1) or `<...>.experts.down_proj`
    ([E, dim, hidden]: 1 part); None for a name of another layout."""
    match = _PER_EXPERT.match(hf_name)
    if match is None:
        return None
    if match.group(2) == "down_proj":
        return f"{match.group(1)}.down_proj", 1, 0
    return f"{match.group(1)}.gate_up_proj", 2, 0 if match.group(2) == "gate_proj" else 1


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

    def tied_source(self, config: Any, name: str) -> Optional[str]:
        """The weight that our weight `name` is tied to under `config` (a tied head: the embedding), else
        None. Export writes only the source (transformers ties the copy itself); import reads the source's
        tensor into both."""
        del config, name
        return None

    def stacked_hf_names(self, name: str, count: int) -> Optional[list[str]]:
        """For a weight stacked on dim 0 (`count` experts), transformers' name of each slice; else None."""
        del name, count
        return None

    def fused_hf_tensor(self, name: str) -> Optional[tuple[str, int, int]]:
        """For a stacked weight, the tensor a transformers version that fuses the experts saves instead of
        the per-expert ones: (its name, the number of equal parts it concatenates along dim 1, the part
        that is this weight); None when there is none. Import reads it when the per-expert tensors are
        absent (`transformers_fused_experts` gives transformers >= 5's layout)."""
        del name
        return None

    def extra_tensors(self, config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors the published layout holds besides one per weight (copies of shared weights), from
        the full state dict `state` (our names)."""
        del config, state
        return {}
