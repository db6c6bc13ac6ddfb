"""DeepSeek-V3 <-> Hugging Face: transformers' `DeepseekV3ForCausalLM` names and config, and the MTP layer
in DeepSeek's published checkpoint layout.

Export writes the layout of the Hub checkpoint `deepseek-ai/DeepSeek-V3`: one tensor per routed expert
(`model.layers.<i>.mlp.experts.<j>.gate_proj.weight`, ...; transformers >= 5 fuses them into its
`gate_up_proj` / `down_proj` when loading), and MTP depth k as `model.layers.<n_layers + k - 1>.*` (its
decoder block's weights under the usual names, plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and
copies of the shared embedding and head as `embed_tokens` and `shared_head.head`, which the published
checkpoint holds and `DeepseekV3ForCausalLM` ignores: `extra_tensors`). Import (`trainer/checkpoint/hf.py`)
reads both the per-expert and transformers' fused expert tensors; an MTP layer absent from the directory
(a `save_pretrained` of DeepseekV3ForCausalLM) leaves the model's initialized MTP weights in place
(`optional`; a warning says so).

The adapter only maps names and configs (the `HFAdapter` interface); reading and writing files is
`trainer/checkpoint/hf.py`'s job (it finds this adapter as the DeepSeek-V3 family's `hf_adapter`, by config
class and by `model_type`). It raises ValueError for what has no counterpart. The embeddings are never
tied (`tie_embeddings` is always false), so `tied_source` keeps its default.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from trainer.interfaces.hf_adapter import HFAdapter, transformers_fused_experts
from trainer.models.deepseek_v3.model import DeepSeekV3Config

# Per block: ours -> transformers' (under `model.layers.<i>.`).
_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# Stacked routed experts: ours [E, ...] -> one tensor per expert.
_EXPERT_NAMES = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
                 "feed_forward.experts.w2": "down_proj"}
# MTP depth extras: ours (under `mtp.<index>.`) -> DeepSeek's checkpoint (under `model.layers.<index>.`).
_MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
              "norm.weight": "shared_head.norm.weight"}
_GLOBAL_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")


class DeepSeekV3HFAdapter(HFAdapter):
    """Names, tensors and config.json of transformers' DeepseekV3ForCausalLM (see the module docstring)."""

    config_class = DeepSeekV3Config
    model_types = ("deepseek_v3",)
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"

    # ---- config --------------------------------------------------------------------------------------
    def hf_config(self, config: DeepSeekV3Config, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for `config` (transformers' fields, and those of the published config it ignores)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.yarn:
            rope = {"rope_type": "yarn", "type": "yarn", "rope_theta": config.rope_theta, "factor": config.yarn_factor,
                    "original_max_position_embeddings": config.yarn_original_max_seq_len,
                    "beta_fast": config.yarn_beta_fast, "beta_slow": config.yarn_beta_slow,
                    "mscale": config.yarn_mscale, "mscale_all_dim": config.yarn_mscale_all_dim}
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": config.vocab_size, "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_heads,
            "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim, "intermediate_size": config.ffn_hidden_dim,
            "moe_intermediate_size": config.moe_hidden_dim, "first_k_dense_replace": config.first_k_dense_replace,
            "n_routed_experts": config.n_experts, "num_experts_per_tok": config.top_k,
            "n_shared_experts": config.n_shared_experts, "n_group": config.n_group, "topk_group": config.topk_group,
            "norm_topk_prob": config.norm_topk_prob, "routed_scaling_factor": config.routed_scaling_factor,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
            "num_nextn_predict_layers": config.mtp_depth, "hidden_act": "silu", "attention_bias": False,
            "rms_norm_eps": config.norm_eps, "max_position_embeddings": config.max_seq_len,
            # transformers < 5 reads rope_theta / rope_scaling, >= 5 rope_parameters
            "rope_theta": config.rope_theta, "rope_scaling": rope if config.yarn else None, "rope_parameters": rope,
            "rope_interleave": config.rope_interleave, "tie_word_embeddings": False,
            "initializer_range": config.init_std, "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def config_from_hf(self, hf: dict[str, Any], name: str = "hf") -> DeepSeekV3Config:
        """Our config for a DeepSeek-V3 config.json; ValueError for what this model does not implement."""
        if hf.get("model_type") != self.model_type:
            raise ValueError(f"model_type={hf.get('model_type')!r} is not {self.model_type!r}")
        problems = []
        if hf.get("attention_bias"):
            problems.append("attention biases")
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={hf['hidden_act']!r} (only silu)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            problems.append("routing other than sigmoid scores with noaux_tc group-limited top-k")
        if hf.get("moe_layer_freq", 1) != 1:
            problems.append(f"moe_layer_freq={hf['moe_layer_freq']} (every layer after the dense ones is MoE)")
        if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
            problems.append("num_key_value_heads != num_attention_heads (MLA has one key/value per head)")
        if hf.get("tie_word_embeddings"):
            problems.append("tied embeddings")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            problems.append(f"RoPE scaling {rope_type!r} (only plain RoPE and YaRN)")
        if rope_type == "yarn" and (rope.get("attention_factor") is not None or rope.get("truncate", True) is not True
                                    or rope.get("factor") is None):
            problems.append("YaRN with an explicit attention_factor, truncate=false or no factor")
        if problems:
            raise ValueError("this DeepSeek-V3 config has no counterpart here: " + "; ".join(problems))
        yarn: dict[str, Any] = {"yarn_factor": 1.0}
        if rope_type == "yarn":
            yarn = dict(yarn_factor=float(rope["factor"]),
                        yarn_original_max_seq_len=int(rope.get("original_max_position_embeddings",
                                                               hf.get("max_position_embeddings", 4096))),
                        yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
                        yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
                        yarn_mscale=float(rope.get("mscale") or 0.0),
                        yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
        return DeepSeekV3Config(
            name=name, vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"], q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], ffn_hidden_dim=hf["intermediate_size"],
            first_k_dense_replace=hf.get("first_k_dense_replace", 0), n_experts=hf["n_routed_experts"],
            top_k=hf["num_experts_per_tok"], n_shared_experts=hf.get("n_shared_experts") or 0,
            moe_hidden_dim=hf["moe_intermediate_size"], n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            mtp_depth=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            max_seq_len=int(hf.get("max_position_embeddings", 4096)),
            init_std=float(hf.get("initializer_range", 0.006)), **yarn)

    # ---- names ---------------------------------------------------------------------------------------
    def optional(self, name: str) -> bool:
        """The MTP module's weights: a `save_pretrained` of DeepseekV3ForCausalLM has none (they keep
        their initialization on import)."""
        return name.startswith("mtp.")

    @staticmethod
    def _prefix(name: str) -> Optional[tuple[str, str]]:
        """(transformers' prefix, the block-relative rest) of one of our block weights (a decoder layer's
        or an MTP depth's), else None."""
        layer = _LAYER.match(name)
        if layer:
            return f"model.layers.{layer.group(1)}", layer.group(2)
        mtp = _MTP.match(name)
        if mtp and mtp.group(2).startswith("block."):
            return f"model.layers.{mtp.group(1)}", mtp.group(2)[len("block."):]
        return None

    def hf_name(self, name: str) -> str:
        """transformers' (for MTP: the published checkpoint's) name of one of our non-stacked weights."""
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        block = self._prefix(name)
        if block is not None and block[1] in _BLOCK_NAMES:
            return f"{block[0]}.{_BLOCK_NAMES[block[1]]}"
        mtp = _MTP.match(name)
        if mtp and mtp.group(2) in _MTP_NAMES:
            return f"model.layers.{mtp.group(1)}.{_MTP_NAMES[mtp.group(2)]}"
        raise KeyError(f"{name} has no Hugging Face DeepSeek-V3 counterpart")

    def stacked_hf_names(self, name: str, count: int) -> Optional[list[str]]:
        """For a stacked routed-expert weight ([count, ...]), one name per expert; None otherwise."""
        block = self._prefix(name)
        if block is None or block[1] not in _EXPERT_NAMES:
            return None
        return [f"{block[0]}.mlp.experts.{j}.{_EXPERT_NAMES[block[1]]}.weight" for j in range(count)]

    def fused_hf_tensor(self, name: str) -> Optional[tuple[str, int, int]]:
        """transformers (>= 5)'s fused `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` holding a
        stacked routed-expert weight."""
        names = self.stacked_hf_names(name, 1)
        return None if names is None else transformers_fused_experts(names[0])

    def extra_tensors(self, config: DeepSeekV3Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The published checkpoint's copies of the shared embedding and head in each MTP layer (which
        `DeepseekV3ForCausalLM` ignores and import never reads)."""
        out: dict[str, torch.Tensor] = {}
        for depth in range(config.mtp_depth):
            index = config.n_layers + depth
            if "tok_embeddings.weight" in state:
                out[f"model.layers.{index}.embed_tokens.weight"] = state["tok_embeddings.weight"].clone()
            if "output.weight" in state:
                out[f"model.layers.{index}.shared_head.head.weight"] = state["output.weight"].clone()
        return out
