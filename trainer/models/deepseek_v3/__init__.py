"""DeepSeek-V3: multi-head latent attention, DeepSeekMoE, multi-token prediction (one folder per family:
`model.py` config and modules, `mla.py` attention and YaRN RoPE, `moe.py` routing, `hf_adapter.py`
transformers' names and config)."""

from trainer.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Config

__all__ = ["DeepSeekV3", "DeepSeekV3Config"]
